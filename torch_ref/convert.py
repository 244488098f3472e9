"""Weight transfer between jaxamp's Flax ``FullyConnected`` params and torch_ref's state_dict.

Flax (``params["params"]``)                     torch_ref / Modulus state_dict
``layers_{i}/kernel``   ``[in, out]``    <->    ``layers.{i}.linear.weight``   ``[out, in]`` (transpose)
``layers_{i}/weight_g`` ``[out]``        <->    ``layers.{i}.linear.weight_g`` ``[out, 1]``
``layers_{i}/bias``     ``[out]``        <->    ``layers.{i}.linear.bias``     ``[out]``
``final_layer/kernel``, ``/bias``        <->    ``final_layer.linear.weight``, ``.bias``

Values are copied bit for bit (float32) both ways, so a round trip is exact. Only numpy is
needed on the Flax side: the Flax tree comes back as nested dicts of ``numpy`` arrays
(``jax.numpy.asarray`` them, or pass them straight to ``model.apply``).

Scaler states (``{key: state}``, e.g. a jaxamp ``TrainState.deriv_scales``) go across with
:func:`scale_states_from_jax` and :func:`scale_states_to_jax`, also bit for bit, so a scaler
saved by one framework continues in the other exactly as it would have at home.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Union

import numpy as np
import torch

from torch_ref.scaler import ScaleState

_FLAX_LAYER = re.compile(r"^(layers_(\d+)|final_layer)$")
_TORCH_KEY = re.compile(r"^(layers\.(\d+)|final_layer)\.linear\.(weight|weight_g|bias)$")


def flax_to_torch(params: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """Flax params (``{"params": {...}}`` or the inner dict) -> a torch_ref state_dict."""
    if "params" in params and len(params) == 1:
        params = params["params"]
    out: Dict[str, torch.Tensor] = {}
    for layer, leaves in params.items():
        m = _FLAX_LAYER.match(layer)
        if not m:
            raise KeyError(f"flax_to_torch: unknown Flax module {layer!r}; expected 'layers_<i>' or 'final_layer'.")
        prefix = f"layers.{m.group(2)}.linear" if m.group(2) is not None else "final_layer.linear"
        for name, value in leaves.items():
            arr = np.array(value, dtype=np.float32, copy=True)
            if name == "kernel":
                out[f"{prefix}.weight"] = torch.from_numpy(np.ascontiguousarray(arr.T))
            elif name == "weight_g":
                out[f"{prefix}.weight_g"] = torch.from_numpy(arr.reshape(-1, 1))
            elif name == "bias":
                out[f"{prefix}.bias"] = torch.from_numpy(arr)
            else:
                raise KeyError(f"flax_to_torch: unknown parameter {layer}/{name}; expected kernel, weight_g, bias.")
    return out


def torch_to_flax(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, Dict[str, Dict[str, np.ndarray]]]:
    """A torch_ref (Modulus-named) state_dict -> ``{"params": {...}}`` of float32 numpy arrays."""
    inner: Dict[str, Dict[str, np.ndarray]] = {}
    for key, value in state_dict.items():
        m = _TORCH_KEY.match(key)
        if not m:
            raise KeyError(
                f"torch_to_flax: unknown state_dict key {key!r}; expected "
                "'layers.<i>.linear.{weight,weight_g,bias}' or 'final_layer.linear.{weight,bias}'."
            )
        layer = f"layers_{m.group(2)}" if m.group(2) is not None else "final_layer"
        arr = value.detach().cpu().to(torch.float32).numpy().copy()
        if m.group(3) == "weight":
            inner.setdefault(layer, {})["kernel"] = np.ascontiguousarray(arr.T)
        elif m.group(3) == "weight_g":
            inner.setdefault(layer, {})["weight_g"] = arr.reshape(-1)
        else:
            inner.setdefault(layer, {})["bias"] = arr
    return {"params": inner}


def _scale_fields(key: str, state: Any) -> Mapping[str, Any]:
    if isinstance(state, ScaleState):
        return {"scale": state.scale, "growth_tracker": state.growth_tracker}
    if isinstance(state, Mapping):
        return state
    # jaxamp._src.scaling.scaler.ScaleState (a NamedTuple)
    if hasattr(state, "scale") and hasattr(state, "growth_tracker"):
        return {"scale": state.scale, "growth_tracker": state.growth_tracker}
    raise TypeError(
        f"scaler state {key!r}={state!r} must be a ScaleState (jaxamp or torch_ref) or a mapping "
        "with 'scale' and 'growth_tracker'."
    )


def scale_states_from_jax(
    states: Mapping[str, Any], device: Union[str, torch.device, None] = None
) -> Dict[str, ScaleState]:
    """``{key: jaxamp._src.scaling.scaler.ScaleState or {"scale", "growth_tracker"}}`` ->
    ``{key: torch_ref.ScaleState}``.

    Accepts jax, numpy or torch scalars (e.g. ``TrainState.deriv_scales`` restored by
    ``jaxamp.Checkpointer``); float32 scale and int32 tracker are kept exactly.
    """
    if not isinstance(states, Mapping):
        raise TypeError(f"scale_states_from_jax: `states`={states!r} must be a mapping {{key: state}}.")
    return {str(k): ScaleState.from_state_dict(_scale_fields(k, v), device) for k, v in states.items()}


def scale_states_to_jax(states: Mapping[str, Any]) -> Dict[str, Dict[str, np.ndarray]]:
    """``{key: torch_ref.ScaleState or its state_dict}`` -> ``{key: {"scale": f32[], "growth_tracker": i32[]}}``.

    numpy 0-d arrays (torch_ref never imports jax): build jaxamp states with
    ``{k: jaxamp._src.scaling.scaler.ScaleState(**v) for k, v in out.items()}``.
    """
    if not isinstance(states, Mapping):
        raise TypeError(f"scale_states_to_jax: `states`={states!r} must be a mapping {{key: state}}.")
    out = {}
    for k, v in states.items():
        st = ScaleState.from_state_dict(_scale_fields(k, v))
        out[str(k)] = {"scale": np.asarray(st.scale.numpy(), np.float32).reshape(()),
                       "growth_tracker": np.asarray(st.growth_tracker.numpy(), np.int32).reshape(())}
    return out
