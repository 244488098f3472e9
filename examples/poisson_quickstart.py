"""Quickstart (the README's example): a 1D Poisson PINN trained in fp16 with the DerivScaler.

    u''(x) = -pi^2 sin(pi x) on [0, 1], u(0) = u(1) = 0; exact u = sin(pi x).

Run: python -m examples.poisson_quickstart   (about a minute on a CPU; it writes no files and
ends with a one-line verdict: trained, or stalled and why)
"""

import jax, jax.numpy as jnp, optax  # noqa: E401
import jaxamp
from jaxamp.models import FullyConnected
from examples.common.verdict import verdict

amp = jaxamp.AmpConfig(dtype="float16")  # Modulus' amp: keys; one derivative scaler per order
model = FullyConnected.from_amp(amp, out_features=1, layer_size=64, nr_layers=3)
engine = jaxamp.Derivatives(lambda p, x: model.apply(p, x), inputs=("x",), outputs=("u",),
                            derivatives=("u__x__x",), amp=amp)


def loss_fn(params, x):  # u'' = -pi^2 sin(pi x), u(0) = u(1) = 0
    d = engine(params, {"x": x})  # fp32 values; the train step gives the scales, gets the flags
    ends = engine(params, {"x": jnp.array([0.0, 1.0])})
    pde = jnp.mean((d["u__x__x"] + jnp.pi**2 * jnp.sin(jnp.pi * x)) ** 2)
    bc = jnp.mean(ends["u"] ** 2)
    return pde + bc, {"pde": pde, "bc": bc}


optimizer = optax.adam(optax.cosine_decay_schedule(1e-3, 3000))
params = model.init(jax.random.PRNGKey(0), jnp.zeros(1))
state = jaxamp.TrainState.create(params=params, optimizer=optimizer, amp=amp, engines=[engine])
step = jax.jit(jaxamp.make_train_step(loss_fn, optimizer, amp=amp, grad_clip_max_norm=0.5))
x = jnp.linspace(0.0, 1.0, 128)
losses, skipped = [], 0
for i in range(3000):
    state, metrics = step(state, x)
    losses.append(metrics["loss"])
    skipped = skipped + metrics["skipped"]
    if i % 1000 == 999:  # log2 of each scale, by the key you configure: "loss", "1", "2"
        print(f"step {i + 1}: loss {float(metrics['loss']):.2e}, log2 scales",
              {k[11:]: int(v) for k, v in metrics.items() if k.startswith("scale_log2/")})
u, exact = model.apply(state.params, x[:, None])[:, 0], jnp.sin(jnp.pi * x)
print(f"relative L2 error: {float(jnp.linalg.norm(u - exact) / jnp.linalg.norm(exact)):.1e}")
print(verdict(3000, int(skipped), [float(v) for v in losses]))
