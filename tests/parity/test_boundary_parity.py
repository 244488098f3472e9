"""The network boundary, both frameworks: the user's own derivatives of an fp16 network, scaled per order.

jaxamp: ``jax.grad`` / ``jax.hessian`` through ``jaxamp.autocast`` (the float32 Flax
``FullyConnected`` placed by autocast), evaluated by ``jaxamp.scaled``. torch_ref: nested
``torch.autograd.grad(..., create_graph=True)`` through ``torch_ref.Boundary`` around the
explicit-cast twin (``FullyConnected.from_amp``), same float32 weights. Same keys, same flags
on a real float16 overflow (XLA without excess precision), values within the rounding bound of
test_derivative_parity.py (``3 (k+1) (L+1) u`` for order ``k``), the same training trajectory.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxamp
import torch_ref
from jaxamp import NONFINITE_VALUES
from jaxamp.models import FullyConnected as JaxFC
from tests.helpers.parity import NO_EXCESS, U16, init_params, rel_err, torch_twin
from tests.helpers.poisson_pair import CLIP, losses, run_torch, schedule, trajectory

N_LAYERS, WIDTH = 3, 32
PTS1 = np.linspace(-1, 1, 65, dtype=np.float32)[:, None]  # x = 0 included: every unit at silu''(0)
PTS2 = np.random.default_rng(0).uniform(-1, 1, (48, 2)).astype(np.float32)


def _bound(order: int) -> float:
    return 3 * (order + 1) * (N_LAYERS + 1) * U16


def _boosted(params, factor):
    """The first layer's weight_g times ``factor`` (its second derivative then overflows float16)."""
    p = {"params": {k: dict(v) for k, v in params["params"].items()}}
    p["params"]["layers_0"]["weight_g"] = params["params"]["layers_0"]["weight_g"] * factor
    return p


def _pair(amp, n_in, params=None):
    params = init_params(n_in, 1, WIDTH, N_LAYERS, 0) if params is None else params
    u = jaxamp.autocast(JaxFC(out_features=1, layer_size=WIDTH, nr_layers=N_LAYERS).apply, amp)
    return u, params, torch_ref.Boundary(torch_twin(amp, params, n_in, 1))


def _jax_chain(u, order):
    """``[u, u_x, u_xx, ...]`` on a batch ``X: [N, 1]`` by nested ``jax.grad`` of batch sums (torch's form)."""

    def fn(p, X):
        outs, f = [u(p, X)], lambda Z: u(p, Z)
        for _ in range(order):
            f = (lambda g: lambda Z: jax.grad(lambda W: jnp.sum(g(W)))(Z))(f)
            outs.append(f(X))
        return outs

    return fn


def _torch_chain(net, scaling, X, order):
    x = torch.from_numpy(X).requires_grad_(True)
    outs = [net(x, scaling=scaling)]
    for _ in range(order):
        (g,) = torch.autograd.grad(outs[-1], x, torch.ones_like(outs[-1]), create_graph=True)
        outs.append(g)
    return [o.detach().numpy() for o in outs]


def _flags(found):
    return {k: bool(v) for k, v in found.items()}


def _jax_eval(fn, amp, scales, *args):
    with jax.default_matmul_precision("highest"):
        vals, found = jax.jit(jaxamp.scaled(fn, amp), compiler_options=NO_EXCESS)(scales, *args)
    return [np.asarray(v) for v in vals], _flags(found)


def test_keys_values_and_flags_match_through_order_3():
    amp = jaxamp.AmpConfig(dtype="float16")
    u, params, net = _pair(amp, 1)
    fn = _jax_chain(u, 3)
    total = lambda p, X: sum(jnp.sum(v) for v in fn(p, X))  # noqa: E731
    found = torch_ref.Scaling.ones()
    _torch_chain(net, found, PTS1, 3)
    started = jaxamp.init(total, amp, from_profile=False)(params, PTS1)
    assert found.keys == tuple(sorted(started.scales)) == ("1", "2", "3")
    scales = {"1": 0.5, "2": 2.0**-3, "3": 2.0**-6}  # powers of two: the values do not depend on them
    vj, fj = _jax_eval(fn, amp, scales, params, jnp.asarray(PTS1))
    scaling = torch_ref.Scaling(scales)
    vt = _torch_chain(net, scaling, PTS1, 3)
    assert fj == _flags(scaling.found_inf) == {"1": False, "2": False, "3": False, NONFINITE_VALUES: False}
    np.testing.assert_array_equal(vj[0], vt[0])  # fp32 activations: the forward pass bit for bit
    for k in range(1, 4):
        assert rel_err(vj[k], vt[k]) < _bound(k), (k, rel_err(vj[k], vt[k]), _bound(k))


def test_jax_hessian_laplacian_against_torch_column_grads_2d():
    """A 2-D Laplacian: ``jax.hessian`` per point (vmap) against torch's ``u_x``, ``u_y`` then their
    own columns, as a Modulus user writes it."""
    amp = jaxamp.AmpConfig(dtype="float16")
    u, params, net = _pair(amp, 2)
    point = lambda p, x: u(p, x[None])[0, 0]  # noqa: E731
    lap = jax.vmap(lambda p, x: jnp.trace(jax.hessian(point, 1)(p, x)), (None, 0))
    scales = {"1": 2.0**-2, "2": 2.0**-5}
    with jax.default_matmul_precision("highest"):
        vj, fj = jax.jit(jaxamp.scaled(lap, amp), compiler_options=NO_EXCESS)(scales, params, jnp.asarray(PTS2))
    scaling = torch_ref.Scaling(scales)
    x = torch.from_numpy(PTS2).requires_grad_(True)
    uu = net(x, scaling=scaling)
    (du,) = torch.autograd.grad(uu, x, torch.ones_like(uu), create_graph=True)
    lt = sum(torch.autograd.grad(du[:, i], x, torch.ones_like(du[:, i]), create_graph=True)[0][:, i] for i in range(2))
    assert _flags(fj) == _flags(scaling.found_inf) == {"1": False, "2": False, NONFINITE_VALUES: False}
    assert rel_err(np.asarray(vj), lt.detach().numpy()) < _bound(2)


def test_a_real_fp16_overflow_raises_the_same_flags_through_the_same_backoffs():
    """First-layer weight_g x1600, first layer in float16: |u_xx| ~ 1.4e6 overflows float16 at
    scale 1, u_x does not; both frameworks flag key 2 alone at each scale until the same one."""
    amp = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True)
    u, params, net = _pair(amp, 1, _boosted(init_params(1, 1, WIDTH, N_LAYERS, 0), 1600.0))
    fn = _jax_chain(u, 2)
    call = jax.jit(jaxamp.scaled(fn, amp), compiler_options=NO_EXCESS)
    rule = jaxamp.AmpConfig().derivative_scaler_for("2")
    s2, history = rule.init(), []
    for _ in range(12):
        scales = {"1": 1.0, "2": float(s2.scale)}
        with jax.default_matmul_precision("highest"):
            vj, fj = call(scales, params, jnp.asarray(PTS1))
        scaling = torch_ref.Scaling(scales)
        vt = _torch_chain(net, scaling, PTS1, 2)
        assert _flags(fj) == _flags(scaling.found_inf), (scales, fj, scaling.found_inf)
        history.append(_flags(fj))
        if not any(history[-1].values()):
            break
        s2 = rule.update(s2, fj["2"])
    assert history[0] == {"1": False, "2": True, NONFINITE_VALUES: False}
    assert len(history) > 2 and not any(history[-1].values())  # more than one backoff, then clean
    assert float(np.abs(vt[2]).max()) > 65504  # the derivative itself lies beyond float16's range
    for k in (1, 2):
        assert np.isfinite(vj[k]).all() and rel_err(np.asarray(vj[k]), vt[k]) < _bound(k)
    print(f"backoffs of key 2: {len(history) - 1}; max |u_xx| = {np.abs(vt[2]).max():.4g}")


def test_a_nan_input_is_a_bad_value_in_both():
    amp = jaxamp.AmpConfig(dtype="float16")
    u, params, net = _pair(amp, 1)
    pts = PTS1.copy()
    pts[7] = np.nan
    _, fj = _jax_eval(_jax_chain(u, 2), amp, {"1": 1.0, "2": 1.0}, params, jnp.asarray(pts))
    scaling = torch_ref.Scaling({"1": 1.0, "2": 1.0})
    _torch_chain(net, scaling, pts, 2)
    assert fj == _flags(scaling.found_inf) == {"1": False, "2": False, NONFINITE_VALUES: True}


def test_torch_boundary_equals_the_derivatives_engine_and_plain_fp16_at_scale_1():
    """torch only: the boundary's values and flags are torch_ref.Derivatives' (the scaled steps
    written by hand) at any power-of-two scales, and plain float16's bit for bit at scale 1."""
    amp = jaxamp.AmpConfig(dtype="float16")
    _, _, net = _pair(amp, 1)
    engine = torch_ref.Derivatives(net.module, inputs=("x",), outputs=("u",), derivatives=("u__x__x",),
                                   amp=amp.to_dict())
    scales = {"1": 0.5, "2": 2.0**-4}
    de, fe = engine(torch.from_numpy(PTS1), {k: torch.tensor(v) for k, v in scales.items()})
    scaling = torch_ref.Scaling(scales)
    vb = _torch_chain(net, scaling, PTS1, 2)
    assert _flags(fe) == _flags(scaling.found_inf)
    for k, name in enumerate(("u", "u__x", "u__x__x")):
        np.testing.assert_array_equal(de[name].detach().numpy(), vb[k][:, 0])
    plain = _torch_chain(lambda x, scaling: net.module(x), None, PTS1, 2)
    for a, b in zip(plain, _torch_chain(net, torch_ref.Scaling.ones(), PTS1, 2)):
        np.testing.assert_array_equal(a, b)


def test_weight_gradients_take_no_input_derivative_and_backward_names_the_fix():
    amp = jaxamp.AmpConfig(dtype="float16")
    _, _, net = _pair(amp, 1)

    def loss(scaling):
        x = torch.from_numpy(PTS1).requires_grad_(True)
        u = net(x, scaling=scaling)
        (u_x,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
        (u_xx,) = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)
        return torch.mean(u_xx**2) + torch.mean(u**2)

    scaling = torch_ref.Scaling({"1": 1.0, "2": 1.0})
    value = loss(scaling)
    before = _flags(scaling.found_inf)
    grads = torch.autograd.grad(value, list(net.parameters()))  # no key "3" needed, no flag written
    assert _flags(scaling.found_inf) == before and all(torch.isfinite(g).all() for g in grads)
    ref = torch.autograd.grad(loss(None), list(net.parameters()))
    for g, r in zip(grads, ref):
        assert float(torch.linalg.vector_norm(g - r)) <= _bound(3) * float(torch.linalg.vector_norm(r)) + 1e-6
    with pytest.raises(KeyError, match=r"no key '3'.*torch.autograd.grad\(loss, params\)"):
        loss(torch_ref.Scaling({"1": 1.0, "2": 1.0})).backward()  # x.requires_grad: an order-3 derivative


# Training: the 1-D Poisson of tests/helpers/poisson_pair.py with the boosted network, its
# derivatives by the user's own jax.grad / torch.autograd.grad. Measured (60 steps, lr 3e-4):
# skips 0-4 derivative overflow (key 2 backs off to 2^-5), 5-11 non-finite weight gradients
# (the loss scaler backs off), 25 derivative overflow (key 2's regrowth); trajectories equal;
# loss relative difference <= 1.8e-3 over the first 30 steps, 0.14 by step 56 (the boosted
# network amplifies float16's rounding differences as it trains).
TRAIN_AMP = jaxamp.AmpConfig(
    dtype="float16", autocast_firstlayer=True,
    derivative_scaler={"growth_interval": 20, "recover_growth_interval": 5},
    loss_scaler={"init_scale": 1.0, "max_scale": 16.0, "growth_interval": 40, "recover_threshold": 0.5,
                 "recover_growth_interval": 10})
TRAIN_LR, TRAIN_STEPS, LOSS_STEPS, LOSS_RTOL = 3e-4, 40, 30, 5e-3
XS = np.concatenate([np.linspace(0.0, 1.0, 34, dtype=np.float32)[1:-1], [0.0, 1.0]]).astype(np.float32)


def _jax_loss(u):
    def loss_fn(p, batch):
        X = batch["x"][:, None]
        u_xx = _jax_chain(u, 2)(p, X)[2][:, 0]
        r = u_xx[:-2] + jnp.pi**2 * jnp.sin(jnp.pi * batch["x"][:-2])
        pde, bc = jnp.mean(r**2), jnp.mean(u(p, X)[-2:, 0] ** 2)
        return pde + bc, {"pde": pde, "bc": bc}

    return loss_fn


def _torch_loss(model, batch, scales):
    scaling = torch_ref.Scaling(scales)
    x = torch.from_numpy(batch["x"])[:, None].requires_grad_(True)
    u = model(x, scaling=scaling)
    (u_x,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
    (u_xx,) = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)
    r = u_xx[:-2, 0] + math.pi**2 * torch.sin(math.pi * torch.from_numpy(batch["x"][:-2]))
    pde, bc = torch.mean(r**2), torch.mean(u[-2:, 0] ** 2)
    return pde + bc, ({"pde": pde, "bc": bc}, scaling.found_inf)


@pytest.mark.slow  # an end-to-end training run (fast-suite budget); CI runs it
def test_training_with_the_users_own_derivatives_skips_the_same_steps():
    u, params, net = _pair(TRAIN_AMP, 1, _boosted(init_params(1, 1, WIDTH, N_LAYERS, 0), 1600.0))
    loss_fn, batch = _jax_loss(u), {"x": XS}
    opt = optax.adam(optax.exponential_decay(TRAIN_LR, 100, 0.5))
    started = jaxamp.init(loss_fn, TRAIN_AMP, from_profile=False)(params, batch)
    found = torch_ref.Scaling.ones()  # the loss's keys, from one pass at scale 1
    x = torch.from_numpy(XS)[:, None].requires_grad_(True)
    (g,) = torch.autograd.grad(net(x, scaling=found), x, torch.ones(len(XS), 1), create_graph=True)
    torch.autograd.grad(g, x, torch.ones_like(g))
    assert found.keys == tuple(sorted(started.scales)) == ("1", "2")
    jstate = jaxamp.TrainState.create(params=params, optimizer=opt, amp=TRAIN_AMP, amp_state=started)
    jstep = jax.jit(jaxamp.make_train_step(loss_fn, opt, amp=TRAIN_AMP, grad_clip_max_norm=CLIP),
                    compiler_options=NO_EXCESS)
    jm = []
    with jax.default_matmul_precision("highest"):
        for _ in range(TRAIN_STEPS):
            jstate, m = jstep(jstate, {"x": jnp.asarray(XS)})
            jm.append(dict(m, trackers={k: s.growth_tracker for k, s in jstate.amp_state.derivative.items()},
                           loss_tracker=jstate.amp_state.loss.growth_tracker))
    jm = jax.device_get(jm)
    tstate = torch_ref.TrainState.create(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=TRAIN_LR),
                                         amp=TRAIN_AMP.to_dict(), keys=found.keys)
    tm = run_torch(tstate, torch_ref.make_train_step(_torch_loss, lr_schedule=schedule(TRAIN_LR),
                                                     grad_clip_max_norm=CLIP), range(TRAIN_STEPS), frozenset())
    assert trajectory(jm) == trajectory(tm)
    reasons = np.array([int(m["skip_reason"]) for m in tm])
    overflow = set(np.flatnonzero(reasons == int(jaxamp.SkipReason.DERIVATIVE_OVERFLOW)))
    assert {0, 1, 2, 3, 4} <= overflow and len(overflow) > 5  # the first backoffs and a regrowth's overflow
    ok = reasons[:LOSS_STEPS] == int(jaxamp.SkipReason.APPLIED)
    jl, tl = losses(jm)[:LOSS_STEPS], losses(tm)[:LOSS_STEPS]
    rel = np.abs(jl[ok] - tl[ok]) / np.abs(jl[ok])
    print(f"skips {np.flatnonzero(reasons).tolist()}; max loss rel diff {rel.max():.2e} over {LOSS_STEPS} steps")
    assert rel.max() < LOSS_RTOL
