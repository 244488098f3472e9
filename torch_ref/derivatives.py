"""Scaled input derivatives in Modulus' idiom: ``torch.autograd.grad(..., create_graph=True)``.

Each differentiation follows docs/algorithm.md, "One derivative step" (the same four steps
as ``jaxamp.Derivatives``):

1. multiply the differentiated variable by its scaler's scale (fp32);
2. ``autograd.grad`` of it with respect to the inputs, ``create_graph=True``, through the
   network's mixed-precision graph;
3. check the *scaled* gradient: where everything below it (the inputs and every value on
   its path) is finite and it is not, an *overflow* flags the scaler's key; non-finite
   inputs or network outputs are *bad values*, flagged under :data:`NONFINITE_VALUES`
   (a deliberate difference from Modulus: docs/algorithm.md, "Differences from Modulus Sym");
4. multiply by ``1/scale`` in fp32 -- part of the graph, so higher orders and the weight
   gradients differentiate through it.

The network works on a batch ``[N, n_inputs]``; points are independent (no layer mixes
rows), so the gradient of the batch sum is every point's own gradient, as jaxamp's
per-point ``vmap`` gives.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from torch_ref.config import AmpSettings, as_settings
from torch_ref.scaler import DynamicScaler, ScaleState

SEP = "__"
# Reserved key of found_inf: non-finite inputs or network outputs at some point (no scale can cure them).
NONFINITE_VALUES = "nonfinite_values"
BatchFn = Callable[[torch.Tensor], torch.Tensor]  # f32[N, n_inputs] -> f32[N, n_outputs]


def parse_name(name: str) -> Tuple[str, Tuple[str, ...]]:
    """``"u__x__y"`` -> ``("u", ("x", "y"))``."""
    parts = name.split(SEP)
    return parts[0], tuple(parts[1:])


def order_of(name: str) -> int:
    return len(parse_name(name)[1])


def _check_names(arg: str, names: Sequence[str]) -> Tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"Derivatives: `{arg}`={names!r} must be a list of names (strings).")
    names = tuple(names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"Derivatives: `{arg}`={list(names)} must be non-empty without duplicates.")
    for n in names:
        if not n.isidentifier() or SEP in n:
            raise ValueError(f"Derivatives: {arg} name {n!r} must be an identifier without '{SEP}'.")
    return names


class Derivatives:
    """Named, scaled derivatives of a batched network ``fn(x: f32[N, n_in]) -> f32[N, n_out]``.

    Same arguments, names, scaler keys and results as ``jaxamp.Derivatives`` (except that
    ``fn`` takes the whole batch and holds its own parameters, as a torch module does).
    Call ``engine(points, scales)`` -> ``(values {name: f32[N]}, found_inf {key: bool 0-d})``.
    """

    def __init__(
        self,
        fn: BatchFn,
        *,
        inputs: Sequence[str],
        outputs: Sequence[str],
        derivatives: Sequence[str],
        amp: Union[AmpSettings, Mapping[str, Any], None] = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"Derivatives: `fn`={fn!r} must be callable as fn(x).")
        self.fn = fn
        self.inputs = _check_names("inputs", inputs)
        self.outputs = _check_names("outputs", outputs)
        if set(self.inputs) & set(self.outputs):
            raise ValueError(f"Derivatives: names {sorted(set(self.inputs) & set(self.outputs))} are both inputs "
                             "and outputs.")
        if isinstance(derivatives, str):
            raise TypeError(f"Derivatives: `derivatives`={derivatives!r} must be a list of names, not a string.")
        self.amp = as_settings(amp)
        self.scaled = self.amp.scaler_enabled
        self.requested = tuple(derivatives)
        needed = set()
        for name in self.requested:
            base, wrt = parse_name(name) if isinstance(name, str) else ("", ())
            if base not in self.outputs or any(v not in self.inputs for v in wrt):
                raise ValueError(
                    f"Derivatives: derivative {name!r} must be an output {list(self.outputs)} followed by "
                    f"'__'-separated inputs {list(self.inputs)}."
                )
            needed.update(SEP.join((base, *wrt[:k])) for k in range(1, len(wrt) + 1))
        max_order = max((order_of(n) for n in needed), default=0)
        # levels[k]: sorted names of order k+1, as jaxamp plans them
        self.levels: List[Tuple[str, ...]] = [
            tuple(sorted(n for n in needed if order_of(n) == k)) for k in range(1, max_order + 1)
        ]
        self.names = self.outputs + tuple(n for lv in self.levels for n in lv)
        keys = []
        for lv in self.levels:
            keys += [self.scaler_key(p) for p in sorted({n.rsplit(SEP, 1)[0] for n in lv})]
        self.scaler_keys: Tuple[str, ...] = tuple(dict.fromkeys(keys)) if self.scaled else ()

    def scaler_key(self, parent: str) -> str:
        """Key of the scaler guarding the differentiation of ``parent`` (as ``jaxamp.Derivatives.scaler_key``)."""
        if self.amp.mode == "per_term_scaler" or parent in self.amp.special_terms:
            return parent
        return str(order_of(parent) + 1)

    @property
    def scalers(self) -> Dict[str, DynamicScaler]:
        return {key: self.amp.derivative_scaler_for(key) for key in self.scaler_keys}

    def init_scaler_states(self, device: Union[str, torch.device, None] = None) -> Dict[str, ScaleState]:
        return {key: rule.init(device) for key, rule in self.scalers.items()}

    def _stack(self, points: Union[Mapping[str, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if isinstance(points, Mapping):
            missing = [n for n in self.inputs if n not in points]
            if missing:
                raise KeyError(f"Derivatives: `points` lacks input(s) {missing}; it has {sorted(points)}.")
            cols = [torch.as_tensor(points[n]) for n in self.inputs]
            if any(c.ndim != 1 or c.shape != cols[0].shape for c in cols):
                raise ValueError("Derivatives: every input must be 1-D of one length N; "
                                 f"got {[tuple(c.shape) for c in cols]}.")
            x = torch.stack(cols, dim=-1)
        else:
            x = torch.as_tensor(points)
            if x.ndim != 2 or x.shape[-1] != len(self.inputs):
                raise ValueError(f"Derivatives: `points` has shape {tuple(x.shape)}; expected [N, {len(self.inputs)}].")
        if not x.is_floating_point():
            raise TypeError(f"Derivatives: `points` must be floating point, got dtype {x.dtype}.")
        return x.detach().to(torch.float32).requires_grad_(True)

    def __call__(
        self,
        points: Union[Mapping[str, torch.Tensor], torch.Tensor],
        scales: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """Values (unscaled, f32[N]) of every output and derivative, and the flags: per scaler key
        an overflow, plus :data:`NONFINITE_VALUES` for bad values ({} when unscaled)."""
        x = self._stack(points)
        if self.scaled:
            if scales is None or any(k not in scales for k in self.scaler_keys):
                raise KeyError(
                    f"Derivatives: `scales` must hold the scaler keys {list(self.scaler_keys)}; "
                    f"got {None if scales is None else sorted(scales)}."
                )
        y = self.fn(x)
        if y.ndim != 2 or y.shape != (x.shape[0], len(self.outputs)):
            raise ValueError(f"Derivatives: fn(x) returned shape {tuple(y.shape)}; "
                             f"expected [{x.shape[0]}, {len(self.outputs)}].")
        y = y.to(torch.float32)
        values: Dict[str, torch.Tensor] = {n: y[:, i] for i, n in enumerate(self.outputs)}
        flags: Dict[str, torch.Tensor] = {}
        inputs_ok = torch.isfinite(x.detach()).all(dim=-1)
        below_ok = {n: inputs_ok for n in self.outputs}  # per point: everything below the name is finite
        if self.scaled:
            flags[NONFINITE_VALUES] = (~inputs_ok | ~torch.isfinite(y.detach()).all(dim=-1)).any()
        for level in self.levels:
            for parent in sorted({n.rsplit(SEP, 1)[0] for n in level}):
                var = values[parent]
                if self.scaled:
                    key = self.scaler_key(parent)
                    scale = torch.as_tensor(scales[key], dtype=torch.float32, device=x.device)
                    var = var * scale  # step 1
                (grad,) = torch.autograd.grad(  # step 2
                    var, x, grad_outputs=torch.ones_like(var), create_graph=True, allow_unused=True
                )
                if grad is None:
                    grad = torch.zeros_like(x)
                for name in (n for n in level if n.rsplit(SEP, 1)[0] == parent):
                    col = grad[:, self.inputs.index(parse_name(name)[1][-1])]
                    below_ok[name] = below_ok[parent] & torch.isfinite(values[parent].detach())
                    if self.scaled:
                        hit = (below_ok[name] & ~torch.isfinite(col.detach())).any()  # step 3
                        flags[key] = hit if key not in flags else flags[key] | hit
                        col = col * (1.0 / scale)  # step 4 (f32, differentiable)
                    values[name] = col
        return values, flags


def merge_found_inf(*flags: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """OR together the found_inf dicts of several engines."""
    out: Dict[str, torch.Tensor] = {}
    for f in flags:
        for k, v in f.items():
            out[k] = v if k not in out else out[k] | v
    return out
