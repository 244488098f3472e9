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

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax import lax
from jax.extend.core import primitives as jp
from jax.interpreters import ad, batching, mlir, partial_eval as pe

from jaxamp._src.derivatives import chain
from jaxamp._src.core.interpreter import (atom, bind, eval_jaxpr, holds, split_arrays, sub_jaxprs, substitute,
                                            trace)
from jaxamp._src.core.marks import deriv_check, deriv_scale, fresh, seed, unscale
from jaxamp._src.core.nesting import NO_DERIVATIVE, analyze, single_name
from jaxamp._src.core.rules import RULES, PrimitiveRules, evaluated, rules_of

__all__ = ["chain_p", "bind_chain", "expand", "has_chains"]

chain_p = jcore.Primitive("jaxamp_chain")


def bind_chain(link: chain.Chain, args: Tuple[Any, ...]) -> jax.Array:
    """The top derivative of ``link`` at the positional ``args`` (:func:`chain.eligible`), as
    one ``chain_p`` equation over the traced body of ``link.base``."""
    cols = set(link.argnums)
    args = tuple(jnp.float32(a) if i in cols and not hasattr(a, "dtype") else a for i, a in enumerate(args))
    closed, flat, _ = trace(lambda *a: chain.check_output("jaxamp.grad", link.base, link.base(*a)), args, {})
    # each differentiated argument is one array leaf: its position among the body's arguments
    starts, n = [], 0
    for a in args:
        starts.append(n)
        n += len(split_arrays((a,), {})[0])
    flat_link = chain.Chain(link.base, tuple(starts[i] for i in link.argnums), link.wrts, link.of)
    if has_chains(closed.jaxpr):  # derivatives of derivatives: each inner chain one step longer
        return _along(closed, flat_link, flat)
    base = analyze(closed.jaxpr, [NO_DERIVATIVE] * len(flat)).outs[0]
    params = dict(link=flat_link, body=closed.jaxpr, n_consts=len(closed.consts), base_order=base.order,
                  base_term=single_name(base), levels=(), shape=())
    return chain_p.bind(*closed.consts, *flat, **params)


def _run(members: Sequence[Dict[str, Any]], base_of: Sequence[int], consts: Sequence[Sequence[Any]],
         args: Sequence[Any]) -> List[jax.Array]:
    """The top derivatives of ``members`` (chain equations' params) at ``args``: one plan, the
    ``b``-th base evaluated on ``consts[b]``; batched as the members' ``levels`` record."""
    first = members[0]
    bodies = [next(m["body"] for m, b in zip(members, base_of) if b == i) for i in range(len(consts))]
    links = [m["link"] for m in members]

    def fn(args, consts):
        bases = [_body_fn(body, c) for body, c in zip(bodies, consts)]
        return chain.evaluate(links, base_of, bases, tuple(args), first["base_order"], first["base_term"])

    for k in range(len(first["levels"])):  # innermost first: each vmap maps one recorded axis
        n = first["n_consts"]
        arg_axes = list(first["levels"][k][n:])
        const_axes = [list(next(m for m, b in zip(members, base_of) if b == i)["levels"][k][:len(c)])
                      for i, c in enumerate(consts)]
        fn = jax.vmap(fn, in_axes=(arg_axes, const_axes))
    return fn(list(args), [list(c) for c in consts])


def _body_fn(body: jcore.Jaxpr, consts: Sequence[Any]):
    return lambda *a: eval_jaxpr(body, consts, a, bind)[0]


def _impl(*operands, **params):
    n = params["n_consts"]
    return _run([params], [0], [operands[:n]], operands[n:])[0]


def _batch(vals, dims, **params):
    size = next(v.shape[d] for v, d in zip(vals, dims) if d is not None)
    vals = [v if d is None else jnp.moveaxis(v, d, 0) for v, d in zip(vals, dims)]
    level = tuple(None if d is None else 0 for d in dims)
    out = chain_p.bind(*vals, **{**params, "levels": params["levels"] + (level,), "shape": (size,) + params["shape"]})
    return out, 0


def _along(closed: jcore.ClosedJaxpr, link: chain.Chain, flat: Sequence[Any]) -> jax.Array:
    """The derivative of ``closed`` (a body holding chains) along its scalar arguments
    ``link.argnums``, innermost first, by forward steps: each chain inside becomes longer chains
    (:func:`_jvp`), planned with the point's others; the rest of the body is differentiated as
    JAX does. Each step is scaled and checked as a ``jaxamp.grad`` step is."""

    closed = _pruned(closed)  # inner chains at the body's own scalars, where a stack of them was read

    def g(*a):
        return eval_jaxpr(closed.jaxpr, closed.consts, a, bind)[0]

    for k, (i, wrt) in enumerate(zip(link.argnums, link.wrts)):
        g = _step(g, i, dict(order=1, term=link.of if k == 0 else None, wrt=wrt))
    return g(*flat)


def _step(g, i: int, marks: Dict[str, Any]):
    """``g``'s derivative along its scalar argument ``i``: the tangent seeded with the scale of
    the step's key, the result checked and unscaled."""

    def derivative(*a):
        value = g(*a)
        s = deriv_scale(value, **marks)
        _, d = jax.jvp(lambda ai: g(*a[:i], fresh(ai), *a[i + 1:]), (a[i],), (seed(jnp.ones_like(a[i]), s),))
        return unscale(deriv_check(d, value, **marks), jnp.float32(1.0) / s)

    return derivative


def _steppable(params: Dict[str, Any], i: int, primal: Any) -> bool:
    """Whether operand ``i`` is a point's float32 scalar the chain can take one more step along:
    an argument (not a closure constant), batched at axis 0 by every level of the equation's
    vmaps (so that its tangent is laid out as the chain's value)."""
    return (i >= params["n_consts"] and jnp.result_type(primal) == jnp.float32
            and all(level[i] == 0 for level in params["levels"]) and jnp.shape(primal) == params["shape"])


def _jvp(primals, tangents, **params):
    """The tangent of a chain: along its point's scalars, the chains one step longer (a request
    on the program, planned with the others at the point, whatever transformation asked); along
    anything else (the parameters), the derivative of the chain's plan."""
    out = chain_p.bind(*primals, **params)
    link, n = params["link"], params["n_consts"]
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    steps = [i for i in live if _steppable(params, i, primals[i])]
    rest = [i for i in live if i not in steps]
    parts = []
    for i in steps:
        longer = chain.Chain(link.base, link.argnums + (i - n,), link.wrts + (None,), link.of)
        parts.append(chain_p.bind(*primals, **{**params, "link": longer}) * tangents[i])
    if rest:
        parts.append(jax.jvp(lambda *r: _impl(*substitute(primals, rest, r), **params), [primals[i] for i in rest],
                             [ad.instantiate_zeros(tangents[i]) for i in rest])[1])
    if not parts:
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    return out, functools.reduce(lambda a, b: a + b, parts)


chain_p.def_impl(_impl)
chain_p.def_abstract_eval(lambda *_, shape, **__: jax.core.ShapedArray(shape, jnp.float32))
ad.primitive_jvps[chain_p] = _jvp
batching.primitive_batchers[chain_p] = _batch
mlir.register_lowering(chain_p, mlir.lower_fun(_impl, multiple_results=False))


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
    closed = _pruned(closed)
    return jax.make_jaxpr(lambda *a: _evaluate(closed.jaxpr, closed.consts, a, ctx, None)[0])(*_avals(closed))


def _avals(closed: jcore.ClosedJaxpr) -> List[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in closed.jaxpr.invars]


def _pruned(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` with every one-entry ``slice`` of a ``stack`` read from the stacked value
    itself, then its dead equations removed: the chains of a Jacobian's or Hessian's entries
    that the program never reads (``jaxamp.hessian(u, 1)(p, z)[1, 1]``) are not planned."""
    jaxpr = closed.jaxpr
    if not any(e.primitive.name == "stack" for e in jaxpr.eqns):
        return closed

    # a stack's output variable -> (its axis, [(operand variable or None, operand value)])
    stacks: Dict[Any, Tuple[int, List[Tuple[Any, Any]]]] = {}

    def sliced(var, x, start, limit):  # x[start:limit], read through the stacks x (of var) was built by
        hit = stacks.get(var)
        if hit is not None and limit[hit[0]] - start[hit[0]] == 1:
            k, parts = hit
            rest = lambda t: t[:k] + t[k + 1:]  # noqa: E731
            return lax.expand_dims(sliced(*parts[start[k]], rest(start), rest(limit)), (k,))
        full = tuple(start) == (0,) * jnp.ndim(x) and tuple(limit) == jnp.shape(x)
        return x if full else lax.slice(x, tuple(start), tuple(limit))

    def rule(eqn, vals):
        p, var = eqn.params, eqn.invars[0] if eqn.invars else None
        stacked = not isinstance(var, jcore.Literal) and var in stacks
        if eqn.primitive is jp.slice_p and not p.get("strides") and stacked:
            return [sliced(var, vals[0], p["start_indices"], p["limit_indices"])]
        outs = bind(eqn, vals)
        if eqn.primitive.name == "stack":  # (JAX 0.10 exports no stack_p)
            operands = [None if isinstance(v, jcore.Literal) else v for v in eqn.invars]
            stacks[eqn.outvars[0]] = (p["axis"], list(zip(operands, vals)))
        return outs

    def run(*args):
        return eval_jaxpr(jaxpr, closed.consts, args, rule)

    traced = jax.make_jaxpr(run)(*_avals(closed))
    live, _ = pe.dce_jaxpr(traced.jaxpr, [True] * len(traced.jaxpr.outvars), instantiate=True)
    return jcore.ClosedJaxpr(live, traced.consts)


# Equations that only read or relabel their operand's entries (z[k] is a slice and a squeeze):
# two of them with the same parameters on the same operand give the same values.
_READS = (jp.slice_p, jp.squeeze_p, jp.reshape_p, jp.transpose_p, jp.broadcast_in_dim_p)


def _reads(jaxpr: jcore.Jaxpr) -> Dict[Any, Any]:
    """``{var: key}`` for each variable a chain of :data:`_READS` computes from another, the key
    equal for equal reads of the same variable: the entries of a vector ``z`` that two
    derivative calls at ``z`` each take (``jacfwd`` then ``hessian``) are the same operands."""
    keys: Dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive in _READS and len(eqn.invars) == 1 and not isinstance(eqn.invars[0], jcore.Literal):
            try:
                keys[eqn.outvars[0]] = (eqn.primitive, tuple(sorted(eqn.params.items())),
                                        keys.get(eqn.invars[0], eqn.invars[0]))
                hash(keys[eqn.outvars[0]])
            except TypeError:  # an unhashable parameter: the variable is its own key
                keys.pop(eqn.outvars[0], None)
    return keys


def _group_key(eqn, reads: Dict[Any, Any]) -> Optional[Tuple[Any, ...]]:
    """Chains with equal keys differentiate the same values the same way: one plan computes
    them. None: this chain is planned alone (a level batching none of its arguments: the
    level's vmap could be another chain's)."""
    p = eqn.params
    n, levels = p["n_consts"], p["levels"]
    if any(all(a is None for a in level[n:]) for level in levels):
        return None
    args = tuple(reads.get(v, atom(v)) if not isinstance(v, jcore.Literal) else atom(v) for v in eqn.invars[n:])
    return (args, p["base_order"], p["base_term"], tuple(level[n:] for level in levels))


def _groups(jaxpr: jcore.Jaxpr) -> Dict[int, List[int]]:
    """``{first: [members]}``: the chain equations (by index) planned with the chain at
    ``first`` (at ``first``'s arguments); a member joins only if its closure constants exist there."""
    defined = {v: -1 for v in [*jaxpr.constvars, *jaxpr.invars]}
    for i, eqn in enumerate(jaxpr.eqns):
        defined.update((v, i) for v in eqn.outvars)
    reads = _reads(jaxpr)
    open_groups: Dict[Any, List[int]] = {}
    groups: Dict[int, List[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is not chain_p:
            continue
        key = _group_key(eqn, reads)
        first = open_groups.get(key, [None])[0] if key is not None else None
        consts = eqn.invars[:eqn.params["n_consts"]]
        if first is not None and all(isinstance(v, jcore.Literal) or defined[v] < first for v in consts):
            groups[first].append(i)
            continue
        groups[i] = [i]
        if key is not None:
            open_groups[key] = [i]
    return groups


class _Expanding:
    """The context the ``evaluate`` rules of :data:`jaxamp._src.core.rules.RULES` get from
    :func:`expand`: bodies evaluated with their chains computed, no flags."""

    def __init__(self) -> None:
        self.holds: Dict[Any, bool] = {}  # which of this expansion's jaxprs hold chains

    def evaluate(self, jaxpr, consts, args, infos):
        return _evaluate(jaxpr, consts, args, self, infos)

    def keys(self, jaxpr, infos) -> List[str]:
        return []

    def in_body(self) -> "_Expanding":
        return self


def _evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx, infos):
    groups = _groups(jaxpr)
    env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]))
    done: Dict[int, jax.Array] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is chain_p:
            if i in groups:
                done.update(zip(groups[i], _run_group([jaxpr.eqns[j] for j in groups[i]], read)))
            outs = [done.pop(i)]
        elif any(has_chains(j, ctx.holds) for j in sub_jaxprs(eqn)):
            handler = rules_of(eqn.primitive).evaluate
            if handler is None:
                raise NotImplementedError(
                    f"jaxamp: a nest of jaxamp.grad inside a `{eqn.primitive.name}` is not supported; supported are "
                    f"{evaluated()}. Move it out, or use jaxamp.grad(..., method='reverse').")
            outs = handler(eqn, [read(v) for v in eqn.invars], ctx, [None] * 8)[0]
        else:
            outs = bind(eqn, [read(v) for v in eqn.invars])
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = out
    return [read(v) for v in jaxpr.outvars], {}


def _run_group(eqns, read) -> List[jax.Array]:
    """One plan for the chain equations ``eqns``; a base is shared by members with the same
    function and the same closure constants."""
    members, base_of, consts, seen = [], [], [], []  # seen: (base, its constants' key) of each base
    for eqn in eqns:
        p, n = eqn.params, eqn.params["n_consts"]
        base, key = p["link"].base, (tuple(atom(v) for v in eqn.invars[:n]), tuple(lv[:n] for lv in p["levels"]))
        b = next((i for i, (f, k) in enumerate(seen) if f is base and k == key), None)  # the function itself, by `is`
        if b is None:
            b = len(seen)
            seen.append((base, key))
            consts.append([read(v) for v in eqn.invars[:n]])
        members.append(p)
        base_of.append(b)
    n = eqns[0].params["n_consts"]
    return _run(members, base_of, consts, [read(v) for v in eqns[0].invars[n:]])


RULES[chain_p] = PrimitiveRules(expand=expand)  # the program pass of jaxamp's entry points
