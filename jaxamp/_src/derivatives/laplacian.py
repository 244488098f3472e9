"""``jaxamp._src.derivatives.laplacian``: a scaled Laplacian by collapsed Taylor mode
(:mod:`jaxamp._src.taylor.collapsed`).

With ``m`` the order of ``fun``'s value (the highest order of the drop-in derivatives it depends
on, :mod:`jaxamp._src.core.nesting`), the first-order tangents carry the scale ``s1`` of order ``m + 1``
(per term: key ``of``), the summed second order ``s2`` of order ``m + 2`` (``of + "__lap"``) by the
factors ``(s2 / s1, 1 / s1)``: no float16 value carries ``s1 * s2``. Its value is a derivative of
order ``m + 2`` with no name.

Along one entry, or when ``fun`` takes derivatives itself (``jaxamp.grad`` chains inside, ``x`` of
at most 16 entries), each entry's second derivative is a chain two steps longer (steps named
``(lap, None)``: the same keys), planned with the point's other requests.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.core import interpreter
from jaxamp._src.derivatives.plan import LAP
from jaxamp._src.core.checks import check_fun
from jaxamp._src.core.marks import SEP, deriv_check, deriv_scale, fresh, seed
from jaxamp._src.derivatives import chain_call, vector
from jaxamp._src.core.nesting import NO_DERIVATIVE, analyze, single_name
from jaxamp._src.taylor.collapsed import propagate_jaxpr

__all__ = ["laplacian", "METHODS"]

CALLER = "jaxamp.laplacian"
Step = Tuple[jax.Array, jax.Array]  # (scaled first-order tangents, scaled sum of second orders)


def _collapsed(closed, g, x, basis, s1, s2) -> Step:
    _, first, second = propagate_jaxpr(closed, x, seed(basis, s1, x.dtype), (s2 / s1, 1.0 / s1))
    return first, second


def _each(one: Callable, rows: jax.Array) -> Step:
    """``one(row)`` for every row, unrolled as the collapsed method (not ``jax.vmap``): the first
    orders stacked, the second orders summed."""
    first, second = zip(*[one(rows[i]) for i in range(rows.shape[0])])
    return jnp.stack(first), jnp.sum(jnp.stack(second), axis=0)


def _taylor(closed, g, x, basis, s1, s2) -> Step:
    # one second-order propagation per direction: the collapsed interpreter with D = 1
    # (jaxamp._src.taylor.second_order gives the same values, but its float32 factors round float64)
    def one(t):
        _, first, second = propagate_jaxpr(closed, x, t[None], (s2 / s1, 1.0 / s1))
        return first[0], second

    return _each(one, seed(basis, s1, x.dtype))


def _forward(closed, g, x, basis, s1, s2) -> Step:
    def one(e):
        inner = lambda z: jax.jvp(g, (z,), (seed(e, s1, x.dtype),))[1]  # noqa: E731
        return jax.jvp(inner, (x,), (seed(e, s2 / s1, x.dtype),))

    return _each(one, basis)


def _reverse(closed, g, x, basis, s1, s2) -> Step:
    def scaled_grad(z):  # the seed of the backward pass carries s1
        return jax.grad(lambda w: seed(g(w), s1))(z)

    columns = jnp.stack([jax.jvp(scaled_grad, (x,), (seed(basis[i], s2 / s1, x.dtype),))[1]
                         for i in range(basis.shape[0])])
    return scaled_grad(x), jnp.sum(jnp.where(basis != 0, columns, 0))  # the diagonal entries


METHODS: Dict[str, Callable[..., Step]] = {"collapsed": _collapsed, "taylor": _taylor, "forward": _forward,
                                           "reverse": _reverse}


def _static_indices(indices: Any) -> Optional[Tuple[int, ...]]:
    if indices is None:
        return None
    try:
        a = np.asarray(indices)
    except Exception:  # a tracer: the directions must be known when the program is traced
        a = None
    if a is None or a.ndim != 1 or a.size == 0 or not (a.dtype.kind in "iu" or a.dtype == object):
        raise TypeError(f"{CALLER}: `indices`={indices!r} must be None or a non-empty sequence of distinct "
                        "non-negative Python ints (static), the entries of x to differentiate along.")
    out = tuple(int(i) for i in a) if all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                          for i in a.tolist()) else None
    if out is None or min(out) < 0 or len(set(out)) != len(out):
        raise ValueError(f"{CALLER}: `indices`={indices!r} must be distinct non-negative ints.")
    return out


def laplacian(fun: Callable[..., Any], argnums: int = 0, *, of: Optional[str] = None,
              indices: Optional[Sequence[int]] = None, method: str = "collapsed") -> Callable[..., jax.Array]:
    """The Laplacian of ``fun`` in its argument ``argnums``, scaled and checked as :func:`grad`.

    Args:
      fun: a function returning one scalar (shape ``()``), floating point.
      argnums: the position of ``x``, a floating-point array of shape ``(d,)`` or a scalar.
      of: the name of ``fun``'s value (``"u"``), for per-term keys; default: the one name the
        drop-in derivatives ``fun``'s value depends on carry, if exactly one.
      indices: the entries of ``x`` to sum over (distinct ints in ``[0, d)``); None: all.
      method: ``"collapsed"`` (default), or a baseline ``"taylor"``, ``"forward"``, ``"reverse"``.

    Returns:
      A function with ``fun``'s signature returning ``sum_{i in indices} d^2 fun / dx_i^2``
      (``fun``'s and ``x``'s dtypes promoted); outside :func:`jaxamp._src.core.scaled`,
      ``jnp.trace(jax.hessian(fun, argnums)(*args))`` to rounding.

    Example:
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> u_net = lambda p, x: p * jnp.sum(jnp.sin(x))
      >>> lap = laplacian(u_net, argnums=1, of="u")
      >>> points = jnp.zeros((4, 3))
      >>> loss = lambda p: jnp.mean(jax.vmap(lambda x: lap(p, x) + u_net(p, x))(points) ** 2)
      >>> r, found_inf = jaxamp.scaled(loss)({"1": 0.5, "2": 0.25}, 2.0)
      >>> float(r), sorted(found_inf)
      (0.0, ['1', '2', 'nonfinite_values'])
    """
    check_fun(CALLER, fun, of)
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise TypeError(f"{CALLER}: `argnums`={argnums!r} must be an int (the position of one argument x).")
    if method not in METHODS:
        raise ValueError(f"{CALLER}: `method`={method!r} must be one of {sorted(METHODS)}.")
    static = _static_indices(indices)
    route = vector.Route(fun, argnums)

    @functools.wraps(fun)
    def value(*args, **kwargs):
        if not -len(args) <= argnums < len(args):
            raise ValueError(f"{CALLER}: `argnums`={argnums} must index one of the {len(args)} positional "
                             f"arguments of `fun` (0..{len(args) - 1}).")
        pos = argnums % len(args)
        chains = method == "collapsed" and vector.eligible(argnums, args, kwargs)
        if chains and jnp.size(args[pos]) == 1:
            try:  # one entry: the second derivative, a chain planned with the point's other requests
                return route.diagonal(args, of, (LAP, None), (0,))  # its keys: of (order 1), of__lap (order 2)
            except vector.NotScalar:
                pass
        x = args[pos]
        if not hasattr(x, "dtype") and not isinstance(x, float):
            raise TypeError(f"{CALLER}: argument {pos} (`argnums`) must be a floating-point array x, got "
                            f"{type(x).__name__}.")
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim > 1:
            raise TypeError(f"{CALLER}: argument {pos} (`argnums`) must be a floating-point scalar or array of "
                            f"shape (d,), got {x.dtype}{list(x.shape)}.")
        d = x.size
        idx = tuple(range(d)) if static is None else static
        if max(idx) >= d:
            raise ValueError(f"{CALLER}: `indices`={indices!r} must be entries of x in [0, {d}), x has shape "
                             f"{tuple(x.shape)}.")

        def flat(zv):
            return fun(*interpreter.substitute(args, (pos,), (jnp.reshape(fresh(zv), x.shape),)), **kwargs)

        xv = jnp.reshape(x, (d,))
        closed = jax.make_jaxpr(flat)(xv)
        if chains and d <= chain_call.MAX_SIZE and chain_call.has_chains(closed.jaxpr):
            try:  # fun takes derivatives itself: each entry's second derivative a chain one step longer
                return route.diagonal(args, of, (LAP, None), idx)  # planned with the point's requests
            except vector.NotScalar:
                pass
        closed = chain_call.expand(closed)  # nests of jaxamp.grad in fun computed
        avals = closed.out_avals
        if len(avals) != 1 or avals[0].shape != () or not jnp.issubdtype(avals[0].dtype, jnp.inexact):
            got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)
            raise TypeError(f"{CALLER}: `fun`={fun!r} must return one floating-point scalar (shape ()), got {got}.")
        # one step and two steps above fun's value (jaxamp._src.core.nesting); the second's name: u__lap
        term = of if of is not None else single_name(analyze(closed.jaxpr, [NO_DERIVATIVE]).outs[0])
        keys = {"first": dict(order=1, term=term, wrt=None),
                "second": dict(order=2, term=None if term is None else SEP.join((term, LAP)), wrt=None)}

        def g(zv):  # fun as traced once
            return interpreter.eval_jaxpr(closed.jaxpr, closed.consts, [zv], interpreter.bind)[0]

        y = g(xv)
        # one f32[] scale per key, unbatched under vmap: the seeds enter a linear first layer once
        s1, s2 = deriv_scale(y, scalar=True, **keys["first"]), deriv_scale(y, scalar=True, **keys["second"])
        basis = jnp.asarray(np.eye(d)[list(idx)], xv.dtype)
        first, second = METHODS[method](closed, g, xv, basis, s1, s2)
        deriv_check(first, y, **keys["first"])  # the first-order tangents: flags only
        second = deriv_check(second, y, **keys["second"])
        return seed(second, jnp.float32(1.0) / s2, jnp.promote_types(y.dtype, x.dtype))  # unscaled in float32

    return value
