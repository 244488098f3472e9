"""Quickstart: a 1D Poisson PINN trained in fp16 with the DerivScaler (the README example).

    u''(x) = -pi^2 sin(pi x) on [0, 1], u(0) = u(1) = 0; exact u = sin(pi x).

Run: python -m examples.poisson_quickstart
"""

import jax
import jax.numpy as jnp
import optax

import jaxamp
from jaxamp.models import FullyConnected

amp = jaxamp.AmpConfig(dtype="float16")  # Modulus `amp:` keys; per-order derivative scalers
model = FullyConnected.from_amp(amp, out_features=1, layer_size=64, nr_layers=3)
engine = jaxamp.Derivatives(lambda p, x: model.apply(p, x), inputs=("x",), outputs=("u",),
                            derivatives=("u__x__x",), amp=amp)


def loss_fn(params, batch, scales):
    d, found_inf = engine(params, {"x": batch}, scales)  # fp32 values, per-key overflow flags
    pde = jnp.mean((d["u__x__x"] + jnp.pi**2 * jnp.sin(jnp.pi * batch)) ** 2)
    ends, _ = engine(params, {"x": jnp.array([0.0, 1.0])}, scales)
    bc = jnp.mean(ends["u"] ** 2)
    return pde + bc, ({"pde": pde, "bc": bc}, found_inf)


def main(steps: int = 3000) -> float:
    optimizer = optax.adam(optax.cosine_decay_schedule(1e-3, steps))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(1))
    state = jaxamp.TrainState.create(params=params, optimizer=optimizer, amp=amp, engines=[engine])
    step = jax.jit(jaxamp.make_train_step(loss_fn, optimizer, amp=amp))
    x = jnp.linspace(0.0, 1.0, 128)
    for i in range(steps):
        state, metrics = step(state, x)
        if i % 500 == 0 or i == steps - 1:
            print(f"step {i:5d}  loss {float(metrics['loss']):.3e}  skipped {bool(metrics['skipped'])}  "
                  f"log2 scales: loss {float(metrics['scale_log2/loss']):.0f}, "
                  f"u_x {float(metrics['scale_log2/1']):.0f}, u_xx {float(metrics['scale_log2/2']):.0f}")
    u = model.apply(state.params, x[:, None])[:, 0]
    exact = jnp.sin(jnp.pi * x)
    err = float(jnp.linalg.norm(u - exact) / jnp.linalg.norm(exact))
    print(f"relative L2 error vs sin(pi x): {err:.2e}")
    return err


if __name__ == "__main__":
    main()
