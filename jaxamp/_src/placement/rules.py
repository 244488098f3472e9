"""The per-primitive rule of :func:`jaxamp.autocast`, for :func:`jaxamp._src.core.interpreter.eval_jaxpr`:
:class:`Placement` decides each equation from its primitive and its operands' :class:`Val` flags.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.core.interpreter import bind, custom_body, eval_jaxpr, sub_jaxpr
from jaxamp._src.core.rules import rules_of
from jaxamp._src.placement.tensor_scale import scaled_dot
from jaxamp._src.placement.recompute import WEIGHT_CAST

__all__ = ["COMPUTE_PRIMITIVES", "ACTIVATION_PRIMITIVES", "BODY_PRIMITIVES", "Val", "merge", "primitive_counts",
           "Placement"]

COMPUTE_PRIMITIVES = frozenset((jp.dot_general_p, jp.conv_general_dilated_p))
ACTIVATION_PRIMITIVES = frozenset((
    jp.tanh_p, jp.logistic_p, jp.sin_p, jp.cos_p, jp.tan_p, jp.asin_p, jp.acos_p, jp.atan_p, jp.atan2_p,
    jp.sinh_p, jp.cosh_p, jp.asinh_p, jp.acosh_p, jp.atanh_p, jp.exp_p, jp.exp2_p, jp.expm1_p, jp.log_p,
    jp.log1p_p, jp.erf_p, jp.erfc_p, jp.erf_inv_p,
))
# Bodies rewritten in place (same structure, same avals): checkpoint and control flow.
BODY_PRIMITIVES = frozenset((jp.remat_p, jp.cond_p, jp.scan_p, jp.while_p))


class Val(NamedTuple):
    """A value of the rewritten program and what it depends on."""

    x: Any  # the array (or tracer), in the dtype the original program gave it
    inputs: bool = False  # depends on a non-parameter argument
    params: bool = False  # depends on a parameter argument
    deep: bool = False  # downstream of a layer fed by the inputs: later layers are not the first
    low: bool = False  # downstream of an operation that ran in the compute dtype


_FLAGS = ("inputs", "params", "deep", "low")


def merge(vals: Sequence[Val]) -> Val:
    """The dependencies of a result of ``vals`` (any operand's), with no array."""
    return Val(None, *(any(getattr(v, f) for v in vals) for f in _FLAGS))


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def primitive_counts(jaxpr: jcore.Jaxpr) -> collections.Counter:
    """How many times each primitive occurs in ``jaxpr`` and all its sub-jaxprs."""
    found = collections.Counter(eqn.primitive for eqn in jaxpr.eqns)
    for sub in jcore.subjaxprs(jaxpr):
        found.update(primitive_counts(sub))
    return found


class Placement:
    """The rule for ``amp``; ``counts`` records the matmul/convolution decisions (for errors)."""

    def __init__(self, amp: AmpConfig):
        self.dtype = amp.compute_dtype
        self.firstlayer = amp.autocast_firstlayer
        self.activation = amp.autocast_activation
        # per-tensor scales and/or FP8 operands for matmuls (jaxamp/_src/placement/tensor_scale.py); None: plain casts
        self.formats, self.tensor_scaling = amp.matmul_formats, amp.tensor_scaling
        self.recomputes = amp.recomputes  # parameters' casts named: the backward pass keeps them
        self.counts: Dict[str, int] = collections.Counter()

    def _evaluate(self, jaxpr: jcore.Jaxpr, consts: List[Val], invals: List[Val]) -> List[Val]:
        """``jaxpr`` through this rule."""
        return eval_jaxpr(jaxpr, consts, invals, self, literal=Val)

    def __call__(self, eqn: jcore.JaxprEqn, invals: List[Val]) -> List[Val]:
        prim = eqn.primitive
        custom = rules_of(prim).custom is not None  # a custom-derivative function
        body = sub_jaxpr(eqn)
        if body is None and custom and self._move_inside(eqn, invals):
            body = custom_body(eqn)
        if body is not None:  # inline: the body's equations get their own decisions
            return self._evaluate(body.jaxpr, [Val(c) for c in body.consts], invals)
        if prim in BODY_PRIMITIVES:
            outs = self._rewrite_bodies(eqn, invals)
            if outs is not None:
                return outs
        flags = merge(invals)
        xs = [v.x for v in invals]
        floating = bool(eqn.outvars) and _floating(eqn.outvars[0].aval.dtype)
        if prim in COMPUTE_PRIMITIVES and floating:
            if not flags.params:
                why = "without a parameter"
            elif flags.inputs and not flags.deep and not self.firstlayer:
                why, flags = "first layer", flags._replace(deep=True)
            else:
                why = "compute dtype"
                flags = flags._replace(deep=flags.deep or flags.inputs, low=True)
            self.counts[why] += 1
            if why == "compute dtype":
                return self._lowered(eqn, invals, flags)
            outs = bind(eqn, xs)
        elif prim in ACTIVATION_PRIMITIVES and floating and self.activation and flags.low:
            return self._lowered(eqn, invals, flags)
        else:
            if not custom:  # custom calls were counted by _move_inside
                self._count_as_written(eqn)
            outs = bind(eqn, xs)
        return [flags._replace(x=o) for o in outs]

    def _lowered(self, eqn: jcore.JaxprEqn, invals: List[Val], flags: Val) -> List[Val]:
        """``eqn`` in the compute dtype: floating operands cast at use, results cast back (a
        matmul with per-tensor scaling: :func:`jaxamp._src.placement.tensor_scale.scaled_dot`; an operand that
        is a result cast back is handed over narrow when the program runs,
        :func:`jaxamp._src.placement.held.evaluate_held`)."""
        xs = [v.x for v in invals]
        if self.formats and eqn.primitive is jp.dot_general_p and all(_floating(jnp.result_type(x)) for x in xs):
            out = scaled_dot(*xs, eqn.params["dimension_numbers"], self.formats, scaling=self.tensor_scaling)
            return [flags._replace(x=jax.lax.convert_element_type(out, eqn.outvars[0].aval.dtype))]
        xs = [jax.lax.convert_element_type(x, self.dtype) if _floating(jnp.result_type(x)) else x for x in xs]
        if self.recomputes:  # a parameter's cast is saved, not recomputed (jaxamp/_src/placement/recompute.py)
            xs = [checkpoint_name(x, WEIGHT_CAST) if v.params and not v.inputs and _floating(jnp.result_type(x)) else x
                  for x, v in zip(xs, invals)]
        if eqn.params.get("preferred_element_type") is not None:
            eqn = eqn.replace(params={**eqn.params, "preferred_element_type": self.dtype})
        outs = bind(eqn, xs)
        return [flags._replace(x=jax.lax.convert_element_type(o, v.aval.dtype)) for o, v in zip(outs, eqn.outvars)]

    def _count_as_written(self, eqn: jcore.JaxprEqn) -> None:
        """Count the matmuls inside a body left as written."""
        found = sum(primitive_counts(sub)[p] for sub in jcore.jaxprs_in_params(eqn.params) for p in COMPUTE_PRIMITIVES)
        if found:
            self.counts[f"inside {eqn.primitive.name} (left as written)"] += found

    def _move_inside(self, eqn: jcore.JaxprEqn, invals: List[Val]) -> bool:
        """Whether a custom_jvp/custom_vjp body holds something to rewrite (then it is inlined)."""
        inside = primitive_counts(eqn.params["call_jaxpr"].jaxpr)
        if any(inside[p] for p in COMPUTE_PRIMITIVES):
            return True
        if self.activation and merge(invals).low and any(inside[p] for p in ACTIVATION_PRIMITIVES):
            return True
        self._count_as_written(eqn)
        return False

    def placed(self, closed: jcore.ClosedJaxpr, flags: Sequence[Val],
               const: Val = Val(None)) -> Tuple[jcore.ClosedJaxpr, List[Val]]:
        """``closed`` rewritten for operands with ``flags`` and constants with ``const``'s: same
        avals, and its outputs' flags."""
        out_flags: List[Val] = []

        def run(*xs):
            vals = [f._replace(x=x) for f, x in zip(flags, xs)]
            outs = self._evaluate(closed.jaxpr, [const._replace(x=c) for c in closed.consts], vals)
            out_flags[:] = [o._replace(x=None) for o in outs]
            return [o.x for o in outs]

        specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
                 for v in closed.jaxpr.invars]
        return jax.make_jaxpr(run)(*specs), out_flags

    def _loop(self, closed: jcore.ClosedJaxpr, flags: List[Val], lo: int, hi: int):
        """A loop body with carries ``flags[lo:hi]``: widen their flags until they are stable,
        then count the decisions of the final body only."""
        before = collections.Counter(self.counts)
        while True:
            self.counts = collections.Counter(before)
            body, out = self.placed(closed, flags)
            wider = flags[:lo] + [merge(pair) for pair in zip(flags[lo:hi], out)] + flags[hi:]
            if wider == flags:
                return body, out
            flags = wider

    def _rewrite_bodies(self, eqn: jcore.JaxprEqn, invals: List[Val]) -> Optional[List[Val]]:
        """Checkpoint/cond/scan/while with their bodies rewritten; None to bind as written."""
        params, prim = eqn.params, eqn.primitive
        flags = [v._replace(x=None) for v in invals]
        bodies = jcore.jaxprs_in_params(params)
        if any(not hasattr(v.aval, "shape") for b in bodies for v in b.invars):
            return None  # tokens or other non-array operands
        if prim is jp.remat_p:
            if params["jaxpr"].constvars:
                return None
            body, out = self.placed(jcore.ClosedJaxpr(params["jaxpr"], ()), flags)
            if body.consts:
                return None
            new: Dict[str, Any] = {"jaxpr": body.jaxpr}
        elif prim is jp.cond_p:
            placed = [self.placed(b, flags[1:]) for b in params["branches"]]
            new = {"branches": tuple(b for b, _ in placed)}
            out = [merge(fs) for fs in zip(*(o for _, o in placed))]
        elif prim is jp.scan_p:
            n, carry = params["num_consts"], params["num_carry"]
            body, out = self._loop(params["jaxpr"], flags, n, n + carry)
            new = {"jaxpr": body}
        else:  # while: the body takes its consts and the carry; the condition stays as written
            body_flags = flags[params["cond_nconsts"]:]
            body, out = self._loop(params["body_jaxpr"], body_flags, params["body_nconsts"], len(body_flags))
            new = {"body_jaxpr": body}
        outs = bind(eqn.replace(params={**params, **new}), [v.x for v in invals])
        return [f._replace(x=o) for f, o in zip(out, outs)]
