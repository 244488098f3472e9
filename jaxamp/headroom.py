"""Headroom per scaler key: how many powers of two each key's derivatives have left below 65504.

Under the DerivScaler a derivative guarded by scaler key ``k`` is computed in float16 as
``scale_k * value``. Its *headroom* is ``log2(65504) - log2(max |scale_k * value|)`` over
the batch and over every derivative under ``k``: 3 means the largest scaled derivative
could grow 8-fold before it overflowed; a negative value means it did overflow.

:func:`headroom_log2` computes it from the values an engine *already returned* (one
abs-max reduction per derivative, no extra pass through the network): a loss function
returns it as extra metrics, ``(loss, (terms, metrics))``, and
:func:`jaxamp.train.make_train_step` reports it as ``headroom_log2/<key>``. It covers the
derivative outputs (the last step of each derivative), not the hidden-layer tangents that
produce them; :func:`jaxamp.profile` covers those, at the cost of its own passes.
"""

from __future__ import annotations

from typing import Dict, Mapping

import jax
import jax.numpy as jnp

from jaxamp.derivatives.plan import mark_params
from jaxamp.marks import deriv_scale
from jaxamp.window import LOG2_FP16_MAX

PREFIX = "headroom_log2/"  # the metric name of a key's headroom: PREFIX + key


def headroom_log2(engine, values: Mapping[str, jax.Array]) -> Dict[str, jax.Array]:
    """``{key: f32[]}``: log2(65504) minus log2 of the largest scaled derivative under each key.

    The scales are those the program runs with: inside :func:`jaxamp.scaled`,
    :func:`jaxamp.value_and_grad` or :func:`jaxamp.train.make_train_step` the state's (each
    read by a mark of its key, as the engine's steps read them), outside them 1. They are
    powers of two, so ``value * scale`` is exactly the magnitude of the scaled float16 result
    the engine checked. It costs one reduction per derivative.

    Args:
      engine: the :class:`jaxamp.Derivatives` that computed ``values`` (its plan maps each
        derivative to the scaler key of its last step).
      values: ``{name: f32[N]}`` as the engine returned them (unscaled); every derivative the
        engine computes must be present (outputs are ignored).

    Returns:
      ``{key: f32[]}`` for every scaler key of the engine (``{}`` when the engine does not
      scale): ``+inf`` when every value under the key is 0, ``-inf`` when one overflowed
      (it is non-finite), NaN when one is NaN.

    Example (``u = w sin(x)`` with ``w = 2**10`` at ``x = 0``: ``u__x = 2**10``, ``u__x__x = 0``):
      >>> import jax.numpy as jnp, jaxamp, jaxamp.headroom
      >>> engine = jaxamp.Derivatives(lambda p, x: p * jnp.sin(x), inputs=("x",), outputs=("u",),
      ...                             derivatives=("u__x__x",), amp=jaxamp.AmpConfig(dtype="float16"))
      >>> def headroom(p, points):
      ...     return jaxamp.headroom.headroom_log2(engine, engine(p, points))
      >>> scales = {"1": jnp.float32(2.0), "2": jnp.float32(1.0)}
      >>> h, found_inf = jaxamp.scaled(headroom, engine.amp)(scales, jnp.float32(2.0**10), {"x": jnp.zeros(4)})
      >>> {k: round(float(v), 2) for k, v in h.items()}  # 2**5 to spare under key "1" at scale 2
      {'1': 5.0, '2': inf}

    In a loss function, return it as extra metrics: ``return loss, (terms,
    jaxamp.headroom.headroom_metrics(headroom))``.
    """
    plan = getattr(engine, "plan", None)
    if plan is None or not hasattr(engine, "scaler_keys"):
        raise TypeError(f"headroom_log2: `engine`={engine!r} is not allowed: expected a jaxamp.Derivatives.")
    if not isinstance(values, Mapping):
        raise TypeError(f"headroom_log2: `values` must be the engine's {{name: array}} dict, got {type(values).__name__}.")
    if not engine.scaler_keys:
        return {}
    missing = [n for n in plan.derivatives + plan.laplacians if n not in values]
    if missing:
        raise KeyError(f"headroom_log2: `values` lacks the derivative(s) {missing} of the engine; it has "
                       f"{sorted(values)}. Pass the values dict the engine returned.")
    peaks: Dict[str, list] = {k: [] for k in engine.scaler_keys}
    last_key = {n: plan.paths[n][-1][0] for n in plan.derivatives}
    last_key.update({n: keys[1] for n, keys in plan.laplacian_keys.items()})  # the summed second order
    for name, key in last_key.items():
        v = jnp.asarray(values[name], jnp.float32)
        peaks[key].append(jnp.max(jnp.abs(v)) if v.size else jnp.float32(0.0))
    out = {}
    for key, maxima in peaks.items():
        if not maxima:
            continue
        peak = jnp.max(jnp.stack(maxima))
        out[key] = jnp.float32(LOG2_FP16_MAX) - jnp.log2(peak * deriv_scale(peak, **mark_params(key)))
    return out


def headroom_metrics(*headrooms: Mapping[str, jax.Array]) -> Dict[str, jax.Array]:
    """``{"headroom_log2/<key>": f32[]}``: the smallest headroom per key over several
    :func:`headroom_log2` results (e.g. one per engine call: interior and boundary points),
    named as the extra metrics a loss function returns to :func:`jaxamp.train.make_train_step`.

    Args:
      *headrooms: ``{key: f32[]}`` dicts; keys may overlap (NaN wins: it stays visible).

    Returns:
      ``{"headroom_log2/" + key: f32[]}`` holding every key once.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp.headroom import headroom_metrics
      >>> headroom_metrics({"2": jnp.float32(3.0)}, {"2": jnp.float32(1.5), "1": jnp.float32(7.0)})
      {'headroom_log2/2': Array(1.5, dtype=float32), 'headroom_log2/1': Array(7., dtype=float32)}
    """
    out: Dict[str, jax.Array] = {}
    for i, h in enumerate(headrooms):
        if not isinstance(h, Mapping):
            raise TypeError(f"headroom_metrics: argument {i}={h!r} is not allowed: expected a {{key: f32[]}} dict "
                            "from headroom_log2.")
        for k, v in h.items():
            out[k] = v if k not in out else jnp.minimum(out[k], v)
    return {f"{PREFIX}{k}": v for k, v in out.items()}
