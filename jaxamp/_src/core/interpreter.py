"""One jaxpr interpreter for every program rewrite in jaxamp.

Taylor propagation, precision placement and the scale/flag plumbing are each :func:`eval_jaxpr`
with its own *rule* ``rule(eqn, invals) -> outvals``; :func:`bind` evaluates an equation as
written, :func:`sub_jaxpr` exposes call bodies, :func:`cse` removes repeated work,
:func:`trace` makes the jaxpr of a function over its array arguments.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

from jaxamp._src.core.rules import rules_of

__all__ = ["Rule", "eval_jaxpr", "bind", "substitute", "split_arrays", "trace", "sub_jaxpr", "custom_body",
           "sub_jaxprs", "holds", "atom", "cse"]

Rule = Callable[[Any, List[Any]], Sequence[Any]]


def eval_jaxpr(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], rule: Rule, *,
               literal: Callable[[Any], Any] = lambda x: x) -> List[Any]:
    """Evaluate ``jaxpr`` on ``args`` equation by equation through ``rule``.

    Args:
      jaxpr, consts, args: an open jaxpr and the values of its constvars and invars.
      rule: ``rule(eqn, invals) -> outvals``; literal: maps a literal's constant to a value.

    Returns:
      The values of ``jaxpr.outvars``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxamp._src.core.interpreter import bind, eval_jaxpr
      >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)
      >>> [y] = eval_jaxpr(closed.jaxpr, closed.consts, [jnp.float32(1.0)], bind)  # as written: sin(1) * 2
      >>> round(float(y), 4)
      1.6829
    """
    if len(consts) != len(jaxpr.constvars) or len(args) != len(jaxpr.invars):
        raise ValueError(f"eval_jaxpr: got {len(consts)} consts and {len(args)} args for a jaxpr "
                         f"with {len(jaxpr.constvars)} constvars and {len(jaxpr.invars)} invars.")
    env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]))

    def read(v):
        return literal(v.val) if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        outs = rule(eqn, [read(v) for v in eqn.invars])
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = out
    return [read(v) for v in jaxpr.outvars]


def bind(eqn, vals: Sequence[Any]) -> List[Any]:
    """Evaluate one equation on ``vals`` as the program wrote it; always a list of outputs."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def substitute(values: Sequence[Any], slots: Sequence[int], new: Sequence[Any]) -> List[Any]:
    """``values`` as a list with ``new[j]`` at position ``slots[j]``."""
    full = list(values)
    for slot, value in zip(slots, new):
        full[slot] = value
    return full


def split_arrays(args, kwargs):
    """``(arrays, rebuild)``: the array leaves of ``(args, kwargs)``, and ``rebuild(arrays) ->
    (args, kwargs)`` with the other leaves (functions such as a Flax ``apply_fn``, modules,
    strings, Python numbers) as passed: only arrays are traced, as ``jax.grad`` traces only
    the arguments it differentiates."""
    leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray, np.generic))]

    def rebuild(arrays):
        return jax.tree_util.tree_unflatten(in_tree, substitute(leaves, slots, arrays))

    return [leaves[i] for i in slots], rebuild


def trace(fun: Callable, args, kwargs):
    """``(jaxpr, array leaves, output tree)`` of ``fun(*args, **kwargs)`` (:func:`split_arrays`)."""
    flat, rebuild = split_arrays(args, kwargs)

    def flat_fun(*arrays):
        a, kw = rebuild(arrays)
        return fun(*a, **kw)

    closed, shape = jax.make_jaxpr(flat_fun, return_shape=True)(*flat)
    return closed, flat, jax.tree_util.tree_structure(shape)


def _closed(body) -> Optional[jcore.ClosedJaxpr]:
    if isinstance(body, jcore.Jaxpr):
        return jcore.ClosedJaxpr(body, ())
    return body if isinstance(body, jcore.ClosedJaxpr) else None


def sub_jaxpr(eqn) -> Optional[jcore.ClosedJaxpr]:
    """The body of a call-like equation (``jit``, the network boundary: the ``call`` of
    :data:`jaxamp._src.core.rules.RULES`), else None."""
    param = rules_of(eqn.primitive).call
    return _closed(eqn.params.get(param)) if param is not None else None


def custom_body(eqn) -> Optional[jcore.ClosedJaxpr]:
    """The primal body of a ``custom_jvp``/``custom_vjp`` call (its rule is not kept), else None."""
    param = rules_of(eqn.primitive).custom
    return _closed(eqn.params[param]) if param is not None else None


def sub_jaxprs(eqn) -> List[jcore.Jaxpr]:
    """Every jaxpr in ``eqn``'s parameters (bodies of calls, loops, branches), open."""
    return [j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j for j in jcore.jaxprs_in_params(eqn.params)]


def holds(jaxpr: jcore.Jaxpr, primitives: frozenset, cache: Optional[Dict[Any, bool]] = None) -> bool:
    """Whether ``jaxpr`` or one of its bodies applies one of ``primitives``. ``cache``: a dict
    the caller keeps for one interpretation (``{(jaxpr, primitives): bool}``, the jaxprs held
    alive as its keys), so a body is searched once however often it is asked about."""
    key = (jaxpr, primitives)
    if cache is not None and key in cache:
        return cache[key]
    found = any(eqn.primitive in primitives or any(holds(j, primitives, cache) for j in sub_jaxprs(eqn))
                for eqn in jaxpr.eqns)
    if cache is not None:
        cache[key] = found
    return found


def atom(v) -> Any:
    """A hashable stand-in for an equation operand: the variable itself, or a literal's value."""
    if isinstance(v, jcore.Literal):
        val = np.asarray(v.val)  # by its bits: 0.0 and -0.0 differ, as do NaN payloads
        return ("literal", str(v.aval), val.dtype.str, val.shape, val.tobytes())
    return v


def _param_key(value: Any, texts: Dict[Any, Any]) -> Any:
    """A hashable key of an equation parameter under which equal programs are equal: a body
    (two traces of one network: ``jaxamp.autocast``'s boundary, a ``jax.jit`` call) by its
    printed program and constants, anything else itself."""
    if isinstance(value, (tuple, list)):
        return tuple(_param_key(v, texts) for v in value)
    if isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        if value not in texts:
            consts = value.consts if isinstance(value, jcore.ClosedJaxpr) else ()
            keys = [_const_key(c) for c in consts]
            # a body holding a large array constant is keyed by itself (not worth its bytes); the
            # parameters a program prints by name only (a custom_jvp's rule) are keyed as themselves
            held = _unprinted(value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value)
            texts[value] = value if None in keys or held is None else ("program", str(value), tuple(keys), held)
        return texts[value]
    return value


_PRINTED = (int, float, bool, str, type(None), np.dtype, np.generic)


def _unprinted(jaxpr: jcore.Jaxpr) -> Optional[Tuple[Any, ...]]:
    """The parameters of ``jaxpr``'s equations (its bodies' too) that its printed program shows
    by name only (functions, rules: two with one name may differ), as themselves; None where one
    is unhashable."""
    out: List[Any] = []

    def visit(v: Any) -> None:
        if isinstance(v, (tuple, list)):
            for x in v:
                visit(x)
        elif isinstance(v, jcore.ClosedJaxpr):
            out.extend(walk(v.jaxpr))
        elif isinstance(v, jcore.Jaxpr):
            out.extend(walk(v))
        elif not isinstance(v, _PRINTED) and not hasattr(v, "dtype"):
            out.append(v)

    def walk(j: jcore.Jaxpr) -> List[Any]:
        for eqn in j.eqns:
            for v in eqn.params.values():
                visit(v)
        return []

    walk(jaxpr)
    try:
        hash(tuple(out))
    except TypeError:
        return None
    return tuple(out)


def _const_key(c: Any) -> Any:
    """A body's constant: an array by its bytes (None past 2**16 entries), anything else itself."""
    if hasattr(c, "dtype") and hasattr(c, "shape") and not isinstance(c, jcore.Tracer):
        if int(np.prod(c.shape)) > 1 << 16:
            return None
        a = np.asarray(c)
        return ("array", a.dtype.str, a.shape, a.tobytes())
    return c


# Equations that only read entries of their operands: their values are which entries they read,
# in which layout (an index map), whatever the equations that read them.
_READS = (jp.slice_p, jp.squeeze_p, jp.reshape_p, jp.transpose_p, jp.broadcast_in_dim_p, jax.lax.stack_p,
          jp.concatenate_p)
_MAX_READ = 1 << 20  # entries of a read's index map (larger reads are keyed as written)


def _read_map(eqn: jcore.JaxprEqn, maps: Dict[Any, Any]) -> Optional[Tuple[Tuple[Any, ...], np.ndarray]]:
    """``(roots, index)`` when ``eqn`` only reads entries of arrays (``_READS``, of one dtype):
    its output is ``concatenate([ravel(r) for r in roots])[index]``. ``x[0]`` read as a slice and
    a squeeze, or as a slice of a transpose, or a stack of a vector's entries (the vector
    itself), have one index map; ``maps`` holds the reads before ``eqn``."""
    if eqn.primitive not in _READS or len(eqn.outvars) != 1 or eqn.effects:
        return None
    if any(isinstance(v, jcore.Literal) or getattr(v.aval, "dtype", None) != eqn.outvars[0].aval.dtype
           for v in eqn.invars):
        return None
    sources = [maps.get(v) or ((v,), None) for v in eqn.invars]
    roots: List[Any] = list(dict.fromkeys(r for own, _ in sources for r in own))
    sizes = [int(np.prod(r.aval.shape)) for r in roots]
    if sum(sizes) > _MAX_READ:
        return None
    starts = dict(zip(roots, np.cumsum([0] + sizes)))
    parts = []
    for v, (own, index) in zip(eqn.invars, sources):
        if index is None:  # the operand itself
            index = np.arange(int(np.prod(v.aval.shape)), dtype=np.int64).reshape(v.aval.shape)
        # its entries renumbered into this equation's roots
        own_starts = np.cumsum([0] + [int(np.prod(r.aval.shape)) for r in own])
        which = np.searchsorted(own_starts, index, side="right") - 1
        moved = np.array([starts[r] - own_starts[k] for k, r in enumerate(own)], np.int64)
        parts.append(index + moved[which] if index.size else index)
    p, a = eqn.params, parts[0]
    prim = eqn.primitive
    if prim is jp.slice_p:
        strides = p["strides"] or (1,) * a.ndim
        out = a[tuple(slice(lo, hi, st) for lo, hi, st in zip(p["start_indices"], p["limit_indices"], strides))]
    elif prim is jp.squeeze_p:
        out = np.squeeze(a, axis=tuple(p["dimensions"]))
    elif prim is jp.reshape_p:
        if p.get("dimensions") is not None:
            return None
        out = a.reshape(p["new_sizes"])
    elif prim is jp.transpose_p:
        out = a.transpose(p["permutation"])
    elif prim is jp.broadcast_in_dim_p:
        shape, dims = tuple(p["shape"]), tuple(p["broadcast_dimensions"])
        expanded = [1] * len(shape)
        for d, n in zip(dims, a.shape):
            expanded[d] = n
        out = np.broadcast_to(a.reshape(expanded), shape)
    elif prim is jax.lax.stack_p:
        out = np.stack(parts, axis=p["axis"])
    else:
        out = np.concatenate(parts, axis=p["dimension"])
    if out.shape != tuple(eqn.outvars[0].aval.shape):
        return None
    return tuple(roots), np.array(out)  # (a copy: contiguous, 0-d kept)


def cse(closed: jcore.ClosedJaxpr, *, held: Sequence[int] = ()) -> jcore.ClosedJaxpr:
    """``closed`` with every equation that repeats an earlier one removed (common subexpressions).

    Two equations repeat when they apply the same primitive with the same parameters to the
    same operands and have no effects (a user's ``u`` beside a derivative pass's primal of ``u``);
    a body among the parameters is compared by the program it prints and its constants (two
    traces of one network), and a read (:func:`_read_map`) by the entries it reads.

    Args:
      closed: the program.
      held: positions of inputs whose dependent equations are never merged (the derivative
        scales: merged uses at different powers of them would round differently).

    Returns:
      The program without the repeated equations (``closed`` itself when none repeats).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxamp._src.core.interpreter import cse
      >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) + jnp.sin(x))(1.0)
      >>> len(closed.jaxpr.eqns), len(cse(closed).jaxpr.eqns)
      (3, 2)
    """
    jaxpr, env, seen, eqns = closed.jaxpr, {}, {}, []
    tainted = {jaxpr.invars[i] for i in held}
    texts: Dict[Any, Any] = {}  # a body -> its structural key, for this call (the bodies held alive)
    maps: Dict[Any, Any] = {}  # a read's output -> its roots and index map (_read_map)

    def read(v):
        return v if isinstance(v, jcore.Literal) else env.get(v, v)

    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
        if any(not isinstance(v, jcore.Literal) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
            eqns.append(eqn)
            continue
        entries = _read_map(eqn, maps)
        if entries is not None:
            roots, index = entries
            out = eqn.outvars[0]
            if (len(roots) == 1 and str(roots[0].aval) == str(out.aval)
                    and np.array_equal(index, np.arange(index.size).reshape(index.shape))):
                env[out] = roots[0]  # every entry of one array, in its order: the array
                continue
            maps[out] = entries
        try:
            if entries is not None:  # a read: the entries it reads
                key = ("read", entries[0], entries[1].shape, entries[1].tobytes(), str(eqn.outvars[0].aval))
            else:
                params = tuple(sorted((k, _param_key(v, texts)) for k, v in eqn.params.items()))
                key = None if eqn.effects else (eqn.primitive, tuple(map(atom, eqn.invars)), params,
                                                str(eqn.outvars[0].aval))
            earlier = None if key is None else seen.get(key)
        except (TypeError, ValueError):  # unhashable, or compared elementwise
            key = earlier = None
        if earlier is not None:
            env.update(zip(eqn.outvars, earlier))
            continue
        if key is not None and not any(isinstance(v, jcore.DropVar) for v in eqn.outvars):
            seen[key] = eqn.outvars
        eqns.append(eqn)
    if len(eqns) == len(jaxpr.eqns):
        return closed
    new = jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])
    return jcore.ClosedJaxpr(new, closed.consts)
