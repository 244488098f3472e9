"""The shared training loop: build the model and the jaxamp train step, run it in
``lax.scan`` chunks, log metrics (JSONL), checkpoint/resume, evaluate and plot.

Workdir layout: ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one record per
step), ``tensorboard/`` (the same metrics as TensorBoard event files), ``checkpoints/<step>``
(orbax: the train state and the stall monitor's state), ``train_time.json`` (training
seconds per checkpoint), ``summary.json`` (relative L2 errors, failure steps, timings, why
a stalled run stopped), ``*.png`` (plots).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import jaxamp
from examples.common.config import ConfigError, amp_settings, to_yaml
from examples.common.problem import Problem, rel_l2
from examples.common.records import (
    failure_summary, read_json, read_metrics, record_time, records_of, write_metrics,
)
from examples.common.stall import make_monitor, monitored_step, stop_line
from examples.common.tensorboard import TensorBoardLog, skip_counts
from jaxamp.models import FourierNet, FullyConnected


def build_model(cfg: Mapping[str, Any], amp: jaxamp.AmpConfig, n_out: int):
    m = cfg["model"]
    kwargs = dict(layer_size=m["layer_size"], nr_layers=m["nr_layers"], activation=m["activation"])
    if m["arch"] == "fourier":
        return FourierNet.from_amp(amp, n_out, frequencies=m["frequencies"], **kwargs)
    return FullyConnected.from_amp(amp, n_out, **kwargs)


class Setup:
    """Everything a run needs, built from a validated config (no training yet)."""

    def __init__(self, problem_cls: Type[Problem], cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.problem = problem_cls(cfg)
        p = self.problem
        self.amp, _ = amp_settings(cfg)
        self.model = build_model(cfg, self.amp, len(p.outputs))
        # amp.derivative_scaling=false (fp16_plain): the engines neither scale nor check; the
        # model still runs in float16 and the loss scaler stays on.
        inv = None if p.input_scale() is None else jnp.asarray(p.input_scale(), jnp.float32)
        # the network as a function of the coordinates (the problem's input scaling inside it)
        fn = lambda params, x: self.model.apply(params, x if inv is None else x * inv)  # noqa: E731
        self.net = fn
        # One forward-mode engine for every derivative: under per-order scaling a jvp pass
        # yields all outputs' derivatives along its path (u__x__x and v__x__x share one).
        engine = lambda amp: jaxamp.Derivatives(fn, inputs=p.inputs, outputs=p.outputs,  # noqa: E731
                                                derivatives=p.derivatives, amp=amp)
        self.engines = [engine(self.amp)]
        self.sample_key = jax.random.fold_in(jax.random.PRNGKey(cfg["seed"]), 1)
        # amp.init_scales_from_profile: every scaler starts at the scale the profile of the initial
        # parameters on the first batch recommends (custom_init_scales_log2; max scales unchanged).
        self.start_scales = None
        if cfg["amp"].get("init_scales_from_profile") and self.amp.scaler_enabled:
            rec = self._recommend_from_profile()
            self.amp, self.start_scales = rec.apply(self.amp), dict(rec.scales_log2)
            self.engines = [engine(self.amp)]
        # Boundary points that need only the outputs get an engine without derivatives.
        self.values_engine = jaxamp.Derivatives(fn, inputs=p.inputs, outputs=p.outputs, derivatives=(), amp=self.amp)
        o = cfg["optimizer"]
        # optax counts applied updates only: skipped steps do not advance the decay (Modulus' does).
        schedule = optax.exponential_decay(o["lr"], transition_steps=o["decay_steps"], decay_rate=o["decay_rate"])
        self.optimizer = optax.adam(schedule)
        # The library does not clip by default; the configs pass Modulus' 0.5 (0 turns it off).
        self.step_fn = jaxamp.make_train_step(
            self._loss_fn, self.optimizer, amp=self.amp, grad_clip_max_norm=o["grad_clip_max_norm"] or None,
            headroom=True,  # metrics headroom_log2/<key>: powers of two left below 65504, one max per check
        )
        self._chunks: Dict[Tuple[int, int], Callable] = {}
        self.mesh = self._make_mesh(cfg["training"]["devices"])

    def _recommend_from_profile(self):
        """The start scales recommended by the profile (``jaxamp.profile(...)(...).recommend``) of the
        initial parameters on the first batch at scale 1 (its ``apply`` starts each key at its
        scale, never growing past it)."""
        parts = self.problem.sample(jax.random.fold_in(self.sample_key, 0)).values()
        points = {name: jnp.concatenate([part[name] for part in parts]) for name in self.problem.inputs}
        prof = jax.jit(jaxamp.profile(self.engines[0]))(None, self.init_params(), points)
        return prof.recommend(default_max_scale_log2=self.amp.default_max_scale_log2)

    def _make_mesh(self, devices: int):
        """A data-parallel mesh for ``training.devices > 1`` (None for one device)."""
        if devices == 1:
            return None
        if devices > jax.device_count():
            raise ConfigError(
                f"training.devices={devices} is not allowed: expected at most the {jax.device_count()} "
                "device(s) JAX sees (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N)."
            )
        shapes = jax.eval_shape(self.problem.sample, self.sample_key)
        for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
            if leaf.shape[0] % devices:
                raise ConfigError(
                    f"training.devices={devices} is not allowed: the batch part {jax.tree_util.keystr(path)} "
                    f"has {leaf.shape[0]} points, not divisible by {devices}; change batch.* or training.devices."
                )
        return jaxamp.parallel.make_mesh(devices)

    def _loss_fn(self, params, batch):
        # The engines take their scales from the train step and report their flags to it.
        def derive(points, derivatives=True):
            values: Dict[str, jax.Array] = {}
            for engine in self.engines if derivatives else [self.values_engine]:
                values.update(engine(params, points))
            return values

        return self.problem.loss(derive, batch)

    def init_params(self):
        """The initial parameters (from ``seed``)."""
        x0 = jnp.zeros(len(self.problem.inputs), jnp.float32)
        return self.model.init(jax.random.PRNGKey(self.cfg["seed"]), x0)

    def init_state(self) -> jaxamp.TrainState:
        params = self.init_params()
        state = jaxamp.TrainState.create(params=params, optimizer=self.optimizer, amp=self.amp, engines=self.engines)
        return self.place(state)

    def place(self, state: jaxamp.TrainState) -> jaxamp.TrainState:
        """Replicate the state over the mesh (a no-op on one device)."""
        return state if self.mesh is None else jaxamp.parallel.replicate(state, self.mesh)

    def monitor(self, limit: int) -> jaxamp.StallMonitor:
        """The stall monitor of ``training.max_consecutive_skips=limit`` (0: never stop)."""
        return make_monitor(limit, self.amp)

    def chunk(self, n: int, limit: int) -> Callable:
        """Jitted ``(state, monitor state) -> ((state, monitor state), metrics stacked over n
        steps)``; points resampled each step from ``fold_in(key, step)``, so a run is the same
        however it is chunked or resumed. A run that has skipped ``limit`` steps in a row
        stays where it is (see :mod:`examples.common.stall`)."""
        key = (n, limit)
        if key not in self._chunks:
            step = monitored_step(self.step_fn, self.monitor(limit), stop=bool(limit))

            def body(carry, _):
                batch = self.problem.sample(jax.random.fold_in(self.sample_key, carry[0].step))
                if self.mesh is not None:  # points split over the devices, state replicated
                    sharding = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names[0]))
                    batch = jax.tree_util.tree_map(lambda a: jax.lax.with_sharding_constraint(a, sharding), batch)
                return step(carry, batch)

            self._chunks[key] = jax.jit(lambda c: jax.lax.scan(body, c, None, length=n))
        return self._chunks[key]

    def profile(self, state: jaxamp.TrainState):
        """``(profile, scaled)`` of the next batch (every part together) with the state's
        parameters and scales: where each derivative sits in float16's window
        (:func:`jaxamp.profile`), and each derivative's values times its key's scale
        (``{name: np.ndarray}``), as float16 holds them. A run without derivative scalers gets
        the profile at every scale 1 of its network under float16 derivative scalers (the keys
        they would have): how much headroom its derivatives leave below 65504."""
        parts = self.problem.sample(jax.random.fold_in(self.sample_key, state.step)).values()
        points = {name: jnp.concatenate([part[name] for part in parts]) for name in self.problem.inputs}
        scales = {key: s.scale for key, s in state.amp_state.derivative.items()}
        engine = self.engines[0]
        values, _ = jaxamp.scaled(engine)(scales, state.params, points)
        scaled = {}
        for name, v in values.items():
            if name in engine.outputs:
                continue
            key = engine.scaler_key(name.rsplit("__", 1)[0]) if engine.scaler_keys else None
            scaled[name] = np.asarray(v) * float(scales[key] if key is not None else 1.0)
        if not self.amp.scaler_enabled:  # no scaler: every scale 1, keyed as a float16 scaler would key it
            amp = dataclasses.replace(self.amp, enabled=True, dtype="float16", derivative_scaling=True)
            engine = jaxamp.Derivatives(self.net, inputs=engine.inputs, outputs=engine.outputs,
                                        derivatives=engine.requested, amp=amp)
        prof = jax.jit(jaxamp.profile(engine))(scales or None, state.params, points)
        return prof, scaled

    def predict(self, params, points: np.ndarray) -> np.ndarray:
        f = jax.jit(jax.vmap(lambda x: self.net(params, x)))
        return np.asarray(f(jnp.asarray(points, jnp.float32)))


_SETUPS: Dict[str, Setup] = {}


def get_setup(problem_cls: Type[Problem], cfg: Mapping[str, Any]) -> Setup:
    """A Setup per (problem, config except ``training``), reused so compiled chunks are too."""
    key = json.dumps([problem_cls.name, {k: v for k, v in cfg.items() if k != "training"}], sort_keys=True)
    if key not in _SETUPS:
        _SETUPS[key] = Setup(problem_cls, cfg)
    return _SETUPS[key]


def _check_workdir(workdir: str, cfg: Mapping[str, Any], resume: bool, ckpt: jaxamp.Checkpointer) -> None:
    saved_path = os.path.join(workdir, "config.yaml")
    if ckpt.latest_step() is not None and not resume:
        raise ConfigError(
            f"workdir {workdir!r} already holds checkpoints (step {ckpt.latest_step()}): pass --resume "
            "to continue that run, or choose an empty workdir."
        )
    if resume and os.path.exists(saved_path):
        from omegaconf import OmegaConf

        saved = OmegaConf.to_container(OmegaConf.load(saved_path))
        a = {**saved, "training": {**saved["training"], "max_steps": None}}
        b = {**cfg, "training": {**cfg["training"], "max_steps": None}}
        if a != b:
            raise ConfigError(
                f"--resume: the config differs from the one the run in {workdir!r} started with "
                "(only training.max_steps may change); see its config.yaml."
            )


def train_and_evaluate(
    problem_cls: Type[Problem], cfg: Mapping[str, Any], workdir: str, *, resume: bool = False,
    progress: bool = True, plots: bool = True,
) -> Dict[str, Any]:
    """Train (or resume) the run configured by ``cfg`` in ``workdir``; return its summary.

    The run stops early, after the chunk in which ``training.max_consecutive_skips`` steps
    in a row were skipped; its summary then says why (``stalled``), and the command line
    exits with status 3. A checkpoint holds the train state and the stall monitor's state."""
    os.makedirs(workdir, exist_ok=True)
    setup = get_setup(problem_cls, cfg)
    setup.cfg = cfg
    t = cfg["training"]
    ckpt = jaxamp.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=2)
    _check_workdir(workdir, cfg, resume, ckpt)
    with open(os.path.join(workdir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    limit = t["max_consecutive_skips"]
    monitor = setup.monitor(limit)
    state, mstate = setup.init_state(), monitor.init()
    earlier_s = 0.0  # training seconds up to the restored checkpoint (recorded with each one)
    time_path = os.path.join(workdir, "train_time.json")
    kept: List[Dict[str, Any]] = []
    if resume and ckpt.latest_step() is not None:
        earlier_s = read_json(time_path).get(str(ckpt.latest_step()), 0.0)
        saved = ckpt.restore({"train": state, "monitor": mstate})
        state, mstate = setup.place(saved["train"]), saved["monitor"]
        # Drop records written after the checkpoint (the run died between the two).
        kept = read_metrics(metrics_path, upto=int(state.step))
        write_metrics(metrics_path, kept, mode="w")
    else:
        write_metrics(metrics_path, [], mode="w")
    step, max_steps = int(state.step), t["max_steps"]
    stalled = stop_line(monitor, mstate, kept[-1], bool(limit)) if kept else None
    last = kept[-1] if kept else None  # the latest step's record
    warned = False
    board = TensorBoardLog(workdir, step, skip_counts(kept)) if t["tensorboard"] else None
    bar = _progress_bar(progress, step, max_steps, cfg, kept)
    t0, train_s = time.perf_counter(), 0.0  # train_s: this session's training time, per chunk
    while step < max_steps and stalled is None:
        next_ckpt = (step // t["checkpoint_every"] + 1) * t["checkpoint_every"]
        n = min(t["chunk_steps"], max_steps - step, next_ckpt - step)
        (state, mstate), metrics = setup.chunk(n, limit)((state, mstate))
        recs = records_of(step, metrics)[: int(state.step) - step]  # none after a stop
        write_metrics(metrics_path, recs)
        if board is not None:
            board.write(recs)
        step = int(state.step)
        train_s = time.perf_counter() - t0
        stalled, last = stop_line(monitor, mstate, recs[-1], bool(limit)), recs[-1]
        if step % t["checkpoint_every"] == 0 or step == max_steps or stalled:
            ckpt.save({"train": state, "monitor": mstate}, step=step)
            record_time(time_path, step, earlier_s + train_s)
        if bar is not None:
            bar.advance(recs)
        warning = stalled or (None if warned else monitor.diagnose(mstate, recs[-1]))
        if warning:
            print(warning, file=sys.stderr)
            warned = True
    if bar is not None:
        bar.close()
    ckpt.close()
    # a run not stopped (training.max_consecutive_skips=0) may still end stalled: the monitor says
    at_end = None if stalled or last is None else monitor.diagnose(mstate, last)
    summary = evaluate(setup, state, workdir, train_s=train_s, earlier_s=earlier_s, plots=plots, stalled=stalled,
                       stalled_at_end=at_end)
    if plots and cfg["eval"]["profile"]:  # the final derivative ranges: a plot, and scalars
        from examples.common import plots as P

        prof, scaled = setup.profile(state)
        P.plot_profile(workdir, prof, scale_one=not setup.amp.scaler_enabled)
        if board is not None:
            board.write_profile(step, prof, scaled)
    if board is not None:
        board.close()
    return summary


class _Progress:
    """The run's tqdm bar: steps done, and after each chunk of records :func:`_postfix` with the
    run's skipped steps so far (those of the records a resumed run started from included)."""

    def __init__(self, step: int, max_steps: int, cfg: Mapping[str, Any], earlier: List[Dict[str, Any]],
                 **tqdm_kw: Any) -> None:
        from tqdm import tqdm

        self.skipped = sum(bool(r["skipped"]) for r in earlier)
        self.bar = tqdm(total=max_steps, initial=step, desc=f"{cfg.get('name', '')} {cfg['mode']}", unit="step",
                        **tqdm_kw)

    def advance(self, recs: List[Dict[str, Any]]) -> None:
        """Count one chunk's records: the bar moves by their steps, its postfix shows the last."""
        self.skipped += sum(bool(r["skipped"]) for r in recs)
        self.bar.update(len(recs))
        self.bar.set_postfix(_postfix(recs, self.skipped), refresh=False)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(progress: bool, step: int, max_steps: int, cfg: Mapping[str, Any],
                  earlier: List[Dict[str, Any]], **tqdm_kw: Any) -> Optional[_Progress]:
    """The progress bar of a run from ``step`` (``earlier``: the records it resumed from); None
    without ``progress``."""
    return _Progress(step, max_steps, cfg, earlier, **tqdm_kw) if progress else None


def _postfix(recs: List[Dict[str, Any]], skipped_total: int) -> Dict[str, Any]:
    """The bar's postfix after a chunk ``recs``: the last loss, ``skipped_total`` (the run's
    skipped steps so far), ``skipped_window`` (``k/n``: k of the chunk's n steps skipped) and
    the last log2 scales (``s_<key>``)."""
    last = recs[-1]
    window = sum(bool(r["skipped"]) for r in recs)
    out = {"loss": last["loss"], "skipped_total": skipped_total, "skipped_window": f"{window}/{len(recs)}"}
    out.update({"s_" + k.split("/", 1)[1]: last[k] for k in last if k.startswith("scale_log2/")})
    return out


def evaluate(setup: Setup, state: jaxamp.TrainState, workdir: str, *, train_s: float, plots: bool,
             earlier_s: float = 0.0, stalled: Optional[str] = None,
             stalled_at_end: Optional[str] = None) -> Dict[str, Any]:
    """Relative L2 errors against the reference, failure steps, plots; writes summary.json.
    ``train_seconds`` adds this session's training time to ``earlier_s`` (the training time
    up to the checkpoint a resumed run started from); ``stalled`` is the stall line of a run
    that stopped early, ``stalled_at_end`` the monitor's diagnosis of one that ran to its end
    stalled (None otherwise)."""
    p = setup.problem
    points, axes = p.eval_grid(setup.cfg["eval"]["grid"])
    pred_all = setup.predict(state.params, points)
    ref = p.reference(points)
    pred = {f: pred_all[:, p.outputs.index(f)] for f in p.eval_fields}
    errs = {f"rel_l2/{f}": rel_l2(pred[f], ref[f]) for f in p.eval_fields}
    cat = lambda d: np.concatenate([d[f] for f in p.eval_fields])  # noqa: E731
    recs = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    summary = {
        "problem": p.name,
        "mode": setup.cfg["mode"],
        "seed": setup.cfg["seed"],
        "rel_l2": rel_l2(cat(pred), cat(ref)),
        **errs,
        **failure_summary(recs),
        "stalled": stalled,
        "stalled_at_end": stalled_at_end,
        **({} if setup.start_scales is None else {"init_scales_log2_from_profile": setup.start_scales}),
        "train_seconds_this_session": train_s,
        "train_seconds": earlier_s + train_s,
    }
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if plots:
        from examples.common import plots as P

        P.plot_fields(workdir, p.inputs, axes, pred, ref)
        P.plot_losses(workdir, recs)
        P.plot_scales(workdir, recs)
    return summary
