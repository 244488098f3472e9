"""Per-term scaling in the forward engine: one pass per input path, shared by every term.

Terms along the same inputs (``u__x``, ``v__x``, ``p__x``; ``u__x__x``, ``v__x__x``) share one
forward pass whose step scales are the smallest of theirs; each term's scaled result for the
check is its value times its own scale as float16 holds it (docs/algorithm.md, "Engines").
What must hold: the cost is per order's (XLA FLOPs), the values are the reverse engine's to
float16 rounding, and the flags are sound: a key the shared passes flag is flagged by its
term's own forward pass too, or its scaled result is beyond float16's range (no spurious
skips), and a term no flag guards has finite values that agree with float32 (a missed
overflow of a term's own pass is one the shared pass avoided).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES
from jaxamp.models import FullyConnected

INPUTS, OUTPUTS = ("x", "y"), ("u", "v", "p")
# Two outputs' second orders along x share a pass with p's first order (a prefix); u__x__y is
# a pass of its own.
NAMES = ("u__x", "v__x", "p__x", "u__x__x", "v__x__x", "u__x__y")
FP16_ROUNDING = 4e-3


@pytest.fixture(scope="module")
def setup():
    amp = jaxamp.AmpConfig(mode="per_term_scaler")
    net = FullyConnected.from_amp(amp, out_features=3, layer_size=16, nr_layers=2)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros(2))
    fn = lambda p, x: net.apply(p, x)  # noqa: E731
    engines = {m: jaxamp.Derivatives(fn, inputs=INPUTS, outputs=OUTPUTS, derivatives=NAMES, amp=amp, method=m)
               for m in ("forward", "reverse")}
    f32 = FullyConnected.from_amp(jaxamp.AmpConfig(enabled=False), out_features=3, layer_size=16, nr_layers=2)
    exact = jaxamp.Derivatives(lambda p, x: f32.apply(p, x), inputs=INPUTS, outputs=OUTPUTS, derivatives=NAMES)
    x = 3.0 * jax.random.uniform(jax.random.PRNGKey(1), (16, 2), minval=-1.0, maxval=1.0)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(exact)(params, x)
    return engines, params, x, ref, {m: jax.jit(jaxamp.scaled(e)) for m, e in engines.items()}


def _flags(found):
    return {k for k, v in found.items() if bool(v)}


@pytest.mark.slow
def test_per_term_costs_what_per_order_costs(setup):
    engines, params, x, _, _ = setup
    order = jaxamp.Derivatives(engines["forward"].fn, inputs=INPUTS, outputs=OUTPUTS, derivatives=NAMES,
                               amp=jaxamp.AmpConfig())

    def flops(eng):
        scales = {k: jnp.float32(1.0) for k in eng.scaler_keys}
        loss = lambda p: sum(jnp.sum(v) for v in jaxamp.scaled(eng)(scales, p, x)[0].values())  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params).compile().cost_analysis()["flops"]

    term, per_order = flops(engines["forward"]), flops(order)
    assert len(engines["forward"].scaler_keys) > len(order.scaler_keys)
    # The extra work is each term's scale multiply and float16 cast for its check, per point:
    # about 5 % of this 2x16 network's step (separate passes per term cost 2.2x at 4x64).
    assert term <= 1.10 * per_order, (term, per_order)


def test_values_equal_the_reverse_engine_with_a_scale_per_key(setup):
    engines, params, x, ref, run = setup
    keys = engines["forward"].scaler_keys
    scales = {k: jnp.float32(2.0 ** -(i % 5)) for i, k in enumerate(keys)}  # different scales per key
    fwd, fwd_found = run["forward"](scales, params, x)
    rev, rev_found = run["reverse"](scales, params, x)
    assert _flags(fwd_found) == _flags(rev_found) == set()
    for n in NAMES:
        tol = FP16_ROUNDING * float(jnp.max(jnp.abs(ref[n])))
        np.testing.assert_allclose(fwd[n], rev[n], rtol=0, atol=tol, err_msg=n)
        np.testing.assert_allclose(fwd[n], ref[n], rtol=0, atol=2 * tol, err_msg=n)


@pytest.fixture(scope="module")
def own_passes(setup):
    """Each term's own forward pass (the engine without sharing): a per-order engine for that
    derivative alone, its step scales ``"1"``, ``"2"`` set to the term's path's keys.
    ``own_passes(scales)`` is ``{derivative: steps flagged in its own pass (1-based)}``."""
    engines, params, x, _, _ = setup
    fwd = engines["forward"]
    one = {n: jax.jit(jaxamp.scaled(jaxamp.Derivatives(fwd.fn, inputs=INPUTS, outputs=OUTPUTS, derivatives=(n,),
                                                       amp=jaxamp.AmpConfig()))) for n in NAMES}

    def flags(scales):
        out = {}
        for n, path in fwd.plan.paths.items():
            _, found = one[n]({str(k + 1): scales[key] for k, (key, _) in enumerate(path)}, params, x)
            out[n] = {k + 1 for k in range(len(path)) if bool(found[str(k + 1)])}
        return out

    return flags


def _own_keys(engine, own):
    """The keys that the terms' own passes flag (the key of each flagged step)."""
    return {engine.plan.paths[n][k - 1][0] for n, steps in own.items() for k in steps}


@pytest.mark.slow
def test_one_terms_too_large_scale_flags_that_key_only(setup, own_passes):
    engines, params, x, _, run = setup
    scales = {k: jnp.float32(1.0) for k in engines["forward"].scaler_keys}
    scales["v__x"] = jnp.float32(2.0**20)  # v__x__x's own scaled result leaves float16's range
    fwd, found = run["forward"](scales, params, x)
    assert _flags(found) == {"v__x"} == _own_keys(engines["forward"], own_passes(scales))
    assert all(bool(jnp.all(jnp.isfinite(fwd[n]))) for n in NAMES)  # the shared pass did not overflow


@pytest.mark.slow
def test_equal_scales_flag_what_the_own_passes_flag(setup, own_passes):
    engines, params, x, _, run = setup
    for log2 in (15, 20):
        scales = {k: jnp.float32(2.0**log2) for k in engines["forward"].scaler_keys}
        _, found = run["forward"](scales, params, x)
        assert _flags(found) - {NONFINITE_VALUES} == _own_keys(engines["forward"], own_passes(scales)) != set()


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_flags_are_sound_for_random_scales(setup, own_passes):
    """Over many scale assignments (2**-4 to 2**20 per key): every key the shared passes flag
    is a real overflow, and every term no flag guards has finite values close to float32's."""
    engines, params, x, ref, run = setup
    keys = engines["forward"].scaler_keys
    rng = np.random.default_rng(0)
    seen_flagged, seen_clean = 0, 0
    for _ in range(8):
        log2 = rng.integers(-4, 21, size=len(keys))
        scales = {k: jnp.float32(2.0 ** int(e)) for k, e in zip(keys, log2)}
        fwd, found = run["forward"](scales, params, x)
        flagged = _flags(found) - {NONFINITE_VALUES}
        # Every flag is real: the key guards a term whose own pass overflows (at this step or,
        # hiding it, at an earlier one), or whose scaled result (float32 reference value
        # times the key's scale) is beyond float16's range.
        own = own_passes(scales)
        real = {path[-1][0] for n, path in engines["forward"].plan.paths.items()
                if own[n]
                or float(jnp.max(jnp.abs(ref[n]))) * float(scales[path[-1][0]]) >= 65504.0 * (1 - FP16_ROUNDING)}
        assert flagged <= real, dict(zip(keys, log2))
        for n, path in engines["forward"].plan.paths.items():
            if any(key in flagged for key, _ in path):
                seen_flagged += 1
                continue
            seen_clean += 1
            # Finite, and close: a term shares the precision of the pass's smallest scale, and
            # scales 2**20 apart push some of its float16 tangents towards subnormals.
            assert bool(jnp.all(jnp.isfinite(fwd[n]))), n
            np.testing.assert_allclose(fwd[n], ref[n], rtol=0, atol=0.05 * float(jnp.max(jnp.abs(ref[n]))), err_msg=n)
    assert seen_flagged and seen_clean  # both branches were exercised


def test_shared_scales_take_the_smallest_ratio_per_step():
    from jaxamp._src.derivatives.forward_engine import shared_scales

    per_path = [[jnp.float32(1.0), jnp.float32(1.0)], [jnp.float32(0.25), jnp.float32(0.5)]]
    c1, c2 = shared_scales(per_path)
    assert float(c1) == 0.25 and float(c2) == 0.25  # ratios 1 and 2: the smaller, 1
    for path in per_path:  # every tangent of the shared chain carries no more than the path's own
        assert float(c1) <= float(path[0]) and float(c2) <= float(path[1])
        assert float(c2 / c1) <= float(path[1] / path[0])
    assert [float(c) for c in shared_scales([[jnp.float32(4.0)], per_path[1]])] == [0.25, 0.5]  # a shorter path
