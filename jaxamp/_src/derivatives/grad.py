"""``jaxamp._src.derivatives.grad``: ``jax.grad`` whose seed carries the derivative scale of its order.

Each call differentiates ``fun(*args) * s`` (``s``: its key's ``deriv_scale_p``), marks the
scaled gradient for the check (``deriv_check_p``) and multiplies it by ``1/s`` in float32. Its
marks are one step above ``fun``'s value: :mod:`jaxamp._src.core.nesting` reads the order and the name
from the program (1 + the highest order of the derivatives the value depends on).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from jaxamp._src.core import boundary
from jaxamp._src.core.checks import check_fun, check_wrt
from jaxamp._src.derivatives import chain, chain_call, vector
from jaxamp._src.core.interpreter import substitute
from jaxamp._src.core.marks import deriv_check, deriv_scale, fresh, seed, unscale

__all__ = ["grad", "jacrev"]

def step(of: Optional[str], wrt: Any) -> Dict[str, Any]:
    """The marks' parameters of one derivative step of the value named ``of`` (None: its name
    from the program) along the variable named ``wrt`` (a string, else unnamed)."""
    return dict(order=1, term=of, wrt=wrt if isinstance(wrt, str) else None)


def finish(d: jax.Array, value: jax.Array, s: jax.Array, marks: Dict[str, Any],
           inv: Optional[jax.Array] = None) -> jax.Array:
    """The scaled derivative ``d`` of ``value`` checked under ``marks`` (:func:`step`) and unscaled
    by ``inv`` (default ``1 / s``); float0 gradients (allow_int) pass unchecked."""
    if not jnp.issubdtype(d.dtype, jnp.inexact):
        return d
    d = deriv_check(d, value, **marks)
    return unscale(d, jnp.float32(1.0) / s if inv is None else inv)


def _pair(caller: str, out: Any) -> Tuple[Any, Any]:
    """``(value, aux)`` of a ``has_aux`` function's output, else the TypeError jax.grad gives."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f"{caller}: has_aux=True requires `fun` to return a pair (value, aux), got "
                        f"{type(out).__name__}.")
    return out[0], out[1]


def _value_of(caller: str, fun: Callable) -> Callable:
    """``fun``'s value, the first of the pair a ``has_aux`` function returns."""
    return lambda *args, **kwargs: _pair(caller, fun(*args, **kwargs))[0]


def _reverse(transform: Callable, caller: str, scalar: bool, fun: Callable, argnums, has_aux: bool, of, wrt,
             method: str = "reverse", **options) -> Callable:
    """``transform`` (jax.grad, ``scalar``: of a scalar output; or jax.jacrev) of ``fun``, its seed
    scaled, its result checked; ``caller`` names it in errors only."""
    check_fun(caller, fun, of)
    argnums = check_wrt(caller, argnums, wrt)
    if method not in chain.METHODS:
        raise ValueError(f"{caller}: `method`={method!r} is not allowed: expected one of {list(chain.METHODS)}.")
    chained = not any(options.values()) and method != "reverse" and (not has_aux or scalar)
    # has_aux: the chain differentiates fun's value (its first output); the aux is fun's own
    base = _value_of(caller, fun) if has_aux else fun
    link = chain.extend(base, argnums, of, wrt) if chained else None
    route = vector.Route(fun, argnums)  # jacrev along a small argument: planned entry by entry
    # a tuple of scalar argnums (grad(u, (1, 2)) -> (u_t, u_x)): one chain per argnum, their
    # passes shared as those of separate grad calls at the same point
    links: Tuple[chain.Chain, ...] = ()
    if chained and isinstance(argnums, tuple) and scalar:
        names = tuple(wrt) if wrt is not None else (None,) * len(argnums)
        links = tuple(chain.extend(base, a, of, w) for a, w in zip(argnums, names))

    def chains(args) -> Any:  # the chains' derivatives at args (and fun's aux)
        engine = method == "forward"  # the engine with AMP off too
        d = tuple(chain_call.bind_chains(links, args, engine)) if links else chain_call.bind_chain(link, args, engine)
        if not has_aux:
            return d
        return d, _pair(caller, fun(*args))[1]  # the aux at the point (its forward pass merged with the chain's)

    @functools.wraps(fun)
    def derivative(*args, **kwargs):
        # jacrev along a small argument, grad along a small pytree or vector of coordinates: entry
        # by entry, requests planned with the point's others (else a chain's step, or JAX's reverse mode)
        small = vector.eligible(argnums, args, kwargs, has_aux, options["holomorphic"])
        if small and (not scalar or (method != "reverse" and vector.is_pytree(args[argnums]))
                      or (method == "auto" and jnp.ndim(args[argnums]) == 1)):
            try:  # a scalar or small vector argument, small values: entry by entry
                return route.jacobian(args, of, wrt)
            except vector.NotScalar:
                pass
        if chain.eligible(link, args, kwargs) or (links and all(chain.eligible(c, args, kwargs) for c in links)):
            return chains(args)
        if method == "forward":
            raise ValueError(f"{caller}: method='forward' needs scalar `argnums` and float32 scalar arguments "
                             f"there, given by position; got argnums={argnums!r}. Use method='auto'.")
        if boundary.crosses(fun, args, kwargs):  # the network boundary scales and checks each order
            return transform(fun, argnums, has_aux=has_aux, **options)(*args, **kwargs)
        nums = argnums if isinstance(argnums, tuple) else (argnums,)

        def seeded(*a, **kw):
            out = fun(*substitute(a, nums, [fresh(a[i]) for i in nums]), **kw)
            out, aux = out if has_aux else (out, None)
            leaves = jax.tree_util.tree_leaves(out)
            tree = not scalar and not isinstance(argnums, tuple) and vector.is_pytree(out) and bool(leaves) and all(
                hasattr(v, "dtype") for v in leaves)  # jacrev of a pytree of arrays: JAX's layout
            for v in (leaves if tree else [out]):
                chain.check_output(caller, fun, v, scalar=scalar)
            s = deriv_scale(leaves[0] if tree else out, scalar=True, **step(of, wrt))
            return jax.tree_util.tree_map(lambda v: seed(v, s), out), (out, s, aux)

        grads, (value, s, aux) = transform(seeded, argnums, has_aux=True, **options)(*args, **kwargs)
        inv = jnp.float32(1.0) / s

        def checked(tree, name):
            if vector.is_pytree(value):  # each output leaf's Jacobian (a pytree of argnum's structure) by its value
                return jax.tree_util.tree_map(lambda v, sub: jax.tree_util.tree_map(
                    lambda d: finish(d, v, s, step(of, name), inv), sub), value, tree)
            return jax.tree_util.tree_map(lambda d: finish(d, value, s, step(of, name), inv), tree)

        if isinstance(argnums, tuple):  # one name per argnum
            names = wrt if wrt is not None and not isinstance(wrt, str) else (None,) * len(argnums)
            grads = tuple(checked(g, n) for g, n in zip(grads, names))
        else:
            grads = checked(grads, wrt)
        return (grads, aux) if has_aux else grads

    # an outer grad along a scalar extends this chain (None: no chain, whatever wraps copied)
    chain.register(derivative, link if not has_aux else None)
    return derivative


def grad(fun: Callable[..., Any], argnums: Union[int, Sequence[int]] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False, *, of: Optional[str] = None,
         wrt: Optional[Union[str, Sequence[str]]] = None, method: str = "auto") -> Callable[..., Any]:
    """``jax.grad`` with a derivative scale on the seed and an overflow check on the result.

    Args:
      fun, argnums, has_aux, holomorphic, allow_int: as ``jax.grad``.
      of: the name of ``fun``'s value (``"u"``), for per-term keys and special terms; default:
        the name of the inner ``grad`` ``fun`` calls (``"u__x"``), if any.
      wrt: the differentiated argument's name (``"x"``), one per entry of a tuple ``argnums``.
      method: ``"auto"`` (default): a nest of ``grad`` steps along float32 scalar arguments
        runs as one Derivatives plan (:mod:`jaxamp._src.derivatives.chain`), a step along a small
        pytree of float32 coordinates (a dict of scalars and vectors, 16 entries in all) one chain
        per entry as ``jacrev`` (:mod:`jaxamp._src.derivatives.vector`), other calls in reverse
        mode; an entry point with AMP off computes the plan as JAX's nest of ``jax.grad`` (the
        user's program, bit for bit); ``"reverse"``: nested ``jax.grad`` always; ``"forward"``:
        the plan with AMP off too, an error where no chain runs.

    Returns:
      A function with ``jax.grad``'s outputs: under :func:`jaxamp._src.core.scaled` seeded with its
      key's scale and checked for inf/NaN; outside, plain JAX derivatives (scale 1, unchecked).

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> u_net = lambda p, t, x: jnp.sin(p * x) * jnp.exp(-t)
      >>> u_x = grad(u_net, argnums=2, of="u", wrt="x")
      >>> u_xx = grad(u_x, argnums=2, wrt="x")                   # key "2" ("u__x" per term)
      >>> residual = lambda p, t, x: u_xx(p, t, x) + p**2 * u_net(p, t, x)
      >>> r, found_inf = jaxamp.scaled(residual)({"1": 1.0, "2": 2.0**-4}, 3.0, 0.0, 0.2)
      >>> abs(float(r)) < 1e-5, sorted(found_inf)
      (True, ['1', '2', 'nonfinite_values'])
    """
    return _reverse(jax.grad, "jaxamp.grad", True, fun, argnums, has_aux, of, wrt, method, holomorphic=holomorphic,
                    allow_int=allow_int)


def jacrev(fun: Callable[..., Any], argnums: Union[int, Sequence[int]] = 0, has_aux: bool = False,
           holomorphic: bool = False, allow_int: bool = False, *, of: Optional[str] = None,
           wrt: Optional[Union[str, Sequence[str]]] = None) -> Callable[..., Any]:
    """``jax.jacrev`` of a function returning one array, scaled and checked as :func:`grad` (along
    a small float32 argument of a function with small float32 values: planned as
    :func:`jaxamp.jacfwd` is).

    Args:
      fun, argnums, has_aux, holomorphic, allow_int: as ``jax.jacrev`` (``fun`` returns one array).
      of, wrt: names, as :func:`grad`.

    Returns:
      A function with ``jax.jacrev``'s outputs, scaled and checked under ``scaled``.

    Example:
      >>> import jax.numpy as jnp
      >>> u_net = lambda p, xy: jnp.stack([p * xy[0], xy[1] ** 2])
      >>> jacrev(u_net, argnums=1, of="u", wrt="x")(2.0, jnp.array([1.0, 3.0]))
      Array([[2., 0.],
             [0., 6.]], dtype=float32)
    """
    return _reverse(jax.jacrev, "jaxamp.jacrev", False, fun, argnums, has_aux, of, wrt, holomorphic=holomorphic,
                    allow_int=allow_int)
