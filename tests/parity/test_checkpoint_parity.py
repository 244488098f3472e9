"""Checkpoint parity: scaler state saved by one framework, loaded by the other, continues identically.

1. Scalers alone (the per-order fp16 setup: keys "1", "2" and the loss scaler, with the rules of
   tests.helpers.poisson_pair's fp16 config), driven by random found_inf flags:
   (a) jaxamp runs K steps, saves with ``jaxamp.Checkpointer``; the restored arrays go into
       torch_ref ``ScaleState``s (``torch_ref.scale_states_from_jax``); both continue K steps;
   (b) torch_ref runs K steps, ``torch.save``s its state_dicts; ``torch.load`` ->
       ``torch_ref.scale_states_to_jax`` -> ``jaxamp._src.scaling.scaler.ScaleState``; both continue K steps.
   Every (scale, tracker) of the continuations is identical. The checkpoint is cut right after
   a burst of overflows, in recover mode with a non-zero tracker, so what is carried matters:
   a tracker reset to 0 on load gives a different trajectory (checked).
2. A real fp16 training run: 20 steps with injected derivative overflows, a whole checkpoint
   (params, Adam state, scalers) crosses over, both frameworks continue 30 more steps with more
   injections: identical skip decisions and scaler trajectories, losses within fp16 parity.
   Both directions (jaxamp Checkpointer -> torch_ref, torch.save -> jaxamp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxamp
import torch_ref
from jaxamp._src.scaling.scaler import Scalers
from tests.helpers.poisson_pair import CONFIGS, fresh_pair, losses, run_jax, run_torch, trajectory

AMP = CONFIGS["fp16"][0]
NAMES = ("1", "2", "loss")
K = 300  # steps before and after the checkpoint


def _uncommitted(tree):
    """The same values as uncommitted arrays. Orbax restores arrays *committed* to a device; jit
    keys its cache on that, so a step compiled for fresh states would compile again (measured:
    8.5 s CPU for the fp16 train step)."""
    return jax.tree_util.tree_map(jnp.asarray, jax.device_get(tree))


def _rules(framework):
    if framework == "jax":
        return {"1": AMP.derivative_scaler_for("1"), "2": AMP.derivative_scaler_for("2"),
                "loss": AMP.make_loss_scaler()}
    amp = torch_ref.AmpSettings.from_dict(AMP.to_dict())
    return {"1": amp.derivative_scaler_for("1"), "2": amp.derivative_scaler_for("2"), "loss": amp.make_loss_scaler()}


def _flags(seed: int) -> np.ndarray:
    """bool[2K, 3]: random overflows (sparser after the cut, so the scales climb back to their
    max); 6 in a row just before the cut, then 4 clean steps."""
    rng = np.random.default_rng(seed)
    p = np.where(np.arange(2 * K)[:, None] < K, [[0.03, 0.05, 0.01]], [[0.01, 0.01, 0.004]])
    flags = rng.random((2 * K, len(NAMES))) < p
    flags[K - 10:K - 4] = True
    flags[K - 4:K] = False
    return flags


@functools.lru_cache(maxsize=None)
def _jax_runner():
    """One compiled lax.scan of K updates of the three rules (shared by every test here)."""
    rules = _rules("jax")

    def run(states, flags):
        def body(s, f):
            s = {k: rules[k].update(s[k], f[i]) for i, k in enumerate(NAMES)}
            return s, s

        return jax.lax.scan(body, states, flags)

    return jax.jit(run)


def _jax_run(states, flags):
    final, traj = _jax_runner()(states, jnp.asarray(flags))
    return final, {k: (np.asarray(traj[k].scale), np.asarray(traj[k].growth_tracker)) for k in NAMES}


def _torch_run(states, flags):
    rules, out = _rules("torch"), {k: ([], []) for k in NAMES}
    for row in flags.tolist():
        for i, k in enumerate(NAMES):
            states[k] = rules[k].update(states[k], row[i])
            out[k][0].append(float(states[k].scale))
            out[k][1].append(int(states[k].growth_tracker))
    return states, {k: (np.array(s, np.float32), np.array(t, np.int32)) for k, (s, t) in out.items()}


def _assert_same(jt, tt):
    for k in NAMES:
        np.testing.assert_array_equal(jt[k][0], tt[k][0], err_msg=f"scale {k}")
        np.testing.assert_array_equal(jt[k][1], tt[k][1], err_msg=f"tracker {k}")


def _assert_cut_in_recover_mode(states, rules):
    for k in NAMES:
        scale, tracker = float(states[k].scale), int(states[k].growth_tracker)
        assert scale <= rules[k].recover_threshold and tracker == 4, (k, scale, tracker)


def test_jaxamp_checkpoint_continues_identically_in_torch_ref(tmp_path):
    flags = _flags(0)
    init = {k: r.init() for k, r in _rules("jax").items()}
    saved, _ = _jax_run(init, flags[:K])
    _assert_cut_in_recover_mode(saved, _rules("jax"))
    with jaxamp.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(saved, step=K)
        restored = _uncommitted(ckpt.restore(init))
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(restored),
                                                     jax.tree_util.tree_leaves(saved)))

    _, jt = _jax_run(restored, flags[K:])
    _, tt = _torch_run(torch_ref.scale_states_from_jax(restored), flags[K:])
    _assert_same(jt, tt)
    # the continuation exercised every branch: backoff, recover growth, normal growth, the cap
    for k, rule in _rules("jax").items():
        assert jt[k][0].max() == rule.max_scale and (np.diff(np.log2(jt[k][0])) == 1).sum() >= 6, k
    # and the loaded tracker mattered: continuing from tracker 0 diverges
    zeroed = {k: s._replace(growth_tracker=jnp.int32(0)) for k, s in restored.items()}
    _, wrong = _torch_run(torch_ref.scale_states_from_jax(zeroed), flags[K:])
    assert any(not np.array_equal(jt[k][0], wrong[k][0]) for k in NAMES)


def test_torch_ref_checkpoint_continues_identically_in_jaxamp(tmp_path):
    flags = _flags(1)
    rules = _rules("torch")
    saved, _ = _torch_run({k: r.init() for k, r in rules.items()}, flags[:K])
    _assert_cut_in_recover_mode(saved, rules)
    torch.save({k: s.state_dict() for k, s in saved.items()}, tmp_path / "scalers.pt")
    loaded = torch.load(tmp_path / "scalers.pt")

    jax_states = {k: jaxamp._src.scaling.scaler.ScaleState(**v)
                  for k, v in torch_ref.scale_states_to_jax(loaded).items()}
    _, jt = _jax_run(jax_states, flags[K:])
    _, tt = _torch_run({k: torch_ref.ScaleState.from_state_dict(v) for k, v in loaded.items()}, flags[K:])
    _assert_same(jt, tt)
    for k, rule in _rules("jax").items():
        assert jt[k][0].max() == rule.max_scale and (np.diff(np.log2(jt[k][0])) == 1).sum() >= 6, k


# --------------------------------------------------------------------------- a real training run

INJECT = frozenset({5, 6, 7, 30, 31})  # both derivative keys flagged: derivative overflow, step skipped
CUT, END = 20, 50


def _adam(opt_state):
    adam, sched = opt_state
    assert isinstance(adam, optax.ScaleByAdamState) and isinstance(sched, optax.ScaleByScheduleState)
    return adam, sched


def jax_state_into_torch(js: jaxamp.TrainState, ts: torch_ref.TrainState) -> None:
    """Load a jaxamp TrainState (params, Adam moments and counts, scalers) into a torch_ref one."""
    adam, sched = _adam(js.opt_state.inner)
    ts.model.load_state_dict(torch_ref.flax_to_torch(jax.device_get(js.params)))
    names = [n for n, _ in ts.model.named_parameters()]
    mu, nu = torch_ref.flax_to_torch(jax.device_get(adam.mu)), torch_ref.flax_to_torch(jax.device_get(adam.nu))
    sd = ts.optimizer.state_dict()
    sd["state"] = {i: {"step": torch.tensor(float(adam.count)), "exp_avg": mu[n], "exp_avg_sq": nu[n]}
                   for i, n in enumerate(names)}
    ts.optimizer.load_state_dict(sd)
    ts.load_scaler_state_dict({"step": int(js.step), "applied": int(sched.count),
                               "loss_scale": js.amp_state.loss._asdict(),
                               "deriv_scales": {k: s._asdict() for k, s in js.amp_state.derivative.items()}})


def torch_checkpoint_to_jax(ckpt: dict, like: jaxamp.TrainState) -> jaxamp.TrainState:
    """A torch checkpoint ``{"model", "optimizer", "scalers"}`` -> a jaxamp TrainState shaped like ``like``."""
    names = list(ckpt["model"])
    opt = ckpt["optimizer"]["state"]
    moment = lambda key: torch_ref.torch_to_flax({n: opt[i][key] for i, n in enumerate(names)})  # noqa: E731
    steps = {int(s["step"]) for s in opt.values()}
    assert len(steps) == 1 and steps.pop() == ckpt["scalers"]["applied"]
    adam, sched = _adam(like.opt_state.inner)
    count = jnp.int32(ckpt["scalers"]["applied"])
    sc = ckpt["scalers"]
    return jaxamp.TrainState(
        step=jnp.int32(sc["step"]),
        params=jax.tree_util.tree_map(jnp.asarray, torch_ref.torch_to_flax(ckpt["model"])),
        opt_state=jaxamp._src.training.step.AmpOptState(
            inner=(adam._replace(count=count, mu=jax.tree_util.tree_map(jnp.asarray, moment("exp_avg")),
                                 nu=jax.tree_util.tree_map(jnp.asarray, moment("exp_avg_sq"))),
                   sched._replace(count=count)),
            amp=like.amp_state.replace(
                loss=jaxamp._src.scaling.scaler.ScaleState(
                    **torch_ref.scale_states_to_jax({"l": sc["loss_scale"]})["l"]),
                derivative=Scalers(like.amp_state.derivative.rules, {
                    k: jaxamp._src.scaling.scaler.ScaleState(**v)
                    for k, v in torch_ref.scale_states_to_jax(sc["deriv_scales"]).items()})),
            skip_reason=jnp.int32(0), consecutive_skips=jnp.int32(0)),
    )


def _check_continuation(jm, tm):
    assert trajectory(jm) == trajectory(tm)
    skipped = [CUT + i for i, m in enumerate(tm) if m["skipped"]]
    assert skipped == sorted(i for i in INJECT if i >= CUT)
    scales2 = [m["scale_log2/2"] for m in tm]
    assert scales2[0] == -3 and max(scales2) == -2 and min(scales2) == -4  # grew (loaded tracker), backed off
    loss_log2 = [m["scale_log2/loss"] for m in tm]
    assert loss_log2[0] == 0 and loss_log2[-1] == 1  # loss tracker 17 at the cut: grew 23 clean steps later
    jl, tl = losses(jm), losses(tm)
    ok = ~np.array([m["skipped"] for m in tm])
    assert np.abs(jl[ok] - tl[ok]).max() / np.abs(jl[ok]).min() < 5e-2 and abs(jl[0] - tl[0]) < 1e-2 * jl[0]


@pytest.mark.slow  # an end-to-end run (fast-suite budget); CI runs it
def test_training_checkpoint_jaxamp_to_torch_ref(tmp_path):
    js, jstep, ts, tstep = fresh_pair("fp16")
    js, _ = run_jax(js, jstep, range(CUT), INJECT)
    with jaxamp.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(js)
        restored = _uncommitted(ckpt.restore(js))
    assert int(restored.step) == CUT and float(restored.amp_state.derivative["2"].scale) == 2.0**-3
    jax_state_into_torch(restored, ts)
    assert ts.step == CUT and ts.applied == CUT - 3 and int(ts.deriv_scales["2"].growth_tracker) == CUT - 8
    # the Adam state crossed exactly: torch -> jax gives back the restored moments bit for bit
    ckpt_t = {"model": ts.model.state_dict(), "optimizer": ts.optimizer.state_dict(), "scalers": ts.scaler_state_dict()}
    back = torch_checkpoint_to_jax(ckpt_t, restored)
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), back, restored)
    assert all(jax.tree_util.tree_leaves(same))
    _, jm = run_jax(restored, jstep, range(CUT, END), INJECT)
    tm = run_torch(ts, tstep, range(CUT, END), INJECT)
    _check_continuation(jm, tm)


@pytest.mark.slow
def test_training_checkpoint_torch_ref_to_jaxamp(tmp_path):
    js, jstep, ts, tstep = fresh_pair("fp16")
    run_torch(ts, tstep, range(CUT), INJECT)
    torch.save({"model": ts.model.state_dict(), "optimizer": ts.optimizer.state_dict(),
                "scalers": ts.scaler_state_dict()}, tmp_path / "run.pt")
    ckpt = torch.load(tmp_path / "run.pt")
    _, _, ts2, tstep2 = fresh_pair("fp16")  # a new torch run resumes from the file
    ts2.model.load_state_dict(ckpt["model"])
    ts2.optimizer.load_state_dict(ckpt["optimizer"])
    ts2.load_scaler_state_dict(ckpt["scalers"])
    jstate = torch_checkpoint_to_jax(ckpt, js)
    assert int(jstate.step) == CUT and float(jstate.amp_state.derivative["2"].scale) == 2.0**-3
    _, jm = run_jax(jstate, jstep, range(CUT, END), INJECT)
    tm = run_torch(ts2, tstep2, range(CUT, END), INJECT)
    _check_continuation(jm, tm)
