"""Which float16 derivatives in a traced program no scaler guards, for :func:`jaxamp.init`'s warning.

A derivative JAX takes (``jax.grad``, ``jax.hessian``, ``jax.jvp``, ...) leaves its equations
under a ``jvp`` / ``transpose`` transform in their name stack. One that computes in float16 outside
the network boundary (:mod:`jaxamp._src.core.boundary`, whose rules scale what crosses it) is
scaled only if it descends from a scale mark (``deriv_scale_p``: the seeds of ``jaxamp.grad``,
its siblings and the engine). What is left is unscaled:

* **reverse mode** (``jax.grad``, ``jax.jacrev``, ``jax.hessian``): a float16 equation under a
  ``transpose`` (always a cotangent) with no scale mark among its ancestors;
* **forward mode** (``jax.jvp``, ``jax.jacfwd``): the float16 equations under one ``jvp`` name
  stack with no ``transpose`` of it in the program (else they are the primal pass of a reverse
  derivative, judged by its transpose), none of them descending from a scale mark.

A derivative's order is the number of ``jvp`` transforms in its name stack. Typical sources: a
network cast to float16 by hand (``x.astype(jnp.float16)``, a Flax layer's ``dtype=jnp.float16``)
instead of :func:`jaxamp.autocast`; an ``autocast`` network differentiated along an array it
holds as a parameter (captured by a closure, or named in ``params_argnums``); ``jax.grad`` through
an ``autocast`` network under per-term keys (``mode="per_term_scaler"``, ``special_terms``), which
only ``jaxamp.grad(..., of=, wrt=)`` can name.

What it cannot see: a derivative computed outside the traced function (a precomputed
derivative passed in as data), one whose float16 work sits inside a ``custom_jvp`` /
``custom_vjp`` rule JAX has not yet applied when the loss is traced (the rule's body runs only
under an outer transformation), and a float16 derivative whose inputs descend from a scale mark
only through an unscaled value (a hand-cast network fed by a boundary's derivative output): a
scale mark among the ancestors counts as scaled.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxamp._src.core import boundary as boundary_module
from jaxamp._src.core.boundary import boundary_p
from jaxamp._src.core.interpreter import sub_jaxprs
from jaxamp._src.core.marks import deriv_scale_p
from jaxamp._src.core.rules import passes

__all__ = ["Unscaled", "unscaled_derivatives"]

_F16 = jnp.dtype("float16")


@dataclasses.dataclass(frozen=True)
class Unscaled:
    """One unscaled float16 derivative: its ``order``, ``mode`` ("reverse" / "forward") and
    ``where``: the innermost user code it differentiates, ``function (file:line)`` (outside
    JAX, jaxamp and installed packages)."""

    order: int
    mode: str
    where: str

    def describe(self) -> str:
        return f"an order-{self.order} derivative ({self.mode} mode) of {self.where}"


@dataclasses.dataclass(frozen=True)
class _Eqn:
    order: int  # jvp transforms in its name stack
    reverse: bool  # a transpose among them: a cotangent
    where: Tuple[str, str, int]  # (function, file, line) of the innermost user frame
    scaled: bool  # descends from a scale mark


def unscaled_derivatives(closed: jcore.ClosedJaxpr) -> List[Unscaled]:
    """The unscaled float16 derivatives of a traced program, once per order, mode and user
    function (module docstring)."""
    found: List[_Eqn] = []
    _walk(closed.jaxpr, [_INPUT] * len(closed.jaxpr.invars), (), found)
    groups: Dict[Tuple[int, bool, str, str], List[_Eqn]] = {}
    for e in found:
        groups.setdefault((e.order, e.reverse, *e.where[:2]), []).append(e)
    out = []
    for (order, reverse, fn, file), eqns in sorted(groups.items()):
        if any(e.scaled for e in eqns) or not reverse and (order, True, fn, file) in groups:
            continue  # scaled; or the primal pass of a reverse derivative, judged by its transpose
        line = min(e.where[2] for e in eqns)
        out.append(Unscaled(order, "reverse" if reverse else "forward", f"{fn} ({file}:{line})"))
    return out


_BOUNDARY = os.path.abspath(boundary_module.__file__)
_COVERED = frozenset((boundary_p, *(p for p, _ in passes())))
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (os, jax)) + (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,)  # stdlib, jax, jaxamp


def _user_frame(eqn: jcore.JaxprEqn) -> Tuple[str, str, int]:
    """``(function, file, line)`` of the innermost frame that wrote ``eqn`` outside the Python
    library, JAX, jaxamp and installed packages."""
    frames = list(eqn.source_info.traceback.frames) if eqn.source_info.traceback is not None else []
    for fr in frames:
        name = fr.file_name
        if not (name.startswith(_LIBRARIES) or f"{os.sep}site-packages{os.sep}" in name
                or f"{os.sep}dist-packages{os.sep}" in name or name.startswith("<")):
            return fr.function_name, name, fr.line_num
    return "an unnamed function", "?", 0


def _internal_jvps(eqn: jcore.JaxprEqn) -> int:
    """1 when ``eqn`` was written inside the boundary's JVP rule, whose derivative of the body along
    parameters is a ``jax.jvp`` of its own (one ``jvp`` in the name stack that is not the user's)."""
    frames = eqn.source_info.traceback.frames if eqn.source_info.traceback is not None else []
    return int(any(fr.function_name == "_jvp" and fr.file_name == _BOUNDARY for fr in frames))


# What a value descends from: a jaxpr input (a primal), a constant made inside the program (JAX's
# seeds: a tangent 1.0, a basis vector), a scale mark (jaxamp's seeds).
_INPUT, _SEED, _SCALE = 1, 2, 4


def _walk(jaxpr: jcore.Jaxpr, kinds_in: Sequence[int], stack: Tuple[str, ...], found: List[_Eqn]) -> List[int]:
    """Records the float16 equations of ``jaxpr`` and its bodies (boundary and chain bodies left
    out) written under a ``jvp`` transform (``stack``: the transforms of the equation holding
    ``jaxpr``); returns what each output descends from (``_INPUT | _SEED | _SCALE``), given the inputs'."""
    kinds: Dict[jcore.Var, int] = {v: _INPUT for v in jaxpr.constvars}
    kinds.update(zip(jaxpr.invars, kinds_in))
    read = lambda v: kinds.get(v, 0) if isinstance(v, jcore.Var) else 0  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        joined = 0
        for k in ins:
            joined |= k
        here = stack + tuple(s.name for s in eqn.source_info.name_stack.stack if type(s).__name__ == "Transform")
        out = joined | (_SCALE if eqn.primitive is deriv_scale_p else 0) | (0 if joined & _INPUT else _SEED)
        outs = [out] * len(eqn.outvars)
        # a boundary's rules scale what crosses it; jaxamp's derivative calls (chains) scale their own
        subs = [] if eqn.primitive in _COVERED else sub_jaxprs(eqn)
        for sub in subs:
            inner = ins if len(sub.invars) == len(ins) else [joined] * len(sub.invars)
            sub_out = _walk(sub, inner, here, found)
            if len(sub_out) == len(outs):
                outs = [a | b for a, b in zip(outs, sub_out)]
            else:  # outputs not one to one (a loop's): each takes what any does
                extra = 0
                for b in sub_out:
                    extra |= b
                outs = [o | extra for o in outs]
        derivative = "transpose" in here or joined & (_SEED | _SCALE)  # forward: a tangent, not a primal
        if ("jvp" in here and derivative and not subs and eqn.primitive not in _COVERED
                and any(isinstance(v, jcore.Var) for v in eqn.invars)
                and any(getattr(v.aval, "dtype", None) == _F16 for v in eqn.outvars)):
            order = here.count("jvp") - _internal_jvps(eqn)
            found.append(_Eqn(order, "transpose" in here, _user_frame(eqn), bool(joined & _SCALE)))
        for v, k in zip(eqn.outvars, outs):
            kinds[v] = k
    return [read(v) for v in jaxpr.outvars]
