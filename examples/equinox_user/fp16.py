"""1-D Poisson PINN in Equinox, as its tutorials write one: u'' = -pi^2 sin(pi x) on (0, 1),
u(0) = u(1) = 0 (u = sin(pi x)). The network is an ``eqx.Module``, differentiated as a function
by ``jax.grad(jax.grad(net))``; the step uses ``eqx.filter_value_and_grad`` and
``eqx.filter_jit``. fp16.py is its float16 + DerivScaler port (examples/equinox_user).

    python -m examples.equinox_user.fp32 --steps 2000   (from the repository root)
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import jaxamp

amp = jaxamp.AmpConfig()  # fp16 + DerivScaler; AmpConfig(enabled=False): this program in float32


class PINN(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, key, width=32, depth=3):
        self.mlp = eqx.nn.MLP("scalar", "scalar", width, depth, activation=jax.nn.tanh, key=key)

    def __call__(self, x):
        return jaxamp.autocast(self.mlp, amp)(x)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--points", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    net = PINN(jax.random.PRNGKey(args.seed))

    def residual(net, x):
        u_xx = jaxamp.grad(jaxamp.grad(net))(x)
        return u_xx + jnp.pi**2 * jnp.sin(jnp.pi * x)

    def loss_fn(net, x):
        pde = jnp.mean(jax.vmap(residual, (None, 0))(net, x) ** 2)
        bc = jnp.mean(jax.vmap(net)(jnp.array([0.0, 1.0])) ** 2)
        return pde + bc

    def sample(key):
        return jax.random.uniform(key, (args.points,))

    key, losses = jax.random.PRNGKey(args.seed + 1), []
    amp_state = jaxamp.init(loss_fn, amp)(net, sample(key))
    optim = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state)
    opt_state = optim.init(eqx.filter(net, eqx.is_array))

    @eqx.filter_jit
    def train_step(net, opt_state, x):
        loss, grads, flags = jaxamp.value_and_grad(loss_fn)(opt_state, net, x)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(net, eqx.is_array),
                                          flags=flags)
        return eqx.apply_updates(net, updates), opt_state, loss

    for step in range(args.steps):
        net, opt_state, loss = train_step(net, opt_state, sample(jax.random.fold_in(key, step)))
        losses.append(float(loss))
        if step % 500 == 0 or step == args.steps - 1:
            print(f"step {step} loss {losses[-1]:.3e}")

    x = jnp.linspace(0.0, 1.0, 256)
    error = float(jnp.linalg.norm(jax.vmap(net)(x) - jnp.sin(jnp.pi * x)) / jnp.linalg.norm(jnp.sin(jnp.pi * x)))
    print(f"relative L2 error {error:.3e}")
    return {"error": error, "losses": losses, "net": net}


if __name__ == "__main__":
    main()
