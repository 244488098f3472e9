"""``jaxamp.dropin.grad``: ``jax.grad`` whose seed carries the derivative scale of its order.

Each call differentiates ``fun(*args) * s`` (``s``: the scale of this derivative's key, a
``deriv_scale_p``), marks the scaled gradient for the overflow check (``deriv_check_p``)
and multiplies it by ``1/s`` in float32, inside the differentiable graph (docs/algorithm.md,
"One derivative step"): the one reverse step, which the Derivatives engine's
``method="reverse"`` is written with. Outside
:func:`jaxamp.dropin.scaled` the scale is 1 and the check the identity: this is ``jax.grad``.

The order of a call is 1 + the highest order of the ``grad`` calls made while ``fun`` is
evaluated (``grad(grad(u, 2), 2)``: inner 1, outer 2), found at trace time from a
Python-level stack of the calls under way (static integers only, no tracers are kept).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from jaxamp.dropin import chain
from jaxamp.marks import SEP, deriv_check, deriv_scale, seed, unscale

__all__ = ["grad", "jacrev"]

_STATE = threading.local()


class Frame:
    """What the ``grad`` calls made while one ``fun`` is evaluated report to it."""

    def __init__(self) -> None:
        self.max_order = 0
        self.names: List[Optional[str]] = []


def frames() -> List[Frame]:
    """The frames of the derivative calls under way in this thread, innermost last."""
    if not hasattr(_STATE, "frames"):
        _STATE.frames = []
    return _STATE.frames


def check_name(arg: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"jaxamp.dropin: `{arg}`={value!r} must be a non-empty string (a variable name).")


def check_fun(caller: str, fun: Any, of: Any) -> None:
    """Raise unless ``fun`` is callable and ``of`` is None or a variable name."""
    if not callable(fun):
        raise TypeError(f"{caller}: `fun`={fun!r} must be callable.")
    if of is not None:
        check_name("of", of)


def check_wrt(caller: str, argnums: Any, wrt: Any) -> Union[int, Tuple[int, ...]]:
    """Validate ``argnums`` (an int or a tuple of ints) and ``wrt`` (one name per argnum)."""
    multi = not isinstance(argnums, int)
    if multi and not (isinstance(argnums, (tuple, list)) and all(isinstance(a, int) for a in argnums)):
        raise TypeError(f"{caller}: `argnums`={argnums!r} must be an int or a tuple of ints.")
    if wrt is not None:
        names = (wrt,) if isinstance(wrt, str) else tuple(wrt)
        for n in names:
            check_name("wrt", n)
        if isinstance(wrt, str) == multi or (multi and len(names) != len(argnums)):
            raise ValueError(
                f"{caller}: `wrt`={wrt!r} must be one name for an int `argnums` or a tuple of "
                f"{len(argnums) if multi else 1} names for `argnums`={argnums!r}."
            )
    return tuple(argnums) if multi else argnums


def term_of(frame: Frame, of: Optional[str]) -> Optional[str]:
    """The name of the value a derivative differentiates: ``of``, else the one name the inner
    derivatives of its function reported, else None."""
    names = set(frame.names)
    return of if of is not None else (names.pop() if len(names) == 1 else None)


def report(order: int, term: Optional[str], wrt: Any) -> None:
    """Tell the enclosing derivative call (if any) the order and the name of this one."""
    if frames():
        parent = frames()[-1]
        parent.max_order = max(parent.max_order, order)
        parent.names.append(SEP.join((term, wrt)) if term is not None and isinstance(wrt, str) else None)


def _by_engine(link: chain.Chain, args) -> jax.Array:
    """The chain's top derivative by the forward engine; the orders reported as the nest would."""
    probe = Frame()
    frames().append(probe)
    try:
        jax.make_jaxpr(lambda *a: link.base(*a))(*args)  # its calls' orders (a new function: no trace cache)
    finally:
        frames().pop()
    frames().append(Frame())
    try:
        value, order, term = chain.shared(link, args, probe.max_order)
    finally:
        frames().pop()
    report(order, term, link.wrts[-1])
    return value


def _reverse(transform: Callable, caller: str, fun: Callable, argnums, has_aux: bool, of, wrt,
             method: str = "reverse", **options) -> Callable:  # fmt: skip
    """``transform`` (jax.grad or jax.jacrev) of ``fun``, its seed scaled, its result checked."""
    check_fun(caller, fun, of)
    argnums = check_wrt(caller, argnums, wrt)
    if method not in chain.METHODS:
        raise ValueError(f"{caller}: `method`={method!r} is not allowed: expected one of {list(chain.METHODS)}.")
    plain = not has_aux and not any(options.values())
    link = chain.extend(fun, argnums, of, wrt) if plain and method != "reverse" else None

    @functools.wraps(fun)
    def derivative(*args, **kwargs):
        if chain.eligible(link, args, kwargs):
            return _by_engine(link, args)
        if method == "forward":
            raise ValueError(f"{caller}: method='forward' needs int `argnums` and float32 scalar arguments "
                             f"there, given by position; got argnums={argnums!r}. Use method='auto'.")
        frame, found = Frame(), {}

        def seeded(*a, **kw):
            out = fun(*a, **kw)
            out, aux = out if has_aux else (out, None)
            if caller == "jaxamp.grad":
                chain.check_scalar(caller, fun, out)
            elif not hasattr(out, "dtype"):
                raise TypeError(f"{caller}: `fun`={fun!r} must return one array, got {type(out).__name__}.")
            found.update(order=frame.max_order + 1, term=term_of(frame, of))
            s = deriv_scale(out, **found)
            return seed(out, s), (out, s, aux)

        frames().append(frame)
        try:
            grads, (value, s, aux) = transform(seeded, argnums, has_aux=True, **options)(*args, **kwargs)
        finally:
            frames().pop()
        inv = jnp.float32(1.0) / s

        def check(d):  # float0 gradients (allow_int) are not checked
            return deriv_check(d, value, **found) if jnp.issubdtype(d.dtype, jnp.inexact) else d

        grads = jax.tree_util.tree_map(lambda d: unscale(check(d), inv), grads)
        report(found["order"], found["term"], wrt)
        return (grads, aux) if has_aux else grads

    if link is not None:
        derivative._jaxamp_chain = link  # an outer grad along a scalar extends this chain
    return derivative


def grad(fun: Callable[..., Any], argnums: Union[int, Sequence[int]] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False, *, of: Optional[str] = None,
         wrt: Optional[Union[str, Sequence[str]]] = None, method: str = "auto") -> Callable[..., Any]:
    """``jax.grad`` with a derivative scale on the seed and an overflow check on the result.

    Args:
      fun, argnums, has_aux, holomorphic, allow_int: as ``jax.grad``.
      of: the name of ``fun``'s value (``"u"``), needed for per-term scaler keys and special
        terms. Default: the name of the inner ``grad`` ``fun`` calls (``"u__x"``), if any.
      wrt: the name of the differentiated argument (``"x"``), or one name per entry of a
        tuple ``argnums``; names the result (``of + "__" + wrt``) for an outer ``grad``.
      method: ``"auto"`` (default): a nest of ``grad`` calls whose every step differentiates a
        float32 scalar argument (an ``int`` ``argnums``, no ``has_aux``) runs as one plan of the
        Derivatives engine (:mod:`jaxamp.dropin.chain`: nested forward mode, one tangent for a
        pure second order, Taylor mode for pure orders >= 3); any other call is reverse mode.
        ``"reverse"``: nested ``jax.grad`` always (and this call starts no chain).
        ``"forward"``: as ``"auto"``, an error where the chain cannot run.

    Returns:
      A function with ``jax.grad``'s outputs. Under :func:`jaxamp.dropin.scaled` its seed is
      the scale of its key (per-order: ``str(order)``; per-term or a special term: the name
      ``of``) and its scaled result is checked for inf/NaN under that key.

    Outside :func:`jaxamp.scaled` / :func:`jaxamp.value_and_grad` (e.g. a loss evaluated for
    logging) every scale is 1 and nothing is checked: plain JAX derivatives, which in float16
    may overflow where the scaled program does not; evaluate such a loss with
    ``jaxamp.scaled(loss)(state, ...)``. Float64 arguments are float32 unless JAX's x64 mode is
    on (JAX's own rule); the engine plan (``method="auto"``) takes float32 scalars only.

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
    return _reverse(jax.grad, "jaxamp.grad", fun, argnums, has_aux, of, wrt, method, holomorphic=holomorphic,
                    allow_int=allow_int)


def jacrev(fun: Callable[..., Any], argnums: Union[int, Sequence[int]] = 0, has_aux: bool = False,
           holomorphic: bool = False, allow_int: bool = False, *, of: Optional[str] = None,
           wrt: Optional[Union[str, Sequence[str]]] = None) -> Callable[..., Any]:
    """``jax.jacrev`` of a function returning one array, scaled and checked as :func:`grad`.

    The seed of every row is the scale of the key; the Jacobian (``out.shape + arg.shape``) is
    checked row by row against ``fun``'s value and unscaled in float32.

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
    return _reverse(jax.jacrev, "jaxamp.jacrev", fun, argnums, has_aux, of, wrt, holomorphic=holomorphic,
                    allow_int=allow_int)
