"""AmpConfig.recompute_float32 (jaxamp._src.placement.recompute.py): the weight gradient's backward
pass keeps only 16-bit matmul outputs and the parameters' 16-bit casts, recomputes every float32
value from them, and gives the stored step's numbers bit for bit (float16 rounded as written: no
excess precision)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

import jaxamp
from jaxamp import AmpConfig, ConfigError
from jaxamp._src.placement.recompute import SAVED, Saved16, WEIGHT_CAST, recomputed_grad
from jaxamp.models import FullyConnected

STRICT = {"xla_allow_excess_precision": False}


def _native_float16() -> bool:
    """Whether the CPU computes float16 natively (AVX512-FP16): XLA then contracts float16
    multiply-adds inside a fusion, rounded once, where another program's fusion rounds twice."""
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_fp16" in f.read()
    except OSError:
        return False


class MLP(nn.Module):
    @nn.compact
    def __call__(self, z):
        for _ in range(3):
            z = jnp.tanh(nn.Dense(32)(z))
        return nn.Dense(1)(z)


def _poisson(amp):
    """A Poisson-style loss (u_xx by nested jaxamp.grad, boundary values) of an autocast Flax MLP."""
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))
    net = jaxamp.autocast(model.apply, amp)
    u = lambda p, x, y: net(p, jnp.stack([x, y]))[0]  # noqa: E731
    u_xx = jaxamp.grad(jaxamp.grad(u, 1, of="u", wrt="x"), 1, wrt="x")

    def loss(p, points):
        x, y = points[:, 0], points[:, 1]
        return jnp.mean(jax.vmap(u_xx, (None, 0, 0))(p, x, y) ** 2) + jnp.mean(jax.vmap(u, (None, 0, 0))(p, x, y) ** 2)

    return loss, params


def _cavity(amp):
    """A cavity-style loss: a FullyConnected SiLU network's second derivatives by jaxamp.Derivatives."""
    model = FullyConnected.from_amp(amp, out_features=2, layer_size=32, nr_layers=3)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2)))
    derive = jaxamp.Derivatives(lambda p, x: model.apply(p, x), inputs=("x", "y"), outputs=("u", "v"),
                                derivatives=("u__x__x", "v__y__y", "u__y"), amp=amp)

    def loss(p, points):
        d = derive(p, points)
        return jnp.mean((d["u__x__x"] + d["v__y__y"]) ** 2) + jnp.mean(d["u__y"] ** 2)

    return loss, params


def _step(make, amp, points):
    loss, params = make(amp)
    state = jaxamp.init(loss, amp)(params, points)
    vg = jax.jit(jaxamp.value_and_grad(loss))
    return vg.lower(state, params, points).compile(compiler_options=STRICT)(state, params, points), \
        jax.make_jaxpr(jaxamp.value_and_grad(loss))(state, params, points)


def _remats(jaxpr):
    """The recomputations under SAVED in ``jaxpr`` and its sub-jaxprs."""
    found = [e for e in jaxpr.eqns if e.primitive is jp.remat_p and isinstance(e.params["policy"], Saved16)]
    return found + [e for sub in jcore.subjaxprs(jaxpr) for e in _remats(sub)]


ALL16 = AmpConfig(autocast_activation=True, autocast_firstlayer=True)


@pytest.mark.parametrize("make", [_poisson, pytest.param(_cavity, marks=pytest.mark.slow)],
                         ids=["flax_tanh_autocast", "fully_connected_silu"])
@pytest.mark.parametrize("amp", [AmpConfig(), pytest.param(ALL16, marks=pytest.mark.slow)], ids=["default", "all16"])
def test_recomputed_step_is_the_stored_step_bit_for_bit(make, amp):
    points = jax.random.uniform(jax.random.PRNGKey(1), (48, 2))
    got, jaxpr = _step(make, amp, points)
    want, stored = _step(make, amp.__class__(**{**amp.to_dict(), "recompute_float32": False}), points)
    assert _remats(jaxpr.jaxpr) and not _remats(stored.jaxpr)  # the option is what differs
    (loss, grads, flags), (want_loss, want_grads, want_flags) = got, want
    assert float(loss) == float(want_loss)  # the forward pass is the same program
    for a, b in zip(jax.tree_util.tree_leaves(flags), jax.tree_util.tree_leaves(want_flags)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pairs = list(zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)))
    assert len(pairs) >= 8 and all(bool(jnp.all(jnp.isfinite(a))) for a, _ in pairs)
    # every activation in float16 on a CPU with native float16 arithmetic: the two programs fuse a
    # float16 multiply-add differently (docs/algorithm.md, "One graph"): a float16 ulp of the leaf
    eps = np.finfo(np.float16 if amp.autocast_activation and _native_float16() else np.float32).eps
    for a, b in pairs:
        # the same float32 values; XLA's CPU backend may sum a weight gradient over the points in
        # another order in the two programs: at most a few float32 ulps of the leaf's largest entry
        ulp = float(jnp.max(jnp.abs(b))) * eps
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=4 * ulp)


def _layer(params, x):
    """A float32 first layer, a float16 matmul (a named weight cast), float32 tanh."""
    w16 = jax.ad_checkpoint.checkpoint_name(params["w2"].astype(jnp.float16), WEIGHT_CAST)
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    z = (h.astype(jnp.float16) @ w16).astype(jnp.float32) + params["b2"]
    return jnp.sum(jnp.tanh(z) ** 2), None


def _layer_args():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (2, 16)), "b1": jnp.zeros(16), "w2": jax.random.normal(k2, (16, 16)) / 4,
              "b2": jnp.ones(16) / 8}
    return params, jax.random.normal(k3, (40, 2))


def _saved(fun, *args, capsys):
    """The values the backward pass of ``fun`` keeps, other than its arguments (JAX's report)."""
    jax.ad_checkpoint.print_saved_residuals(fun, *args)
    lines = capsys.readouterr().out.splitlines()
    return sorted(line.split(" ")[0] for line in lines if "from the argument" not in line)


def test_policy_saves_only_16bit_matmul_outputs_and_weight_casts(capsys):
    params, x = _layer_args()
    loss = lambda p, x: _layer(p, x)[0]  # noqa: E731
    assert _saved(jax.checkpoint(loss, policy=SAVED), params, x, capsys=capsys) == ["f16[16,16]", "f16[40,16]"]
    # without it: the float32 tanh outputs (and their derivative factors) are kept
    assert "f32[40,16]" in _saved(loss, params, x, capsys=capsys)


def test_barriers_only_on_the_differentiated_arguments():
    params, x = _layer_args()
    closed = jax.make_jaxpr(recomputed_grad(_layer, 0))(params, x)
    (remat,) = _remats(closed.jaxpr)
    barrier = {v: b for v, b in zip(remat.invars, remat.params["prevent_cse"]) if isinstance(v, jcore.Var)}
    params_vars = set(closed.jaxpr.invars[:4])
    assert params_vars & set(barrier) and all(b == (v in params_vars) for v, b in barrier.items())
    saved = sorted(v.aval.str_short() for v in barrier if v not in closed.jaxpr.invars)
    assert saved == ["float16[16,16]", "float16[40,16]"]  # the weight cast and the matmul's output: no barrier
    grads, aux = recomputed_grad(_layer, 0)(params, x)
    want, _ = jax.grad(_layer, has_aux=True)(params, x)
    assert aux is None
    for k in params:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-6, atol=1e-6)


def test_recompute_float32_is_a_validated_key():
    assert AmpConfig().recompute_float32 and AmpConfig().recomputes
    assert not AmpConfig(recompute_float32=False).recomputes
    assert AmpConfig(dtype="bfloat16").recomputes and not AmpConfig(enabled=False).recomputes
    assert not AmpConfig(dtype="float8").recomputes and not AmpConfig(tensor_scaling=True).recomputes
    assert AmpConfig.from_dict({"recompute_float32": False}) == AmpConfig(recompute_float32=False)
    with pytest.raises(ConfigError, match="amp.recompute_float32='yes' is not allowed: expected true or false"):
        AmpConfig(recompute_float32="yes")
