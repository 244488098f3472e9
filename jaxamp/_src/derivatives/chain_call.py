"""A nest of :func:`jaxamp.grad` along scalar arguments as one equation of the program.

``grad(grad(u, 2), 2)(p, t, x)`` binds ``chain_p``: its operands are the closure constants and
the array arguments of ``u``'s traced body, its parameters the chain (:class:`chain.Chain`),
that body and the order and name of the body's value. Outside jaxamp's entry points any use of
it (eager, ``jit``, ``vmap``, ``jvp``) runs that one chain by the Derivatives engine; ``vmap``
keeps the equation, recording its batch axes, so the program still shows it. Its JVP along the
point's float32 scalars is the chain one step longer (:func:`_jvp`): ``jax.jacfwd``,
``jax.hessian``, ``jaxamp.jacfwd`` of a function holding chains write longer chains, requests
planned with the point's others, not derivatives of a plan; along anything else (the parameters)
it is the derivative of the chain's plan.

:func:`expand`, ``chain_p``'s program pass in the rule table (:data:`jaxamp._src.core.rules.RULES`),
run on each program :func:`jaxamp.scaled`, :func:`jaxamp.profile` and :func:`jaxamp.init` trace,
replaces the chain equations of one jaxpr that differentiate the same arguments by one plan
(the passes of ``u_x`` and ``u_xx`` shared): planned from the jaxpr, so the user's function is
traced once and nothing hangs on tracing order or object identity.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as jp
from jax.interpreters import ad, batching, mlir, partial_eval as pe

from jaxamp._src.derivatives import chain
from jaxamp._src.derivatives.prune import pruned
from jaxamp._src.core.interpreter import (atom, bind, eval_jaxpr, holds, split_arrays, sub_jaxprs, substitute,
                                            trace)
from jaxamp._src.core.marks import deriv_check, deriv_check_p, deriv_scale, flags_only, fresh, seed, unscale
from jaxamp._src.core.nesting import NO_DERIVATIVE, analyze, single_name
from jaxamp._src.core.rules import RULES, PrimitiveRules, evaluated, rules_of

__all__ = ["chain_p", "bind_chain", "bind_chains", "bind_entries", "expand", "expand_off", "has_chains"]

chain_p = jcore.Primitive("jaxamp_chain")
chain_p.multiple_results = True  # the top derivatives of its ``links``: requests at one point, one plan


def _parts(params: Dict[str, Any], operands: Sequence[Any]) -> Tuple[Sequence[Any], Sequence[Any], Sequence[Any]]:
    """A chain equation's operands (or anything laid out as they are: its levels' axes) as
    ``(closure constants, the point's arguments, direction operands)``."""
    n, m = params["n_consts"], len(operands) - params["n_dirs"]
    return operands[:n], operands[n:m], operands[m:]


def bind_chain(link: chain.Chain, args: Tuple[Any, ...], engine: bool = False) -> jax.Array:
    """The top derivative of ``link`` at the positional ``args`` (:func:`chain.eligible`)."""
    return bind_chains((link,), args, engine)[0]


def bind_chains(links: Sequence[chain.Chain], args: Tuple[Any, ...], engine: bool = False) -> List[jax.Array]:
    """The top derivatives of ``links`` (chains of one base returning a scalar) at the
    positional ``args``, as one ``chain_p`` equation over the traced body of their base: one
    plan. ``engine``: computed by the Derivatives engine with AMP off too (``method="forward"``),
    not as JAX's ``jax.grad``."""
    return _bind(links, args, False, engine)[1]


def bind_entries(links: Sequence[chain.Chain], args: Tuple[Any, ...], dirs: Sequence[Any] = ()
                 ) -> Tuple[Tuple[int, ...], List[jax.Array]]:
    """``(shape, derivatives)``: as :func:`bind_chains`, the base returning an array of
    ``shape``, each of ``links`` taken of each of its entries (entry-major: ``[(o, link) for o
    in entries for link in links]``); ``dirs``: the float32 scalars the links'
    :class:`chain.Along` steps index (operands of the equation after the point's)."""
    return _bind(links, args, True, dirs=dirs)


# Entries of a float32 vector argument up to which a chain's body takes it entry by entry.
MAX_SIZE = 16


def _entrywise(fun, args: Tuple[Any, ...]) -> Tuple[Any, Tuple[Any, ...]]:
    """``(fun', args')``: each float32 vector argument of at most :data:`MAX_SIZE` entries given
    as its entries (its place holding None, the entries after the arguments), so that a step
    along an entry of it is a step along a point's scalar (a chain one step longer), and
    chains at one point have one layout whichever argument each differentiates."""
    vecs = [i for i, a in enumerate(args) if hasattr(a, "dtype") and jnp.ndim(a) == 1
            and jnp.result_type(a) == jnp.float32 and 1 <= jnp.shape(a)[0] <= MAX_SIZE]
    if not vecs:
        return fun, args
    n, sizes = len(args), [jnp.shape(args[i])[0] for i in vecs]
    entries = tuple(args[i][k] for i, m in zip(vecs, sizes) for k in range(m))

    def rebuilt(*b):
        full, at = list(b[:n]), n
        for i, m in zip(vecs, sizes):
            full[i], at = jnp.stack(b[at:at + m]), at + m
        return fun(*full)

    return rebuilt, tuple(None if i in vecs else a for i, a in enumerate(args)) + entries


def _scalars_as_arguments(closed: jcore.ClosedJaxpr, flat: Sequence[Any]) -> Tuple[jcore.ClosedJaxpr, List[Any]]:
    """``closed`` with the traced float32 scalars it closes over as arguments after ``flat``'s:
    another coordinate of the point, which a closure holds (``jvp(lambda t: u(p, t, x), ...)``),
    so that a step along it is a chain's step and the chain is at the point of the others."""
    jaxpr = closed.jaxpr
    moved = [k for k, (v, c) in enumerate(zip(jaxpr.constvars, closed.consts))
             if isinstance(c, jax.core.Tracer) and v.aval.shape == () and v.aval.dtype == jnp.float32]
    if not moved:
        return closed, list(flat)
    keep = [k for k in range(len(closed.consts)) if k not in moved]
    info = jaxpr.debug_info
    names = None if info.arg_names is None else tuple(info.arg_names) + ("",) * len(moved)
    body = jaxpr.replace(constvars=[jaxpr.constvars[k] for k in keep],
                         invars=[*jaxpr.invars, *[jaxpr.constvars[k] for k in moved]],
                         debug_info=info._replace(arg_names=names))
    return (jcore.ClosedJaxpr(body, [closed.consts[k] for k in keep]),
            [*flat, *[closed.consts[k] for k in moved]])


def _flat_step(step: Any, starts: Sequence[int]) -> Any:
    """A step along the user's argument positions as one along the body's array arguments."""
    if isinstance(step, chain.Along):
        return chain.Along(tuple(starts[i] for i in step.args), step.dirs)
    return starts[step]


def _bind(links: Sequence[chain.Chain], args: Tuple[Any, ...], per_entry: bool, engine: bool = False,
          dirs: Sequence[Any] = ()):
    cols = {i for link in links for i in chain.positions(link)}
    user_fn = links[0].base
    args = tuple(jnp.float32(a) if i in cols and not hasattr(a, "dtype") else a for i, a in enumerate(args))
    base_fn, args = _entrywise(user_fn, args)
    scalar = not per_entry and all(link.out == () for link in links)
    closed, flat, _ = trace(lambda *a: chain.check_output("jaxamp.grad", user_fn, base_fn(*a), scalar=scalar),
                            args, {})
    closed, flat = _scalars_as_arguments(closed, flat)
    shape = tuple(closed.jaxpr.outvars[0].aval.shape)
    if per_entry:
        links = [dataclasses.replace(link, out=tuple(map(int, o))) for o in np.ndindex(*shape) for link in links]
    # each differentiated argument is one array leaf: its position among the body's arguments
    starts, n = [], 0
    for a in args:
        starts.append(n)
        n += len(split_arrays((a,), {})[0])
    flat_links = tuple(chain.Chain(link.base, tuple(_flat_step(a, starts) for a in link.argnums), link.wrts, link.of,
                                   link.out) for link in links)
    dirs = [jnp.asarray(d, jnp.float32) for d in dirs]
    if has_chains(closed.jaxpr):  # derivatives of derivatives: each inner chain longer
        return shape, _along(closed, flat_links, flat, dirs)
    base = analyze(closed.jaxpr, [NO_DERIVATIVE] * len(flat)).outs[0]
    params = dict(links=flat_links, body=closed.jaxpr, n_consts=len(closed.consts), n_dirs=len(dirs),
                  base_order=base.order, base_term=single_name(base), levels=(), shape=(), engine=engine, names=())
    return shape, chain_p.bind(*closed.consts, *flat, *dirs, **params)


def _run(members: Sequence[Dict[str, Any]], base_of: Sequence[int], consts: Sequence[Sequence[Any]],
         args: Sequence[Any], dirs: Sequence[Any] = (), dir_levels: Sequence[Sequence[Optional[int]]] = (),
         scaled: bool = False) -> List[jax.Array]:
    """The top derivatives of ``members`` (chain equations' params) at ``args``: one plan, the
    ``b``-th base evaluated on ``consts[b]``, the links' directions ``dirs`` (batched at
    ``dir_levels[k]`` by level ``k``); batched as the members' ``levels`` record; ``scaled``:
    under an entry point's scales (:func:`chain.evaluate`)."""
    first = members[0]
    bodies = [next(m["body"] for m, b in zip(members, base_of) if b == i) for i in range(len(consts))]
    links = [m["link"] for m in members]

    def fn(args, consts, dirs):
        bases = [_body_fn(body, c) for body, c in zip(bodies, consts)]
        return chain.evaluate(links, base_of, bases, tuple(args), first["base_order"], first["base_term"],
                              [body.outvars[0].aval.shape for body in bodies], dirs,
                              [m.get("soft", False) for m in members], scaled)

    return _batched(fn, members, base_of, consts, dir_levels)(list(args), [list(c) for c in consts], list(dirs))


def _batched(fn, members: Sequence[Dict[str, Any]], base_of: Sequence[int], consts: Sequence[Sequence[Any]],
             dir_levels: Sequence[Sequence[Optional[int]]] = ()):
    """``fn(args, consts, dirs)`` under the ``vmap`` of each level the members record, innermost first."""
    first = members[0]
    for k in range(len(first["levels"])):  # each vmap maps one recorded axis
        arg_axes = list(_parts(first, first["levels"][k])[1])
        const_axes = [list(next(m for m, b in zip(members, base_of) if b == i)["levels"][k][:len(c)])
                      for i, c in enumerate(consts)]
        fn = jax.vmap(fn, in_axes=(arg_axes, const_axes, list(dir_levels[k]) if dir_levels else []))
    return fn


def _jax_derivatives(*operands, **params) -> List[jax.Array]:
    """AMP off: each chain of the equation as JAX computes what its ``jaxamp.grad`` calls ask
    for, a nest of ``jax.grad`` of the body (batched as its levels record): the user's program."""
    body = params["body"]

    def fn(args, consts, dirs):
        f = _body_fn(body, consts[0])
        # the links of one call (grad(u, (1, 2))): one step each past a common nest, one jax.grad
        calls: Dict[Any, List[int]] = {}
        for j, link in enumerate(params["links"]):
            last = link.argnums[-1]
            calls.setdefault((link.out, link.argnums[:-1], isinstance(last, chain.Along) and j), []).append(j)
        outs: List[Any] = [None] * len(params["links"])
        for (out, nest, _), members in calls.items():
            g = f if out == () else functools.partial(lambda o, *a: f(*a)[o], out)
            for i in nest:
                g = _jax_step(g, i, dirs)
            last = tuple(params["links"][j].argnums[-1] for j in members)
            values = (jax.grad(g, last if len(last) > 1 else last[0]) if not isinstance(last[0], chain.Along)
                      else _jax_step(g, last[0], dirs))(*args)
            for j, v in zip(members, values if len(last) > 1 else (values,)):
                outs[j] = v
        return outs

    members = _members(params)
    consts, args, dirs = _parts(params, operands)
    dir_levels = [_parts(params, level)[2] for level in params["levels"]]
    return _batched(fn, members, [0] * len(members), [consts], dir_levels)(list(args), [list(consts)], list(dirs))


def _jax_step(g, step: Any, dirs: Sequence[Any]):
    """JAX's derivative of ``g`` for one step: ``jax.grad`` along an argument, ``jax.jvp``'s
    tangent along an :class:`chain.Along` direction."""
    if not isinstance(step, chain.Along):
        return jax.grad(g, step)

    def tangent(*a):
        line = lambda *z: g(*substitute(a, step.args, z))  # noqa: E731
        return jax.jvp(line, [a[i] for i in step.args], [jnp.asarray(dirs[d], jnp.result_type(a[i]))
                                                          for i, d in zip(step.args, step.dirs)])[1]

    return tangent


def _body_fn(body: jcore.Jaxpr, consts: Sequence[Any]):
    return lambda *a: eval_jaxpr(body, consts, a, bind)[0]


def _members(params: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One chain equation's params per link (``link`` its chain), as :func:`_run` reads them."""
    return [{**params, "link": link} for link in params["links"]]


def _impl(*operands, **params):
    members = _members(params)
    consts, args, dirs = _parts(params, operands)
    return _run(members, [0] * len(members), [consts], args, dirs, [_parts(params, lv)[2] for lv in params["levels"]])


def _batch(vals, dims, **params):
    size = next(v.shape[d] for v, d in zip(vals, dims) if d is not None)
    vals = [v if d is None else jnp.moveaxis(v, d, 0) for v, d in zip(vals, dims)]
    level = tuple(None if d is None else 0 for d in dims)
    outs = chain_p.bind(*vals, **{**params, "levels": params["levels"] + (level,), "shape": (size,) + params["shape"]})
    return outs, [0] * len(outs)


def _along(closed: jcore.ClosedJaxpr, links: Sequence[chain.Chain], flat: Sequence[Any], dirs: Sequence[Any] = ()
           ) -> List[jax.Array]:
    """The derivatives of ``closed`` (a body holding chains) along its scalar arguments
    ``link.argnums`` of each of ``links``, innermost first, by forward steps: each chain inside
    becomes longer chains (:func:`_jvp`), those at one point bound as one equation (one plan,
    :func:`_merged`); the rest of the body is differentiated as JAX does. Each step is scaled
    and checked as a ``jaxamp.grad`` step is (a direction step: its tangent along ``dirs``)."""

    closed = pruned(closed)  # inner chains at the body's own scalars, where a stack of them was read
    stacks = _stacks_of_arguments(closed.jaxpr)

    def body(names, *a):
        entries = {v: [a[closed.jaxpr.invars.index(e)] for e in es] for v, es in stacks.items()}
        return eval_jaxpr(closed.jaxpr, closed.consts, a, functools.partial(_inner_chain, entries, names))[0]

    def derivatives(*a):
        point, d = a[:len(flat)], a[len(flat):]
        outs = []
        for link in links:  # the chains inside name the steps they take on as the link does
            g = functools.partial(lambda out, names, *b: body(names, *b)[out], link.out, link.wrts)
            for k, (i, wrt) in enumerate(zip(link.argnums, link.wrts)):
                g = _step(g, i, dict(order=1, term=link.of if k == 0 else None, wrt=wrt), d)
            outs.append(g(*point))
        return outs

    stepped = _merged(pruned(jax.make_jaxpr(derivatives)(*flat, *dirs)))
    return eval_jaxpr(stepped.jaxpr, stepped.consts, [*flat, *dirs], bind)


def _stacks_of_arguments(jaxpr: jcore.Jaxpr) -> Dict[Any, List[Any]]:
    """``{vector: its entries}`` for the vectors ``jaxpr`` stacks from its own float32 scalar
    arguments (a small vector argument given entry by entry, rebuilt for the function)."""
    scalars = {v for v in jaxpr.invars if v.aval.shape == () and v.aval.dtype == jnp.float32}
    return {e.outvars[0]: list(e.invars) for e in jaxpr.eqns if e.primitive is jax.lax.stack_p
            and e.params["axis"] == 0 and all(not isinstance(v, jcore.Literal) and v in scalars for v in e.invars)}


def _inner_chain(stacks: Dict[Any, List[Any]], names: Tuple[Optional[str], ...], eqn, vals) -> List[Any]:
    """``eqn`` bound; a chain equation with ``names`` for the steps the derivatives around it add
    (:func:`_jvp`), and, closing over a vector of ``stacks`` (``{vector: the values of its
    entries}``: ``jvp(lambda t: u(p, t, x), ...)`` inside a derivative along ``x``), with that
    vector's entries among its point's arguments instead: a step along an entry is then a chain
    one step longer, planned with the point's other requests, not the derivative of the inner
    plan (and an entry not stepped along has no tangent, not a zero one)."""
    p = eqn.params
    if eqn.primitive is not chain_p:
        return bind(eqn, vals)
    if p["base_term"] is not None or any(link.of is not None for link in p["links"]):
        p = {**p, "names": tuple(names)}  # (unnamed chains: their steps stay in any order, the plan's)
    held = [k for k, v in enumerate(eqn.invars[:p["n_consts"]]) if v in stacks] if not p["levels"] else []
    if not held:
        return chain_p.bind(*vals, **p)
    consts, args, dirs = _parts(p, vals)
    kept = [c for k, c in enumerate(consts) if k not in held]
    entries = [e for k in held for e in stacks[eqn.invars[k]]]
    body = _entries_as_arguments(p["body"], held)
    return chain_p.bind(*kept, *args, *entries, *dirs, **{**p, "body": body, "n_consts": len(kept)})


def _entries_as_arguments(body: jcore.Jaxpr, held: Sequence[int]) -> jcore.Jaxpr:
    """``body`` (a chain's) with its closure constants at ``held`` (float32 vectors) taken as
    arguments entry by entry, after its own, each vector stacked from its entries first."""
    stacks = [jcore.new_jaxpr_eqn([jcore.Var(jax.core.ShapedArray((), jnp.float32))
                                   for _ in range(body.constvars[k].aval.shape[0])],
                                  [body.constvars[k]], jax.lax.stack_p, {"axis": 0}, jcore.no_effects) for k in held]
    entries = [v for e in stacks for v in e.invars]
    info = body.debug_info
    names = None if info.arg_names is None else tuple(info.arg_names) + ("",) * len(entries)
    return body.replace(constvars=[v for k, v in enumerate(body.constvars) if k not in held],
                        invars=[*body.invars, *entries], eqns=[*stacks, *body.eqns],
                        debug_info=info._replace(arg_names=names))


def _step(g, i: Any, marks: Dict[str, Any], dirs: Sequence[Any] = ()):
    """``g``'s derivative along its scalar argument ``i`` (an :class:`chain.Along`: along the
    arguments it moves, by ``dirs``): the tangent seeded with the scale of the step's key, the
    result checked and unscaled."""
    at = i.args if isinstance(i, chain.Along) else (i,)

    def derivative(*a):
        value = g(*a)
        s = deriv_scale(value, **marks)
        ones = [jnp.ones_like(a[j]) for j in at]
        if isinstance(i, chain.Along):
            ones = [e * dirs[d] for e, d in zip(ones, i.dirs)]
        line = lambda *z: g(*substitute(a, at, fresh(z)))  # noqa: E731
        _, d = jax.jvp(line, [a[j] for j in at], [seed(e, s) for e in ones])
        return unscale(deriv_check(d, value, **marks), jnp.float32(1.0) / s)

    return derivative


def _steppable(params: Dict[str, Any], i: int, primals: Sequence[Any]) -> bool:
    """Whether operand ``i`` is a point's float32 scalar the chain can take one more step along:
    an argument (not a closure constant, not a direction), batched at axis 0 by every level of
    the equation's vmaps (so that its tangent is laid out as the chain's value)."""
    return (params["n_consts"] <= i < len(primals) - params["n_dirs"] and jnp.result_type(primals[i]) == jnp.float32
            and all(level[i] == 0 for level in params["levels"]) and jnp.shape(primals[i]) == params["shape"])


def _jvp(primals, tangents, **params):
    """The tangents of chains: along their point's scalars, the chains one step longer (requests
    on the program, one equation, planned with the others at the point, whatever transformation
    asked); along anything else (the parameters), the derivative of the chains' plan."""
    links, n, names = params["links"], params["n_consts"], params.get("names", ())
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    params = {**params, "names": names[1:]}  # the next name is this step's
    outs = chain_p.bind(*primals, **params)
    steps = [i for i in live if _steppable(params, i, primals)]
    rest = [i for i in live if i not in steps]
    parts: List[List[Any]] = [[] for _ in links]
    if steps:
        wrt = names[0] if names else None
        longer = tuple(chain.Chain(link.base, link.argnums + (i - n,), link.wrts + (wrt,), link.of, link.out)
                       for link in links for i in steps)
        values = chain_p.bind(*primals, **{**params, "links": longer})
        for j in range(len(links)):
            parts[j] += [values[j * len(steps) + s] * tangents[i] for s, i in enumerate(steps)]
    if rest:
        tans = jax.jvp(lambda *r: _impl(*substitute(primals, rest, r), **params), [primals[i] for i in rest],
                       [ad.instantiate_zeros(tangents[i]) for i in rest])[1]
        for j, t in enumerate(tans):
            parts[j].append(t)
    return outs, [functools.reduce(lambda a, b: a + b, ps) if ps else ad.Zero(jax.typeof(o).to_tangent_aval())
                  for o, ps in zip(outs, parts)]


chain_p.def_impl(_impl)
chain_p.def_abstract_eval(lambda *_, shape, links, **__: [jax.core.ShapedArray(shape, jnp.float32)] * len(links))
ad.primitive_jvps[chain_p] = _jvp
batching.primitive_batchers[chain_p] = _batch
mlir.register_lowering(chain_p, mlir.lower_fun(_impl, multiple_results=True))


def _dce(used_outputs: List[bool], eqn):
    """Only the links whose values are read stay (a Hessian's entries a trace never reads)."""
    if not any(used_outputs):
        return [False] * len(eqn.invars), None
    links = tuple(link for link, used in zip(eqn.params["links"], used_outputs) if used)
    outvars = [v for v, used in zip(eqn.outvars, used_outputs) if used]
    return [True] * len(eqn.invars), eqn.replace(params={**eqn.params, "links": links}, outvars=outvars)


pe.dce_rules[chain_p] = _dce


def has_chains(jaxpr: jcore.Jaxpr, cache: Optional[Dict[Any, bool]] = None) -> bool:
    """Whether ``jaxpr`` or one of its bodies holds a ``chain_p`` equation (``cache``: as
    :func:`jaxamp._src.core.interpreter.holds`)."""
    return holds(jaxpr, frozenset((chain_p,)), cache)


def expand(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` with its chain equations computed, those of one jaxpr at the same arguments by
    one plan (``closed`` itself when it holds none)."""
    ctx = _Expanding()
    if not has_chains(closed.jaxpr, ctx.holds):
        return closed
    closed = pruned(closed)
    return jax.make_jaxpr(lambda *a: _evaluate(closed.jaxpr, closed.consts, a, ctx, None)[0])(*_avals(closed))


def expand_off(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` with AMP off: each chain equation computed as JAX's nest of ``jax.grad`` of its
    body, the rest as written (``closed`` itself when it holds none)."""
    ctx = _Expanding(off=True)
    if not has_chains(closed.jaxpr, ctx.holds):
        return closed
    return jax.make_jaxpr(lambda *a: _evaluate(closed.jaxpr, closed.consts, a, ctx, None)[0])(*_avals(closed))


def _avals(closed: jcore.ClosedJaxpr) -> List[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in closed.jaxpr.invars]


# Equations that only read or relabel their operand's entries (z[k] is a slice and a squeeze):
# two of them with the same parameters on the same operand give the same values.
_READS = (jp.slice_p, jp.squeeze_p, jp.reshape_p, jp.transpose_p, jp.broadcast_in_dim_p)


def _is_fresh(eqn) -> bool:
    """Whether ``eqn`` is :func:`jaxamp._src.core.marks.fresh`'s mark (identity on values)."""
    p, ins = eqn.params, eqn.invars
    return (eqn.primitive is deriv_check_p and len(ins) == 2 and ins[0] is ins[1]
            and not isinstance(ins[0], jcore.Literal) and p.get("order") == 0 and not p.get("check")
            and p.get("term") is None)


def _relabels(eqn) -> bool:
    """Whether ``eqn`` only relabels its operand's entries in order: a ``squeeze``, a row-major
    ``reshape``, a ``broadcast_in_dim`` that adds unit axes (the same entries, the same order)."""
    prim, (x,), (out,) = eqn.primitive, eqn.invars, eqn.outvars
    if prim is jp.squeeze_p:
        return True
    if prim is jp.transpose_p:  # only unit axes move
        moved = [d for d in eqn.params["permutation"] if x.aval.shape[d] != 1]
        return moved == sorted(moved)
    if prim is jp.reshape_p:
        return eqn.params.get("dimensions") is None
    dims = eqn.params.get("broadcast_dimensions", ())
    return (prim is jp.broadcast_in_dim_p and np.prod(x.aval.shape, dtype=int) == np.prod(out.aval.shape, dtype=int)
            and list(dims) == sorted(dims))


def _reads(jaxpr: jcore.Jaxpr) -> Dict[Any, Any]:
    """``{var: key}`` for each variable a chain of :data:`_READS` computes from another, the key
    equal for equal reads of the same variable: the entries of a vector ``z`` that two
    derivative calls at ``z`` each take (``jacfwd`` then ``hessian``) are the same operands.
    Relabels (:func:`_relabels`: a unit axis added then squeezed) are keyed by the shape they
    give and the read they relabel, however many there are; an entry sliced from a ``stack``
    (a vector rebuilt from its entries, as a derivative's body does) is a relabel of that entry."""
    keys: Dict[Any, Any] = {}
    stacked: Dict[Any, Tuple[int, List[Any]]] = {}  # a stack's variable -> (its axis, its parts' keys)

    def unlabeled(key):
        return key[2] if isinstance(key, tuple) and key[0] == "relabel" else key

    for eqn in jaxpr.eqns:
        if _is_fresh(eqn):  # the variable a step is taken along: its values are its operand's
            keys[eqn.outvars[0]] = keys.get(eqn.invars[0], eqn.invars[0])
            continue
        if eqn.primitive is jax.lax.stack_p and not any(isinstance(v, jcore.Literal) for v in eqn.invars):
            stacked[eqn.outvars[0]] = (eqn.params["axis"], [keys.get(v, v) for v in eqn.invars])
            if len(eqn.invars) == 1:  # one entry: a unit axis added
                keys[eqn.outvars[0]] = ("relabel", tuple(eqn.outvars[0].aval.shape),
                                        unlabeled(keys.get(eqn.invars[0], eqn.invars[0])))
            continue
        if eqn.primitive is jp.transpose_p and eqn.invars[0] in stacked:  # the stack's axis moved
            axis, parts = stacked[eqn.invars[0]]
            stacked[eqn.outvars[0]] = (list(eqn.params["permutation"]).index(axis), parts)
        part = _stacked_entry(eqn, stacked)
        if part is not None:
            keys[eqn.outvars[0]] = ("relabel", tuple(eqn.outvars[0].aval.shape), unlabeled(part))
            continue
        if eqn.primitive in _READS and len(eqn.invars) == 1 and not isinstance(eqn.invars[0], jcore.Literal):
            source = keys.get(eqn.invars[0], eqn.invars[0])
            try:
                if _relabels(eqn):
                    root = source[2] if isinstance(source, tuple) and source[0] == "relabel" else source
                    keys[eqn.outvars[0]] = ("relabel", tuple(eqn.outvars[0].aval.shape), root)
                else:
                    keys[eqn.outvars[0]] = (eqn.primitive, tuple(sorted(eqn.params.items())), source)
                hash(keys[eqn.outvars[0]])
            except TypeError:  # an unhashable parameter: the variable is its own key
                keys.pop(eqn.outvars[0], None)
    return keys


def _stacked_entry(eqn, stacked: Dict[Any, Tuple[int, List[Any]]]) -> Any:
    """The key of the part of a stack (of ``stacked``) that ``eqn``, a one-entry ``slice`` along
    the stack's axis (whole along the others), reads; else None."""
    if eqn.primitive is not jp.slice_p or eqn.params.get("strides") or isinstance(eqn.invars[0], jcore.Literal):
        return None
    if eqn.invars[0] not in stacked:
        return None
    axis, parts = stacked[eqn.invars[0]]
    start, limit, shape = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.invars[0].aval.shape
    whole = all(start[d] == 0 and limit[d] == shape[d] for d in range(len(shape)) if d != axis)
    return parts[start[axis]] if whole and limit[axis] - start[axis] == 1 else None


def _point(params: Dict[str, Any]) -> List[int]:
    """The positions, among a chain equation's arguments, of its point: its body's float32
    scalar arguments (the others, the parameters, are the network's as closure constants are:
    ``jvp(lambda z: u(p, z), ...)`` and ``jacfwd(u, 1)(p, z)`` are at the same point)."""
    return [j for j, v in enumerate(params["body"].invars) if v.aval.shape == () and v.aval.dtype == jnp.float32]


def _point_key(eqn, reads: Dict[Any, Any], j: int) -> Any:
    """The key of argument ``j`` of chain equation ``eqn``: its read (:func:`_reads`) and its
    axis at each level."""
    p = eqn.params
    v = _parts(p, eqn.invars)[1][j]
    read = reads.get(v, atom(v)) if not isinstance(v, jcore.Literal) else atom(v)
    return read, tuple(_parts(p, level)[1][j] for level in p["levels"])


def _at_point(eqn, reads: Optional[Dict[Any, Any]] = None, order: Optional[Sequence[Any]] = None):
    """``eqn`` (a chain equation) with its arguments off its point moved among its closure
    constants: its body's, its levels' and its links' positions laid out as ``(constants,
    point, directions)``; ``order``: its point's arguments in that order of their keys
    (:func:`_point_key`), those of another equation at the same point."""
    p = eqn.params
    consts, args, dirs = _parts(p, eqn.invars)
    point = _point(p)
    if order is not None:
        keys = [_point_key(eqn, reads, j) for j in point]
        point = [point[keys.index(k)] for k in order]
    other = [j for j in range(len(args)) if j not in point]
    if not other and point == sorted(point):
        return eqn
    body = p["body"]
    info = body.debug_info
    names = None if info.arg_names is None else tuple(info.arg_names[j] for j in point)
    body = body.replace(constvars=[*body.constvars, *[body.invars[j] for j in other]],
                        invars=[body.invars[j] for j in point], debug_info=info._replace(arg_names=names))

    def laid(ops):
        c, a, d = _parts(p, ops)
        return (*c, *[a[j] for j in other], *[a[j] for j in point], *d)

    def moved(step):
        if isinstance(step, chain.Along):
            return chain.Along(tuple(point.index(j) for j in step.args), step.dirs)
        return point.index(step)

    links = tuple(dataclasses.replace(link, argnums=tuple(moved(a) for a in link.argnums)) for link in p["links"])
    params = dict(p, body=body, n_consts=len(consts) + len(other), links=links,
                  levels=tuple(tuple(laid(level)) for level in p["levels"]))
    return eqn.replace(invars=list(laid(eqn.invars)), params=params)


def _root(v, reads: Dict[Any, Any]) -> Any:
    """The variable ``v`` reads (:func:`_reads`), through every read; ``v`` itself if none."""
    key = reads.get(v, v) if not isinstance(v, jcore.Literal) else v
    while isinstance(key, tuple) and len(key) == 3 and (key[0] == "relabel" or isinstance(key[0], jcore.Primitive)):
        key = key[2]
    return key


def _reread(v, read, reads: Dict[Any, Any]) -> Any:
    """``v``'s value, its reads (:func:`_reads`) applied again to the variable they read."""

    def value(key):
        if isinstance(key, tuple) and len(key) == 3 and key[0] == "relabel":
            return jnp.reshape(value(key[2]), key[1])
        if isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], jcore.Primitive):
            return key[0].bind(value(key[2]), **dict(key[1]))
        return read(key)

    return value(reads.get(v, v)) if not isinstance(v, jcore.Literal) else read(v)


def _group_key(eqn, reads: Dict[Any, Any], one_base: bool) -> Optional[Tuple[Any, ...]]:
    """Chains with equal keys differentiate the same values the same way: one plan computes
    them (``one_base``: of the same body and closure constants, so one equation holds them;
    else at the same point, :func:`_at_point`). None: this chain is planned alone (a level
    batching none of its point's arguments: the level's vmap could be another chain's)."""
    eqn = eqn if one_base else _at_point(eqn)
    p = eqn.params
    levels = [_parts(p, level)[1] for level in p["levels"]]
    if any(all(a is None for a in level) for level in levels):
        return None
    consts, point, dirs = _parts(p, eqn.invars)
    args = tuple(reads.get(v, atom(v)) if not isinstance(v, jcore.Literal) else atom(v) for v in point)
    key = (args, p["base_order"], p["base_term"], tuple(levels))
    pairs = [_point_key(eqn, reads, j) for j in range(len(point))]
    if not one_base and len(set(pairs)) == len(pairs):  # the point in any order of its arguments
        key = (frozenset(pairs), p["base_order"], p["base_term"])
    if one_base:  # the body by identity: the jaxpr object the equations share (held by them)
        key += (p["body"], tuple(atom(v) for v in consts), tuple(atom(v) for v in dirs), p["levels"])
    return key


def _groups(jaxpr: jcore.Jaxpr, one_base: bool = False, reads: Optional[Dict[Any, Any]] = None
            ) -> Dict[int, List[List[int]]]:
    """``{at: [members, ...]}``: the chain equations (by index) planned together, computed before
    equation ``at`` (``len(eqns)``: after the last): a chain joins a group of its key when the
    group can run where every member's operands exist and no member's value has been read yet
    (a jvp's direction built just before it joins the chains before it)."""
    eqns = jaxpr.eqns
    defined = {v: -1 for v in [*jaxpr.constvars, *jaxpr.invars]}
    used: Dict[Any, int] = {}  # a variable -> the first equation reading it
    for i, eqn in enumerate(eqns):
        defined.update((v, i) for v in eqn.outvars)
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                used.setdefault(v, i)
    reads = _reads(jaxpr) if reads is None else reads
    open_groups: Dict[Any, List[Any]] = {}  # key -> [earliest place, latest place, members]
    groups: List[List[Any]] = []
    for i, eqn in enumerate(eqns):
        if eqn.primitive is not chain_p:
            continue
        consts, _, dirs = _parts(eqn.params, (eqn if one_base else _at_point(eqn)).invars)
        # its own operands (a group computes its members at its first member's point); a constant
        # or direction read from a variable (a vector rebuilt from its entries, the entries of a
        # tangent) is read again where the group runs
        if not one_base:
            consts, dirs = [_root(v, reads) for v in consts], [_root(v, reads) for v in dirs]
        ready = 1 + max([defined[v] for v in [*consts, *dirs] if not isinstance(v, jcore.Literal)], default=-1)
        latest = min([used.get(v, len(eqns)) for v in eqn.outvars], default=len(eqns))
        key = _group_key(eqn, reads, one_base)
        group = open_groups.get(key) if key is not None else None
        if group is not None and max(group[0], ready) <= min(group[1], latest):
            group[0], group[1] = max(group[0], ready), min(group[1], latest)
            group[2].append(i)
            continue
        groups.append([i, latest, [i]])  # (the first member's point: defined before it)
        if key is not None:
            open_groups[key] = groups[-1]
    scheduled: Dict[int, List[List[int]]] = {}
    for ready, _, members in groups:
        scheduled.setdefault(ready, []).append(members)
    return scheduled


class _Expanding:
    """The context the ``evaluate`` rules of :data:`jaxamp._src.core.rules.RULES` get from
    :func:`expand` (and :func:`expand_off`: ``off``): bodies evaluated with their chains
    computed, no flags."""

    def __init__(self, off: bool = False) -> None:
        self.holds: Dict[Any, bool] = {}  # which of this expansion's jaxprs hold chains
        self.off = off  # AMP off: each chain as JAX's own derivative, not planned

    def evaluate(self, jaxpr, consts, args, infos):
        return _evaluate(jaxpr, consts, args, self, infos)

    def keys(self, jaxpr, infos) -> List[str]:
        return []

    def in_body(self) -> "_Expanding":
        return self


def _evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx, infos):
    reads = _reads(jaxpr)
    planned = jaxpr if ctx.off else _entries_held(jaxpr, reads)
    scheduled = {} if ctx.off else _groups(planned, reads=reads)
    flags = frozenset() if ctx.off else flags_only(jaxpr)  # links read as flags only: any value of their order
    env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def run(at: int) -> None:  # the groups planned before equation `at`: their values written
        for members in scheduled.get(at, ()):
            values = _run_group([planned.eqns[j] for j in members], read, reads, flags)
            for j, outs in _split(members, jaxpr.eqns, values).items():
                _write(env, jaxpr.eqns[j].outvars, outs)

    for i, eqn in enumerate(jaxpr.eqns):
        run(i)
        if eqn.primitive is chain_p and ctx.off:  # method="forward" asked for the engine: it stays
            off = _impl if eqn.params["engine"] else _jax_derivatives
            outs = off(*[read(v) for v in eqn.invars], **eqn.params)
        elif eqn.primitive is chain_p:
            continue  # computed with its group
        elif any(has_chains(j, ctx.holds) for j in sub_jaxprs(eqn)):
            handler = rules_of(eqn.primitive).evaluate
            if handler is None:
                raise NotImplementedError(
                    f"jaxamp: a nest of jaxamp.grad inside a `{eqn.primitive.name}` is not supported; supported are "
                    f"{evaluated()}. Move it out, or use jaxamp.grad(..., method='reverse').")
            outs = handler(eqn, [read(v) for v in eqn.invars], ctx, [None] * 8)[0]
        else:
            outs = bind(eqn, [read(v) for v in eqn.invars])
        _write(env, eqn.outvars, outs)
    run(len(jaxpr.eqns))
    return [read(v) for v in jaxpr.outvars], {}


def _entries_held(jaxpr: jcore.Jaxpr, reads: Dict[Any, Any]) -> jcore.Jaxpr:
    """``jaxpr`` with each chain equation that closes over a vector whose entries another chain
    equation takes as its point's arguments (``jvp(lambda t: u(p, t, xyz), ...)`` beside
    ``grad(u, 1)(p, t, xyz)``, whose body takes ``xyz`` entry by entry) taking those entries as
    arguments too, so that both are at one point and one plan serves them (a pass along ``t``
    shared); ``reads`` gets the new arguments' keys (the entries' reads). Only for a planning:
    the rewritten equations are computed from the same operands, their outputs the same."""
    # the key of a vector (its read, or itself) -> {entry: (its read, its shape, its level axes)}
    entries: Dict[Any, Dict[int, Tuple[Any, Tuple[int, ...], Tuple[Any, ...]]]] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive is chain_p:
            p = eqn.params
            for j, v in enumerate(_parts(p, eqn.invars)[1]):
                hit = _entry_read(reads.get(v) if isinstance(v, jcore.Var) else None)
                if hit is not None:
                    axes = tuple(_parts(p, lv)[1][j] for lv in p["levels"])
                    entries.setdefault(hit[0], {})[hit[1]] = (reads[v], tuple(v.aval.shape), axes)
    if not entries:
        return jaxpr
    keys = {_group_key(e, reads, False) for e in jaxpr.eqns if e.primitive is chain_p}
    eqns = list(jaxpr.eqns)
    for i, eqn in enumerate(eqns):
        held = _held(eqn, entries, reads) if eqn.primitive is chain_p else None
        if held is not None and _group_key(held, reads, False) in keys:
            eqns[i] = held
    return jaxpr.replace(eqns=eqns)


def _entry_read(key: Any) -> Optional[Tuple[Any, int]]:
    """``(the vector's key, entry)`` when ``key`` (of :func:`_reads`) reads one entry of a vector's
    last axis (a one-entry ``slice`` of it from the start of every other axis, relabelled; the
    vector a variable or a read of one), else None."""
    if not (isinstance(key, tuple) and len(key) == 3 and key[0] == "relabel"):
        return None
    inner = key[2]
    if not (isinstance(inner, tuple) and len(inner) == 3 and inner[0] is jp.slice_p):
        return None
    params = dict(inner[1])
    start, limit = params["start_indices"], params["limit_indices"]
    if params.get("strides") or not start or limit[-1] - start[-1] != 1 or any(start[:-1]):
        return None
    return inner[2], start[-1]


def _held(eqn, entries: Dict[Any, Dict[int, Tuple[Any, Tuple[int, ...], Tuple[Any, ...]]]], reads: Dict[Any, Any]):
    """``eqn`` (a chain equation) with its closure constants of ``entries`` (float32 vectors,
    batched at every level along other axes than the last, every entry read: the per-point
    vectors another equation takes entry by entry) taken as arguments entry by entry, new
    variables keyed (in ``reads``) as those entries' reads; None when it holds none."""
    p = eqn.params
    consts, args, dirs = _parts(p, eqn.invars)
    body = p["body"]
    n = len(p["levels"])

    def whole(v, k) -> bool:  # every entry of v's last axis read, whole along the others, batched elsewhere
        found = entries.get(reads.get(v, v))
        shape, m = tuple(v.aval.shape), body.constvars[k].aval.shape
        # level i (the innermost first) maps an axis of an array of i + 2 axes: not its last
        return (found is not None and body.constvars[k].aval.dtype == jnp.float32 and len(m) == 1
                and len(shape) == n + 1 and shape[-1] == m[0] and set(found) == set(range(m[0]))
                and all(entry_shape == shape[:-1] for _, entry_shape, _ in found.values())
                and all(lv[k] is not None and lv[k] != i + 1 for i, lv in enumerate(p["levels"])))

    held = [k for k, v in enumerate(consts) if isinstance(v, jcore.Var) and whole(v, k)] if n else []
    if not held:
        return None
    new_args, new_levels = [], [[] for _ in p["levels"]]
    for k in held:
        for e in range(body.constvars[k].aval.shape[0]):
            read, _, axes = entries[reads.get(consts[k], consts[k])][e]
            outer = jcore.Var(jax.core.ShapedArray(tuple(consts[k].aval.shape[:-1]), jnp.float32))
            reads[outer] = read
            new_args.append(outer)
            for level, axis in zip(new_levels, axes):
                level.append(axis)
    keep = [k for k in range(len(consts)) if k not in held]
    new_body = _entries_as_arguments(body, held)

    def laid(ops, extra):
        c, a, d = _parts(p, ops)
        return (*[c[k] for k in keep], *a, *extra, *d)

    levels = tuple(tuple(laid(level, new)) for level, new in zip(p["levels"], new_levels))
    params = dict(p, body=new_body, n_consts=len(keep), levels=levels)
    return eqn.replace(invars=list(laid(eqn.invars, new_args)), params=params)


def _write(env: Dict[Any, Any], outvars, outs) -> None:
    for v, out in zip(outvars, outs):
        if not isinstance(v, jcore.DropVar):
            env[v] = out


def _split(indices: Sequence[int], eqns, values: Sequence[Any]) -> Dict[int, List[Any]]:
    """``values`` (the group's, in order) per chain equation of ``indices``."""
    out, k = {}, 0
    for i in indices:
        m = len(eqns[i].params["links"])
        out[i], k = list(values[k:k + m]), k + m
    return out


def _merged(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` with the chain equations of one body and constants at one point (its own
    jaxpr's, not its bodies') bound as one equation: requests planned together, still chains
    (a later transformation extends them)."""
    jaxpr = closed.jaxpr
    scheduled = _groups(jaxpr, one_base=True)
    if all(len(g) == 1 for gs in scheduled.values() for g in gs) and not any(
            e.params.get("names") for e in jaxpr.eqns if e.primitive is chain_p):
        return closed

    def run(*args):
        env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*closed.consts, *args]))

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        def merged(at: int) -> None:  # the groups bound before equation `at`, one equation each
            for group in scheduled.get(at, ()):
                members = [jaxpr.eqns[j] for j in group]
                links = [link for e in members for link in e.params["links"]]
                unique = tuple(dict.fromkeys(links))  # (equal: the same base and steps)
                values = chain_p.bind(*[read(v) for v in members[0].invars],
                                      **{**members[0].params, "links": unique, "names": ()})
                for j, outs in _split(group, jaxpr.eqns, [values[unique.index(link)] for link in links]).items():
                    _write(env, jaxpr.eqns[j].outvars, outs)

        for i, eqn in enumerate(jaxpr.eqns):
            merged(i)
            if eqn.primitive is not chain_p:
                _write(env, eqn.outvars, bind(eqn, [read(v) for v in eqn.invars]))
        merged(len(jaxpr.eqns))
        return [read(v) for v in jaxpr.outvars]

    return jax.make_jaxpr(run)(*_avals(closed))


def _run_group(eqns, read, reads: Dict[Any, Any], flags: frozenset = frozenset()) -> List[jax.Array]:
    """One plan for the chain equations ``eqns``; a base is shared by members with the same
    function, or the same traced body (two calls' traces of one network), and the same closure
    constants; a direction by members reading the same variable, batched alike. A link whose
    value is among ``flags`` (read as flags only) is soft (:func:`chain.evaluate`)."""
    members, base_of, consts, seen = [], [], [], []  # seen: (base, body, its constants' key) of each base
    dirs: Dict[Any, Tuple[int, Any]] = {}  # (direction operand, its axes by level) -> (its position, operand)
    first = _at_point(eqns[0])
    order = [_point_key(first, reads, j) for j in range(len(_parts(first.params, first.invars)[1]))]
    eqns = [first] + [_at_point(eqn, reads, order) for eqn in eqns[1:]]
    texts: Dict[Any, str] = {}  # a body's printed program, the same for two traces of one function

    def same(body_a, body_b) -> bool:
        if body_a is body_b:
            return True
        for body in (body_a, body_b):
            if body not in texts:
                texts[body] = str(body)
        return texts[body_a] == texts[body_b]

    for eqn in eqns:
        p, n = eqn.params, eqn.params["n_consts"]
        key = (tuple(reads.get(v, atom(v)) if not isinstance(v, jcore.Literal) else atom(v) for v in eqn.invars[:n]),
               tuple(lv[:n] for lv in p["levels"]))  # its constants by what they read
        base = p["links"][0].base
        b = next((i for i, (f, body, k) in enumerate(seen)
                  if k == key and (f is base or same(body, p["body"]))), None)  # the function itself, by `is`
        if b is None:
            b = len(seen)
            seen.append((base, p["body"], key))
            consts.append([_reread(v, read, reads) for v in eqn.invars[:n]])
        own = [dirs.setdefault((reads.get(v, atom(v)) if not isinstance(v, jcore.Literal) else atom(v),
                                tuple(_parts(p, lv)[2][d] for lv in p["levels"])), (len(dirs), v))[0]
               for d, v in enumerate(_parts(p, eqn.invars)[2])]
        members += [{**m, "link": _moved(m["link"], own), "soft": v in flags} for m, v in zip(_members(p), eqn.outvars)]
        base_of += [b] * len(p["links"])
    first = eqns[0]
    values = [_reread(v, read, reads) for _, v in dirs.values()]
    levels = [[axes[k] for _, axes in dirs] for k in range(len(first.params["levels"]))]
    point = [_reread(v, read, reads) for v in _parts(first.params, first.invars)[1]]  # (entries: :func:`_held`)
    return _run(members, base_of, consts, point, values, levels,
                scaled=True)


def _moved(link: chain.Chain, own: Sequence[int]) -> chain.Chain:
    """``link`` with its directions' positions among its equation's (``own[d]``: among the group's)."""
    steps = tuple(chain.Along(a.args, tuple(own[d] for d in a.dirs)) if isinstance(a, chain.Along) else a
                  for a in link.argnums)
    return dataclasses.replace(link, argnums=steps) if steps != link.argnums else link


RULES[chain_p] = PrimitiveRules(expand=expand, off=expand_off)  # the program passes of jaxamp's entry points
