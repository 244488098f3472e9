"""Training runs on the physical-units Poisson (tests/helpers/physical.py) for the slow tests of
tests/test_recipes_physical.py and the measurements in docs/optax_recipes.md:

    python -m tests.helpers.physical_runs [--seeds 3] [--adam 300] [--lbfgs 40] [--gn 50]

prints, per seed, plain fp16's and fp16 + DerivScaler's Adam against fp32's, Adam then L-BFGS
(L-BFGS in float16, and the recipe: the boundary term and the L-BFGS finish in float32), and
Gauss-Newton, each as a relative L2 error of the trained weights evaluated in float32.
Width 16, depth 2, 32 points, ``jax_default_matmul_precision="highest"``.
"""

import argparse

import jax
import optax

import jaxamp

from tests.helpers import physical as P
from tests.helpers.gauss_newton import gauss_newton, gauss_newton_step

U32 = jaxamp.autocast(P.mlp, P.FP32)


def error(params):
    """The relative L2 error of the weights evaluated in float32 (in float16 the network's output
    alone is rounded to about 9e-4 of it, above what fp32 training reaches)."""
    return P.relative_error(U32, params)


def adam(amp, seed, steps, fp32_boundary=False, lr=1e-2):
    """``steps`` of Adam (cosine decay from ``lr``) through :func:`jaxamp.optimizer`, collocation
    grid shifted each step; returns ``(params, opt_state, skipped)``."""
    loss = P.problem(amp, fp32_boundary=fp32_boundary)[3]
    params = P.init_params(seed)
    tx = jaxamp.optimizer(optax.adam(optax.cosine_decay_schedule(lr, steps)),
                          amp_state=jaxamp.init(loss, amp)(params, P.batch()), on_stall=None)

    @jax.jit
    def step(params, opt_state, b):
        _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags)
        return optax.apply_updates(params, updates), opt_state

    opt_state, skipped = tx.init(params), 0
    for i in range(steps):
        params, opt_state = step(params, opt_state, P.batch(shift=(i % 7) / 7 - 0.5))
        skipped += int(opt_state.skip_reason) != 0
    return params, opt_state, skipped


def lbfgs_float16(params, adam_state, steps, fp32_boundary=False):
    """L-BFGS under fp16 + DerivScaler (the Adam run's scales carried over, the line search's
    ``value_fn`` run under them by the wrapper); returns ``(params, skipped)``."""
    loss = P.problem(adam_state.amp.amp, fp32_boundary=fp32_boundary)[3]
    tx, b = jaxamp.optimizer(optax.lbfgs(), amp_state=adam_state.amp, on_stall=None), P.batch()

    @jax.jit
    def step(params, opt_state):
        value, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags, value=value, grad=grads,
                                       value_fn=lambda p: loss(p, b))
        return optax.apply_updates(params, updates), opt_state

    opt_state, skipped = tx.init(params), 0
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
        skipped += int(opt_state.skip_reason) != 0
    return params, skipped


def lbfgs_float32(params, steps):
    """The finish of the recipe: optax's own L-BFGS loop on the same loss built with AMP off."""
    loss, b = P.problem(P.FP32)[3], P.batch()
    tx = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(lambda p: loss(p, b))

    @jax.jit
    def step(params, opt_state):
        value, grads = value_and_grad(params, state=opt_state)
        updates, opt_state = tx.update(grads, opt_state, params, value=value, grad=grads,
                                       value_fn=lambda p: loss(p, b))
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return params


def gauss_newton_run(amp, seed, steps, fp32_boundary=False):
    """``steps`` damped Gauss-Newton steps from the initial weights; returns ``(params, skipped)``."""
    _, residuals, _, loss = P.problem(amp, fp32_boundary=fp32_boundary)
    params = P.init_params(seed)
    tx = jaxamp.optimizer(gauss_newton(), amp_state=jaxamp.init(loss, amp)(params, P.batch()), on_stall=None)
    step = gauss_newton_step(tx, residuals, loss)
    opt_state, skipped = tx.init(params), 0
    for i in range(steps):
        params, opt_state, _ = step(params, opt_state, P.batch(shift=(i % 7) / 7 - 0.5))
        skipped += int(opt_state.skip_reason) != 0
    return params, skipped


def recipe(seed, adam_steps, lbfgs_steps):
    """Adam then L-BFGS as docs/optax_recipes.md recommends, and fp32's: ``(ours, fp32)`` errors."""
    params, _, _ = adam(P.DERIV_SCALER, seed, adam_steps, fp32_boundary=True)
    ref, _, _ = adam(P.FP32, seed, adam_steps)
    return error(lbfgs_float32(params, lbfgs_steps)), error(lbfgs_float32(ref, lbfgs_steps))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--adam", type=int, default=300)
    p.add_argument("--lbfgs", type=int, default=40)
    p.add_argument("--gn", type=int, default=50)
    args = p.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    for seed in range(args.seeds):
        row = {}
        runs = (("fp32", P.FP32, False), ("plain_fp16", P.PLAIN_FP16, False), ("derivscaler", P.DERIV_SCALER, False),
                ("derivscaler_fp32_boundary", P.DERIV_SCALER, True))
        for name, amp, bc in runs:
            params, state, skipped = adam(amp, seed, args.adam, fp32_boundary=bc)
            row[f"adam/{name}"] = (error(params), skipped)
            if name == "fp32":
                row["adam+lbfgs/fp32"] = (error(lbfgs_float32(params, args.lbfgs)), 0)
            if name.startswith("derivscaler"):
                lb, lb_skipped = lbfgs_float16(params, state, args.lbfgs, fp32_boundary=bc)
                row[f"adam+lbfgs_fp16/{name}"] = (error(lb), skipped + lb_skipped)
            if name == "derivscaler_fp32_boundary":
                row["adam+lbfgs_fp32/recipe"] = (error(lbfgs_float32(params, args.lbfgs)), skipped)
        for name, amp, bc in (("fp32", P.FP32, False), ("derivscaler", P.DERIV_SCALER, False),
                              ("derivscaler_fp32_boundary", P.DERIV_SCALER, True)):
            params, skipped = gauss_newton_run(amp, seed, args.gn, fp32_boundary=bc)
            row[f"gauss_newton/{name}"] = (error(params), skipped)
        for k, (e, s) in row.items():
            print(f"seed {seed} {k:42s} error {e:.3e} skipped {s}", flush=True)


if __name__ == "__main__":
    main()
