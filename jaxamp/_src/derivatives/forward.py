"""Forward-mode siblings of :func:`jaxamp._src.derivatives.grad`: ``jvp``, ``jacfwd`` and ``hessian``.

``jax.linearize`` traces ``fun`` once and its linear map is applied to the tangent seed times the
scale of the step above ``fun``'s value; the result is checked and unscaled as
:func:`jaxamp._src.derivatives.grad`'s.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from jaxamp._src.core import boundary
from jaxamp._src.derivatives import vector
from jaxamp._src.derivatives.chain import check_output
from jaxamp._src.core.checks import check_fun, check_wrt
from jaxamp._src.derivatives.grad import finish, jacrev, step
from jaxamp._src.core.interpreter import substitute
from jaxamp._src.core.marks import deriv_scale, fresh, seed

__all__ = ["jvp", "jacfwd", "hessian"]


def _linearized(caller: str, fun: Callable, primals: Sequence[Any], has_aux: bool, of: Optional[str], wrt: Any,
                tree: bool = False):
    """``(out, f_jvp, aux, s)``: ``fun`` linearized at ``primals`` and the scale of its key (one
    array out; ``tree``: a pytree of arrays, the scale that of its first leaf's step)."""
    linear = jax.linearize(lambda *p: fun(*fresh(p)), *primals, has_aux=has_aux)
    out, f_jvp, aux = linear if has_aux else (*linear, None)
    leaves = jax.tree_util.tree_leaves(out)
    if tree and not (leaves and all(hasattr(v, "dtype") for v in leaves)):
        raise TypeError(f"{caller}: `fun`={fun!r} must return an array or a pytree of arrays, got {out!r}.")
    check_output(caller, fun, leaves[0] if tree else out, scalar=False)
    return out, f_jvp, aux, deriv_scale(leaves[0] if tree else out, scalar=True, **step(of, wrt))


def jvp(fun: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any], has_aux: bool = False, *,
        of: Optional[str] = None) -> Tuple[Any, ...]:
    """``jax.jvp`` with the tangents multiplied by the scale of the derivative's key.

    Args:
      fun, primals, tangents, has_aux: as ``jax.jvp`` (``fun`` returns one array).
      of: the name of ``fun``'s value, for per-term keys (as :func:`jaxamp._src.derivatives.grad`).

    Returns:
      ``(out, tangent_out)`` (and ``aux``), the tangent checked under its key and unscaled.

    Example:
      >>> import jax.numpy as jnp
      >>> u, u_t = jvp(lambda t: jnp.exp(-2.0 * t), (0.0,), (1.0,), of="u")
      >>> float(u), float(u_t)
      (1.0, -2.0)
    """
    check_fun("jaxamp.jvp", fun, of)
    pair = isinstance(primals, (tuple, list)) and isinstance(tangents, (tuple, list))
    if not pair or len(primals) != len(tangents):
        raise TypeError(f"jaxamp.jvp: `primals` and `tangents` must be tuples of the same length, got "
                        f"{type(primals).__name__} and {type(tangents).__name__}.")
    if not has_aux and _small(primals, tangents):
        try:  # along small float32 arguments: one request, planned with the point's others
            return fun(*primals), vector.Route(lambda *p: fun(*p[0]), 0).directional(
                (tuple(primals),), tuple(jax.tree_util.tree_map(jnp.asarray, t) for t in tangents), of)
        except vector.NotScalar:
            pass
    if boundary.crosses(fun, primals):  # the network boundary scales and checks each order
        return jax.jvp(fun, primals, tangents, has_aux=has_aux)
    out, f_jvp, aux, s = _linearized("jaxamp.jvp", fun, primals, has_aux, of, None)
    d = f_jvp(*[jax.tree_util.tree_map(lambda t: seed(t, s, jnp.result_type(t)), t) for t in tangents])
    d = finish(d, out, s, step(of, None))
    return (out, d, aux) if has_aux else (out, d)


def _small(primals: Sequence[Any], tangents: Sequence[Any]) -> bool:
    """Whether the primals are small float32 arguments (:func:`vector.eligible`, together) with
    tangents of their structure and shapes."""
    return (vector.eligible(0, (tuple(primals),), {})
            and jax.tree_util.tree_structure(tuple(primals)) == jax.tree_util.tree_structure(tuple(tangents))
            and all(jnp.shape(a) == jnp.shape(b) for a, b in zip(jax.tree_util.tree_leaves(primals),
                                                                 jax.tree_util.tree_leaves(tangents))))


def jacfwd(fun: Callable[..., Any], argnums: Union[int, Sequence[int]] = 0, has_aux: bool = False,
           holomorphic: bool = False, *, of: Optional[str] = None,
           wrt: Optional[Union[str, Sequence[str]]] = None) -> Callable[..., Any]:
    """``jax.jacfwd`` of a function returning one array, with scaled tangent seeds.

    Along a float32 scalar or vector of at most 16 entries of a function returning float32
    values of at most 16 entries (``u(params, z)``), each entry is a ``grad`` chain, all of one
    call one request planned with the point's other derivatives
    (:mod:`jaxamp._src.derivatives.vector`); every other form linearizes ``fun``.

    Args:
      fun, argnums, has_aux, holomorphic: as ``jax.jacfwd``: arrays or pytrees of arrays at
        ``argnums``, an array or a pytree of arrays out (one scale for the step: its first
        output leaf's key).
      of, wrt: names, as :func:`jaxamp._src.derivatives.grad`.

    Returns:
      A function with ``jax.jacfwd``'s outputs, every basis tangent at the key's scale.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp._src.derivatives.grad import grad
      >>> u_net = lambda p, t, x: jnp.sin(p * x)
      >>> u_xx = jacfwd(grad(u_net, 2, of="u", wrt="x"), 2, wrt="x")
      >>> round(float(u_xx(2.0, 0.0, 0.5)), 4)  # -4 sin(1)
      -3.3659
    """
    check_fun("jaxamp.jacfwd", fun, of)
    argnums = check_wrt("jaxamp.jacfwd", argnums, wrt)
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    route = vector.Route(fun, argnums)

    @functools.wraps(fun)
    def derivative(*args, **kwargs):
        if vector.eligible(argnums, args, kwargs, has_aux, holomorphic):
            try:
                return route.jacobian(args, of, wrt)
            except vector.NotScalar:
                pass

        def partial(*dyn):
            return fun(*substitute(args, nums, dyn), **kwargs)

        dyn = [jax.tree_util.tree_map(jnp.asarray, args[i]) for i in nums]
        for i, a in zip(nums, dyn):
            if not all(jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in jax.tree_util.tree_leaves(a)):
                raise TypeError(f"jaxamp.jacfwd: argument {i} (in `argnums`) must hold only float or complex "
                                f"arrays (as jax.jacfwd), got {args[i]!r}.")
        if holomorphic and not all(jnp.iscomplexobj(a) for a in jax.tree_util.tree_leaves(dyn)):
            raise TypeError("jaxamp.jacfwd: holomorphic=True needs complex arguments at `argnums`.")
        if boundary.crosses(partial, dyn):  # the network boundary scales and checks each order
            return jax.jacfwd(fun, argnums, has_aux=has_aux, holomorphic=holomorphic)(*args, **kwargs)
        names = wrt if isinstance(argnums, tuple) and wrt is not None else (wrt,) * len(nums)
        out, f_jvp, aux, s = _linearized("jaxamp.jacfwd", partial, dyn, has_aux, of, wrt, tree=True)
        outs, out_tree = jax.tree_util.tree_flatten(out)
        jacs = []
        for j, a in enumerate(dyn):
            leaves, in_tree = jax.tree_util.tree_flatten(a)
            per_leaf = []  # per input leaf: the output leaves' Jacobians
            for li, leaf in enumerate(leaves):
                def column(e, j=j, li=li):
                    tangent = [jnp.zeros_like(b) for b in leaves]
                    tangent[li] = seed(e, s, e.dtype)
                    full = [jax.tree_util.tree_map(jnp.zeros_like, b) for b in dyn]
                    full[j] = jax.tree_util.tree_unflatten(in_tree, tangent)
                    return jax.tree_util.tree_leaves(f_jvp(*full))

                basis = jnp.eye(leaf.size, dtype=leaf.dtype).reshape((leaf.size,) + leaf.shape)
                cols = jax.vmap(column)(basis)  # per output leaf: [leaf.size, *o.shape]
                per_leaf.append([finish(jnp.moveaxis(c, 0, -1).reshape(o.shape + leaf.shape), o, s, step(of, names[j]))
                                 for c, o in zip(cols, outs)])
            jacs.append([jax.tree_util.tree_unflatten(in_tree, [per_leaf[li][o] for li in range(len(leaves))])
                         for o in range(len(outs))])
        # jax.jacfwd's structure: the output's tree, each leaf the argument's tree (a tuple of
        # them for a tuple `argnums`)
        result = jax.tree_util.tree_unflatten(out_tree, [tuple(j[o] for j in jacs) if isinstance(argnums, tuple)
                                                         else jacs[0][o] for o in range(len(outs))])
        return (result, aux) if has_aux else result

    return derivative


def hessian(fun: Callable[..., Any], argnums: Union[int, Sequence[int]] = 0, has_aux: bool = False,
            holomorphic: bool = False, *, of: Optional[str] = None,
            wrt: Optional[Union[str, Sequence[str]]] = None) -> Callable[..., Any]:
    """``jax.hessian``: :func:`jacfwd` of :func:`jaxamp.jacrev` (keys of orders 1 and 2); along a
    small float32 argument of a function with small float32 values, one chain per entry on and
    above the diagonal, one request, those the program never reads left out
    (:mod:`jaxamp._src.derivatives.vector`).

    Args:
      fun, argnums, has_aux, holomorphic: as ``jax.hessian`` (``fun`` returns one array; pytree
        arguments give jax.hessian's nested structure).
      of, wrt: names, as :func:`jaxamp.grad`.

    Returns:
      A function with ``jax.hessian``'s outputs, each step scaled and checked under ``scaled``.

    Example:
      >>> import jax.numpy as jnp
      >>> u_net = lambda p, xy: p * jnp.sum(xy**2)
      >>> float(jnp.trace(hessian(u_net, argnums=1)(3.0, jnp.ones(2))))
      12.0
    """
    inner = jacrev(fun, argnums, has_aux=has_aux, holomorphic=holomorphic, of=of, wrt=wrt)
    composed = jacfwd(inner, argnums, has_aux=has_aux, holomorphic=holomorphic, wrt=wrt)
    route = vector.Route(fun, argnums)

    @functools.wraps(fun)
    def derivative(*args, **kwargs):
        if vector.eligible(argnums, args, kwargs, has_aux, holomorphic):
            try:
                return route.hessian(args, of, wrt)
            except vector.NotScalar:
                pass
        return composed(*args, **kwargs)

    return derivative
