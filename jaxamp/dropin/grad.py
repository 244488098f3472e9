"""``jaxamp.dropin.grad``: ``jax.grad`` whose seed carries the derivative scale of its order.

Each call differentiates ``fun(*args) * s`` (``s``: the scale of this derivative's key, a
``deriv_scale_p``), marks the scaled gradient for the overflow check (``deriv_check_p``)
and multiplies it by ``1/s`` in float32, inside the differentiable graph: the derivative
step of the Derivatives engine's ``method="reverse"`` (docs/algorithm.md, "One derivative
step"), so nested calls give its values under the same scaler keys. Outside
:func:`jaxamp.dropin.scaled` the scale is 1 and the check the identity: this is ``jax.grad``.

The order of a call is 1 + the highest order of the ``grad`` calls made while ``fun`` is
evaluated (``grad(grad(u, 2), 2)``: inner 1, outer 2), found at trace time from a
Python-level stack of the calls under way (static integers only, no tracers are kept).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, List, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxamp.dropin.primitives import deriv_check, deriv_scale

__all__ = ["grad", "SEP"]

SEP = "__"  # as jaxamp.derivatives: "u__x" is du/dx
_STATE = threading.local()


class _Frame:
    """What the ``grad`` calls made while one ``fun`` is evaluated report to it."""

    def __init__(self) -> None:
        self.max_order = 0
        self.names: List[Optional[str]] = []


def _stack() -> List[_Frame]:
    if not hasattr(_STATE, "frames"):
        _STATE.frames = []
    return _STATE.frames


def _check_name(arg: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"jaxamp.grad: `{arg}`={value!r} must be a non-empty string (a variable name).")


def _unscale(g: jax.Array, inv: jax.Array) -> jax.Array:
    if not jnp.issubdtype(g.dtype, jnp.inexact):  # float0 gradients of integers (allow_int)
        return g
    wide = jnp.promote_types(g.dtype, jnp.float32)
    return (g.astype(wide) * inv.astype(wide)).astype(g.dtype)


def grad(
    fun: Callable[..., Any],
    argnums: Union[int, Sequence[int]] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    *,
    of: Optional[str] = None,
    wrt: Optional[Union[str, Sequence[str]]] = None,
) -> Callable[..., Any]:
    """``jax.grad`` with a derivative scale on the seed and an overflow check on the result.

    Args:
      fun, argnums, has_aux, holomorphic, allow_int: as ``jax.grad``.
      of: the name of ``fun``'s value (``"u"``), needed for per-term scaler keys and special
        terms. Default: the name of the inner ``grad`` ``fun`` calls (``"u__x"``), if any.
      wrt: the name of the differentiated argument (``"x"``), or one name per entry of a
        tuple ``argnums``; names the result (``of + "__" + wrt``) for an outer ``grad``.

    Returns:
      A function with ``jax.grad``'s outputs. Under :func:`jaxamp.dropin.scaled` its seed is
      the scale of its key (per-order: ``str(order)``; per-term or a special term: the name
      ``of``) and its scaled result is checked for inf/NaN under that key.

    Example:
      >>> u_x = grad(u_net, argnums=2, of="u", wrt="x")          # doctest: +SKIP
      >>> u_xx = grad(u_x, argnums=2, wrt="x")                   # key "2" ("u__x" per term)
      >>> (r, found_inf) = scaled(residual, amp)(scales, params, t, x)  # doctest: +SKIP
    """
    if not callable(fun):
        raise TypeError(f"jaxamp.grad: `fun`={fun!r} must be callable.")
    multi = not isinstance(argnums, int)
    if multi and not (isinstance(argnums, (tuple, list)) and all(isinstance(a, int) for a in argnums)):
        raise TypeError(f"jaxamp.grad: `argnums`={argnums!r} must be an int or a tuple of ints.")
    argnums = tuple(argnums) if multi else argnums
    if of is not None:
        _check_name("of", of)
    if wrt is not None:
        names = (wrt,) if isinstance(wrt, str) else tuple(wrt)
        for n in names:
            _check_name("wrt", n)
        if isinstance(wrt, str) == multi or (multi and len(names) != len(argnums)):
            raise ValueError(
                f"jaxamp.grad: `wrt`={wrt!r} must be one name for an int `argnums` or a tuple of "
                f"{len(argnums) if multi else 1} names for `argnums`={argnums!r}."
            )

    @functools.wraps(fun)
    def derivative(*args, **kwargs):
        frame, found = _Frame(), {}

        def seeded(*a, **kw):
            out = fun(*a, **kw)
            out, aux = out if has_aux else (out, None)
            names = set(frame.names)
            term = of if of is not None else (names.pop() if len(names) == 1 else None)
            found.update(order=frame.max_order + 1, term=term)
            s = deriv_scale(out, order=found["order"], term=term)
            wide = jnp.promote_types(jnp.result_type(out), jnp.float32)
            return jnp.asarray(out, wide) * s.astype(wide), (out, s, aux)

        _stack().append(frame)
        try:
            g = jax.grad(seeded, argnums, has_aux=True, holomorphic=holomorphic, allow_int=allow_int)
            grads, (value, s, aux) = g(*args, **kwargs)
        finally:
            _stack().pop()
        order, term = found["order"], found["term"]
        inv = jnp.float32(1.0) / s
        def check(d):  # float0 gradients (allow_int) are not checked
            return deriv_check(d, value, order=order, term=term) if jnp.issubdtype(d.dtype, jnp.inexact) else d

        grads = jax.tree_util.tree_map(lambda d: _unscale(check(d), inv), grads)
        if _stack():
            parent = _stack()[-1]
            parent.max_order = max(parent.max_order, order)
            parent.names.append(SEP.join((term, wrt)) if term is not None and isinstance(wrt, str) else None)
        return (grads, aux) if has_aux else grads

    return derivative
