"""The lid-driven-cavity PINN train step used by the benchmarks, in every precision mode.

Problem (Modulus Sym's LDC example): steady 2D incompressible Navier-Stokes in the box
``[-0.05, 0.05]^2``, ``nu = 0.01``, ``rho = 1``; lid ``u = 1, v = 0`` at ``y = 0.05``;
no-slip elsewhere. A :class:`~jaxamp.models.FullyConnected` maps ``(x, y) -> (u, v, p)``;
the interior loss is the mean square of continuity and both momentum residuals, the
boundary losses the mean square of the velocity mismatch.

Modes (see :data:`MODES`): the same step, weights and points, in

- ``fp32_highest``: float32, traced under ``jax.default_matmul_precision("highest")``;
- ``fp32_default``: float32 with the backend's default matmul precision (TF32 on GPUs);
- ``bf16``: bfloat16 compute, scalers inactive (bf16 has float32's range);
- ``fp16_plain``: float16 everywhere *including the first layer*, loss scaling only,
  no derivative scalers (``derivative_scaling=False``): what users had before DerivScaler;
- ``fp16_noscale``: like ``fp16_scaled_order`` (first layer float32) but
  ``derivative_scaling=False``: isolates the scalers' own cost;
- ``fp16_scaled_order`` / ``fp16_scaled_term``: DerivScaler, per-order / per-term.

and, with per-tensor scaling of the matmul operands (``jaxamp/_src/placement/tensor_scale.py``; not in
:data:`MODES`, the default set of the runner's presets, but in :data:`ALL_MODES`):

- ``fp16_tensor``: ``fp16_scaled_order`` plus ``tensor_scaling=True`` (float16 operands, each
  with its own power-of-two scale);
- ``fp8_default``: ``dtype="float8"``, the FP8 recipe as it ships: operands by role
  value / tangent / cotangent in float16 / float16 / E4M3 (FP8 in the backward matmuls only);
- ``fp8_all``: the same with ``float8_formats={"tangent": "float8_e4m3fn"}``: every derivative
  matmul in E4M3 (tangents and cotangents), values float16.

(The name ``fp8`` alone is kept unknown: ``fp8_default`` says which recipe.)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from jaxamp.models import FullyConnected

HALF_WIDTH = 0.05
NU = 0.01
RHO = 1.0
INPUTS = ("x", "y")
OUTPUTS = ("u", "v", "p")
DERIVATIVES = (
    "u__x", "u__y", "u__x__x", "u__y__y",
    "v__x", "v__y", "v__x__x", "v__y__y",
    "p__x", "p__y",
)

MODES: Tuple[str, ...] = (
    "fp32_highest",
    "fp32_default",
    "bf16",
    "fp16_plain",
    "fp16_noscale",
    "fp16_scaled_order",
    "fp16_scaled_term",
)
TENSOR_MODES: Tuple[str, ...] = ("fp16_tensor", "fp8_default", "fp8_all")
ALL_MODES: Tuple[str, ...] = MODES + TENSOR_MODES


@dataclasses.dataclass(frozen=True)
class LDCSize:
    """Network and batch sizes: ``nr_layers x layer_size``; points per batch."""

    nr_layers: int = 6
    layer_size: int = 512
    n_interior: int = 4000
    n_lid: int = 1000
    n_noslip: int = 1000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LDCSize: `{f.name}`={v!r} must be a positive integer.")

    @property
    def label(self) -> str:
        return f"{self.nr_layers}x{self.layer_size} b{self.n_lid}/{self.n_noslip}/{self.n_interior}"


@dataclasses.dataclass
class LDCStep:
    """One mode's ready-to-run step: ``step(state, batch) -> (state, metrics)`` (not jitted)."""

    mode: str
    step: Callable[[jaxamp.TrainState, Any], Tuple[jaxamp.TrainState, Dict[str, jax.Array]]]
    state: jaxamp.TrainState
    batch: Dict[str, jax.Array]
    precision: Callable[[], ContextManager]  # enter while tracing/compiling this mode
    engine: jaxamp.Derivatives
    model: FullyConnected


def mode_settings(mode: str) -> Tuple[jaxamp.AmpConfig, jaxamp.AmpConfig, jaxamp.AmpConfig, str]:
    """``(net_amp, engine_amp, step_amp, matmul_precision)`` for a mode.

    ``net_amp`` places precision in the network, ``engine_amp`` decides derivative scaling,
    ``step_amp`` the loss scaler; ``matmul_precision`` is ``"highest"`` or ``"default"``.
    """
    off = jaxamp.AmpConfig(enabled=False)
    fp16 = jaxamp.AmpConfig(dtype="float16")
    if mode == "fp32_highest":
        return off, off, off, "highest"
    if mode == "fp32_default":
        return off, off, off, "default"
    if mode == "bf16":
        bf16 = jaxamp.AmpConfig(dtype="bfloat16")
        return bf16, bf16, bf16, "default"
    if mode == "fp16_plain":
        plain = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True, derivative_scaling=False)
        return plain, plain, plain, "default"
    if mode == "fp16_noscale":
        noscale = jaxamp.AmpConfig(dtype="float16", derivative_scaling=False)
        return noscale, noscale, noscale, "default"
    if mode == "fp16_scaled_order":
        return fp16, fp16, fp16, "default"
    if mode == "fp16_scaled_term":
        term = jaxamp.AmpConfig(dtype="float16", mode="per_term_scaler")
        return term, term, term, "default"
    if mode in TENSOR_MODES:
        kw = {"fp16_tensor": dict(dtype="float16", tensor_scaling=True), "fp8_default": dict(dtype="float8"),
              "fp8_all": dict(dtype="float8", float8_formats={"tangent": "float8_e4m3fn"})}[mode]
        amp = jaxamp.AmpConfig(**kw)
        return amp, amp, amp, "default"
    raise ValueError(f"ldc: mode={mode!r} is not known: expected one of {list(ALL_MODES)}.")


def make_points(size: LDCSize, seed: int = 0) -> Dict[str, jax.Array]:
    """Deterministic uniform samples: interior, lid (top wall) and the three no-slip walls."""
    rng = np.random.default_rng(seed)
    h = HALF_WIDTH
    interior = rng.uniform(-h, h, (size.n_interior, 2))
    lid = np.stack([rng.uniform(-h, h, size.n_lid), np.full(size.n_lid, h)], -1)
    t = rng.uniform(0.0, 3.0, size.n_noslip)  # left, bottom, right walls by arc length / (2h)
    side = np.minimum(t.astype(int), 2)
    s = (t - side) * 2 * h - h
    noslip = np.where(
        (side == 0)[:, None], np.stack([np.full_like(s, -h), s], -1),
        np.where((side == 1)[:, None], np.stack([s, np.full_like(s, -h)], -1),
                 np.stack([np.full_like(s, h), s], -1)),
    )
    return {k: jnp.asarray(v, jnp.float32) for k, v in (("interior", interior), ("lid", lid), ("noslip", noslip))}


def init_params(size: LDCSize, seed: int = 0) -> Any:
    """float32 parameters, shared by every mode (parameters are float32 in all of them)."""
    model = FullyConnected(out_features=3, layer_size=size.layer_size, nr_layers=size.nr_layers)
    return model.init(jax.random.PRNGKey(seed), jnp.zeros(2))


def residuals(d: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    """Continuity and x/y momentum residuals (steady, constant ``nu``, ``rho``)."""
    u, v = d["u"], d["v"]
    return {
        "continuity": d["u__x"] + d["v__y"],
        "momentum_x": u * d["u__x"] + v * d["u__y"] + d["p__x"] / RHO - NU * (d["u__x__x"] + d["u__y__y"]),
        "momentum_y": u * d["v__x"] + v * d["v__y"] + d["p__y"] / RHO - NU * (d["v__x__x"] + d["v__y__y"]),
    }


def build_step(mode: str, size: LDCSize, params: Any = None, points: Dict[str, jax.Array] = None,
               method: str = "forward") -> LDCStep:
    """The LDC train step (Adam 1e-3, clip 0.5) for ``mode``, on shared ``params``/``points``;
    ``method`` is the derivative engine's (``jaxamp.Derivatives``)."""
    net_amp, engine_amp, step_amp, precision = mode_settings(mode)
    params = init_params(size) if params is None else params
    points = make_points(size) if points is None else points
    model = FullyConnected.from_amp(net_amp, out_features=3, layer_size=size.layer_size, nr_layers=size.nr_layers)
    engine = jaxamp.Derivatives(
        lambda p, x: model.apply(p, x), inputs=INPUTS, outputs=OUTPUTS, derivatives=DERIVATIVES, amp=engine_amp,
        method=method,
    )

    def loss_fn(p, batch):
        d = engine(p, batch["interior"])
        res = residuals(d)
        lid = model.apply(p, batch["lid"])
        wall = model.apply(p, batch["noslip"])
        terms = {k: jnp.mean(r**2) for k, r in res.items()}
        terms["lid"] = jnp.mean((lid[:, 0] - 1.0) ** 2 + lid[:, 1] ** 2)
        terms["noslip"] = jnp.mean(wall[:, 0] ** 2 + wall[:, 1] ** 2)
        return sum(terms.values()), terms

    opt = optax.adam(1e-3)
    state = jaxamp.TrainState.create(params=params, optimizer=opt, amp=step_amp, engines=[engine])
    step = jaxamp.make_train_step(loss_fn, opt, amp=step_amp)

    def ctx() -> ContextManager:
        return jax.default_matmul_precision("highest") if precision == "highest" else contextlib.nullcontext()

    return LDCStep(mode=mode, step=step, state=state, batch=points, precision=ctx, engine=engine, model=model)
