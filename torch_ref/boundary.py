"""The network boundary in torch: every derivative of a float16 module is scaled, whoever takes it.

The mirror of ``jaxamp``'s ``boundary_p`` (``jaxamp/_src/core/boundary.py``) for a
torch user who writes the derivatives as Modulus does::

    scaling = Scaling({"1": s1, "2": s2})          # this step's scales in, its flags out
    u = net(x, scaling)                            # net = Boundary(fp16_module)
    (u_x,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
    (u_xx,) = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)
    scaling.found_inf                              # {"1": bool, "2": bool, "nonfinite_values": bool}

``u_x`` and ``u_xx`` are the module's derivatives (unscaled, float32); inside the float16 region
every order-``k`` value was held scaled by ``s_k``. The rule, one ``torch.autograd.Function``
per order (:class:`_Crossing`), each one's ``backward`` the next order's crossing:

* The crossing of order ``k`` holds ``Q_k``, the module's order-``k`` derivative program as the
  float16 region computes it (``Q_0``: the module), and returns ``Q_k / s_k`` in float32.
* Its backward takes a cotangent ``w`` of that output. Along the inputs (every operand that is
  not a parameter) it is the order-``k+1`` crossing: ``w`` enters the float16 region multiplied
  by ``c = s_(k+1) / s_k`` (``s_0 = 1``), so the order-``k+1`` values there carry ``s_(k+1)``;
  the input cotangents leaving are checked under key ``str(k+1)`` (an overflow where the values
  below, the crossing's non-parameter operands, are finite and a cotangent is not; a non-finite
  value below a first derivative flags :data:`NONFINITE_VALUES`), then unscaled by
  ``1/s_(k+1)`` in float32. Along the parameters (weight gradients: the loss scaler's) the
  cotangent passes unscaled and unchecked, as plain differentiable torch operations.
* Only the operands the running ``autograd.grad`` / ``backward`` reaches are differentiated
  (``torch._C._will_engine_execute_node``, which torch's own ``register_multi_grad_hook``
  uses): ``torch.autograd.grad(loss, params)`` through ``u_xx`` takes no order-3 derivative and
  checks nothing, as ``jax.grad`` of the loss with respect to the parameters does not.

The order is read from the crossing a cotangent reaches (its ``level``), never from the call:
``torch.autograd.grad`` called once or three times, on ``u`` or on a column of ``u_x``, gives the
same keys as ``jax.grad`` / ``jax.hessian`` through ``jaxamp.autocast``. Keys are per order only
(``"1"``, ``"2"``, ...), as jaxamp's boundary writes them.

``loss.backward()`` with ``x.requires_grad`` also differentiates the loss with respect to ``x``:
an order-``K+1`` derivative, which is scaled and checked under its own key (a
:class:`Scaling` without that key raises, naming the fix). Take the weight gradients with
``torch.autograd.grad(loss, params)`` (as :func:`torch_ref.make_train_step` does).

The batch is one tensor ``x: [N, ...]``; a crossing's check covers all of it (jaxamp's
transpose rule on an unbatched equation does the same: one flag per crossing).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call

from torch_ref.derivatives import NONFINITE_VALUES

__all__ = ["Boundary", "Scaling", "NONFINITE_VALUES"]

Program = Callable[..., Tuple[torch.Tensor, ...]]


class Scaling:
    """One step's derivative scales (in) and overflow flags (out) for :class:`Boundary`.

    ``Scaling(scales)``: ``scales`` maps a key ``"k"`` to the scale ``s_k`` (a float or 0-d
    tensor, a power of two, as a :class:`~torch_ref.DynamicScaler` keeps it). A derivative of an
    order whose key is missing raises ``KeyError`` naming it. ``Scaling.ones()`` takes any
    order at scale 1 (to find a loss's keys: ``sorted(scaling.keys)`` after one evaluation).

    ``found_inf``: ``{key: bool 0-d tensor}`` for every key a derivative crossed the boundary
    under, plus :data:`NONFINITE_VALUES`; filled while the derivatives are taken (the backward
    passes of ``torch.autograd.grad``), so read it after them.
    """

    def __init__(self, scales: Optional[Mapping[str, Any]]) -> None:
        if scales is not None and not isinstance(scales, Mapping):
            raise TypeError(f"Scaling: `scales`={scales!r} must be a mapping {{key: scale}}, e.g. "
                            "TrainState.scales, or None (Scaling.ones()).")
        self._any = scales is None
        self.scales: Dict[str, torch.Tensor] = {
            str(k): torch.as_tensor(v, dtype=torch.float32).detach().reshape(()) for k, v in (scales or {}).items()
        }
        self.found_inf: Dict[str, torch.Tensor] = {}

    @classmethod
    def ones(cls) -> "Scaling":
        """Every order at scale 1: the derivatives as plain float16 takes them, their keys recorded."""
        return cls(None)

    @property
    def keys(self) -> Tuple[str, ...]:
        """The scaler keys derivatives crossed the boundary under, by order."""
        return tuple(sorted((k for k in self.found_inf if k != NONFINITE_VALUES), key=int))

    def scale(self, order: int) -> torch.Tensor:
        """``s_order`` (f32 0-d; ``s_0 = 1``)."""
        key = str(order)
        if order == 0 or self._any:
            return torch.tensor(1.0)
        if key not in self.scales:
            raise KeyError(
                f"Boundary: a derivative of order {order} crossed the network boundary but `scales` has no key "
                f"{key!r} (keys {sorted(self.scales)}). Give it a scaler (TrainState.create(keys=...)); if the "
                "loss takes no such derivative, the step differentiated the inputs too: loss.backward() with "
                "x.requires_grad does, so take the weight gradients with torch.autograd.grad(loss, params) "
                "(as torch_ref.make_train_step does).")
        return self.scales[key]

    def flag(self, key: str, hit: torch.Tensor) -> None:
        """``found_inf[key] |= hit``."""
        hit = hit.detach().reshape(()).to(torch.bool)
        self.found_inf[key] = hit if key not in self.found_inf else self.found_inf[key] | hit


@dataclasses.dataclass(eq=False)
class _Spec:
    """One crossing: its program ``Q_level`` (scaled as the float16 region holds it), which of
    its operands are parameters, the scales, and the operands below it (for its check)."""

    program: Program
    level: int
    is_param: Tuple[bool, ...]
    scaling: Scaling
    below: Tuple[int, ...] = ()  # operand positions whose finiteness the check requires (level > 0)

    def derivative(self, wrt: Sequence[int], n_cts: int) -> "_Spec":
        """The crossing of order ``level + 1``: ``Q_level``'s input cotangents along ``wrt``, its
        operands this one's and the ``n_cts`` cotangents (entering scaled by ``s_(k+1)/s_k``)."""
        program, n, order, scaling = self.program, len(self.is_param), self.level + 1, self.scaling
        wrt = tuple(wrt)

        def next_program(*args: torch.Tensor) -> Tuple[torch.Tensor, ...]:
            ops, cts = args[:n], args[n:]
            c = scaling.scale(order) / scaling.scale(order - 1)
            return _vjp(program, ops, wrt, [w * c for w in cts])

        below = tuple(i for i, p in enumerate(self.is_param) if not p)
        return _Spec(next_program, order, (*self.is_param, *(False,) * n_cts), scaling, below)


def _vjp(program: Program, ops: Sequence[torch.Tensor], wrt: Sequence[int],
         cts: Sequence[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, ...]:
    """``program``'s cotangents along ``ops[wrt]`` for the output cotangents ``cts``; itself
    differentiable where grad mode is on (a higher crossing differentiates it)."""
    create = torch.is_grad_enabled()
    ins = list(ops)
    for i in range(len(ins)):
        if i in wrt and not (create and ins[i].requires_grad):
            ins[i] = ins[i].detach().requires_grad_(True)
        elif i not in wrt and not create:
            ins[i] = ins[i].detach()
    with torch.enable_grad():
        outs = program(*ins)
    pairs = [(o, ct) for o, ct in zip(outs, cts) if ct is not None and o.requires_grad]
    targets = [ins[i] for i in wrt]
    if not pairs:
        return tuple(torch.zeros_like(t) for t in targets)
    grads = torch.autograd.grad([o for o, _ in pairs], targets, [ct for _, ct in pairs], allow_unused=True,
                                create_graph=create)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, targets))


def _reached(t: torch.Tensor) -> bool:
    """Whether the running backward pass needs the gradient of operand ``t`` (never a leaf:
    :func:`_edge`)."""
    return t.requires_grad and bool(torch._C._will_engine_execute_node(get_gradient_edge(t).node))


def _edge(t: torch.Tensor) -> torch.Tensor:
    """``t``, with a node of its own when it is a leaf that requires grad (the engine answers
    :func:`_reached` for nodes, not for leaves under ``autograd.grad``)."""
    return t.view_as(t) if t.requires_grad and t.grad_fn is None else t


def _finite(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    ok = torch.tensor(True)
    for t in ts:
        if t.is_floating_point():
            ok = ok & torch.isfinite(t.detach()).all()
    return ok


class _Crossing(torch.autograd.Function):
    """``Q_level(*operands) / s_level``, checked under key ``str(level)``; backward: the next order."""

    @staticmethod
    def forward(ctx, spec: _Spec, *operands: torch.Tensor):
        ctx.spec = spec
        ctx.save_for_backward(*operands)
        outs = spec.program(*operands)
        if spec.level > 0:  # the scaled derivative leaving the float16 region: checked, then unscaled in float32
            key, below = str(spec.level), _finite([operands[i] for i in spec.below])
            hit = torch.tensor(False)
            for g in outs:
                hit = hit | ~torch.isfinite(g).all()
            spec.scaling.flag(key, below & hit)
            if spec.level == 1:  # a non-finite input is a bad value, no overflow
                spec.scaling.flag(NONFINITE_VALUES, ~below)
            inv = 1.0 / spec.scaling.scale(spec.level)
            outs = tuple(g * inv for g in outs)
        ctx.shapes = [(o.shape, o.dtype) for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *cts: Optional[torch.Tensor]):
        spec: _Spec = ctx.spec
        ops = ctx.saved_tensors
        wanted = [i for i, t in enumerate(ops) if ctx.needs_input_grad[1 + i] and _reached(t)]
        inputs = [i for i in wanted if not spec.is_param[i]]
        params = [i for i in wanted if spec.is_param[i]]
        cts = [torch.zeros(s, dtype=d) if ct is None else ct for ct, (s, d) in zip(cts, ctx.shapes)]
        grads: List[Optional[torch.Tensor]] = [None] * len(ops)
        if inputs:  # input derivatives: the next order's crossing
            child = spec.derivative(inputs, len(cts))
            outs = _Crossing.apply(child, *(_edge(t) for t in (*ops, *cts)))
            for i, g in zip(inputs, outs):
                grads[i] = g
        if params:  # weight gradients: unscaled (the loss scaler's), plain differentiable operations
            inv = 1.0 / spec.scaling.scale(spec.level)
            for i, g in zip(params, _vjp(spec.program, ops, params, [ct * inv for ct in cts])):
                grads[i] = g
        return (None, *grads)


class Boundary(torch.nn.Module):
    """``module`` (a float16 network: float32 in and out, its parameters float32) as the boundary
    of the float16 region: ``Boundary(module)(x, scaling)`` is ``module(x)``, and every input
    derivative of it taken with ``torch.autograd.grad`` is scaled under ``scaling``'s keys per
    order (module docstring). ``scaling=None``: ``module(x)`` as it is (unscaled, unchecked).

    Its parameters are ``module``'s (``boundary.parameters()`` trains them)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Boundary: `module`={module!r} must be a torch.nn.Module (the float16 network).")
        self.module = module

    def forward(self, *inputs: torch.Tensor, scaling: Optional[Scaling] = None):
        if scaling is None:
            return self.module(*inputs)
        if not isinstance(scaling, Scaling):
            raise TypeError(f"Boundary: `scaling`={scaling!r} must be a torch_ref.Scaling (the step's scales) or None.")
        bad = [i for i, x in enumerate(inputs) if not (isinstance(x, torch.Tensor) and x.is_floating_point())]
        if bad:
            raise TypeError(f"Boundary: inputs at positions {bad} must be floating-point tensors; got "
                            f"{[type(inputs[i]).__name__ for i in bad]}.")
        names = [n for n, _ in self.module.named_parameters()]
        params = [p for _, p in self.module.named_parameters()]
        n_in, module, single = len(inputs), self.module, {}

        def network(*ops: torch.Tensor) -> Tuple[torch.Tensor, ...]:
            out = functional_call(module, dict(zip(names, ops[n_in:])), tuple(ops[:n_in]))
            single["tensor"] = isinstance(out, torch.Tensor)
            return (out,) if single["tensor"] else tuple(out)

        spec = _Spec(network, 0, (False,) * n_in + (True,) * len(params), scaling)
        outs = _Crossing.apply(spec, *(_edge(t) for t in (*inputs, *params)))
        return outs[0] if single["tensor"] else outs
