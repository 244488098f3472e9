"""1-D Poisson PINN in Flax NNX: u'' = -pi^2 sin(pi x) on (0, 1), u(0) = u(1) = 0 (u = sin(pi x)).
The network is an ``nnx.Module``, a pytree: differentiated as a function by
``jax.grad(jax.grad(model))``, trained by ``jax.value_and_grad`` of the module, ``jax.jit`` and
optax on the module itself. fp16.py is its float16 + DerivScaler port (examples/nnx_user).

    python -m examples.nnx_user.fp32 --steps 2000   (from the repository root)
"""

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx
import jaxamp

amp = jaxamp.AmpConfig()  # fp16 + DerivScaler; AmpConfig(enabled=False): this program in float32


class PINN(nnx.Module):
    def __init__(self, rngs, width=32):
        self.body = nnx.Sequential(nnx.Linear(1, width, rngs=rngs), jnp.tanh, nnx.Linear(width, width, rngs=rngs),
                                   jnp.tanh, nnx.Linear(width, width, rngs=rngs), jnp.tanh,
                                   nnx.Linear(width, 1, rngs=rngs))

    def __call__(self, x):
        return jaxamp.autocast(self.body, amp)(jnp.reshape(x, (1,)))[0]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--points", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = PINN(nnx.Rngs(args.seed))

    def residual(model, x):
        u_xx = jaxamp.grad(jaxamp.grad(model))(x)
        return u_xx + jnp.pi**2 * jnp.sin(jnp.pi * x)

    def loss_fn(model, x):
        pde = jnp.mean(jax.vmap(residual, (None, 0))(model, x) ** 2)
        bc = jnp.mean(jax.vmap(model)(jnp.array([0.0, 1.0])) ** 2)
        return pde + bc

    def sample(key):
        return jax.random.uniform(key, (args.points,))

    key, losses = jax.random.PRNGKey(args.seed + 1), []
    amp_state = jaxamp.init(loss_fn, amp)(model, sample(key))
    optim = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state)
    opt_state = optim.init(model)

    @jax.jit
    def train_step(model, opt_state, x):
        loss, grads, flags = jaxamp.value_and_grad(loss_fn)(opt_state, model, x)
        updates, opt_state = optim.update(grads, opt_state, model, flags=flags)
        return optax.apply_updates(model, updates), opt_state, loss

    for step in range(args.steps):
        model, opt_state, loss = train_step(model, opt_state, sample(jax.random.fold_in(key, step)))
        losses.append(float(loss))
        if step % 500 == 0 or step == args.steps - 1:
            print(f"step {step} loss {losses[-1]:.3e}")

    x = jnp.linspace(0.0, 1.0, 256)
    error = float(jnp.linalg.norm(jax.vmap(model)(x) - jnp.sin(jnp.pi * x)) / jnp.linalg.norm(jnp.sin(jnp.pi * x)))
    print(f"relative L2 error {error:.3e}")
    return {"error": error, "losses": losses, "model": model}


if __name__ == "__main__":
    main()
