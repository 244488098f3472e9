"""2-D Poisson PINN in physical units on Flax's TrainState: fp32.py, and its float16 port fp16.py.

-lap(u) = f on the square plate [0, L]^2 (L = --length metres, 2 mm by default), u = 0 on its
edges, f = 2 (pi/L)^2 sin(pi x/L) sin(pi y/L), so u = sin(pi x/L) sin(pi y/L). The code is
written the way a Flax user writes it: a flax.linen tanh MLP on the physical (x, y) whose first
layer's weights start at the plate's scale (N(0, 1/L^2)), the Laplacian as the trace of
jax.hessian under vmap, the residual made dimensionless (times L^2) in the loss, optax adam
with cosine decay, and flax.training.train_state.TrainState with
state.apply_gradients(grads=grads). In these units the Laplacian is about 2 (pi/L)^2 = 4.9e6
at the solution and already past float16's 65504 at initialization.
fp16.py differs from fp32.py by the lines a port to float16 + DerivScaler needs (its
--plain-fp16: the same port without derivative scaling, for comparison): the network under
autocast, the scaled hessian, one AMP state started from a float32 profile of the loss on a first
batch, the optimizer wrapped so that it skips an overflowing step and advances the scalers,
the scaled value_and_grad and the update with its flags in the train step. The port runs the first
layer in float16 too (autocast_firstlayer=True, as a policy casting everything would), so plain
fp16 overflows from step 0 and never trains.

    python -m examples.flax_user.fp32 --steps 1500   (from the repository root)
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from examples.common.verdict import port_verdict


class MLP(nn.Module):
    length: float  # the plate's size: the first layer's weights start at its scale, 1/L
    width: int = 64
    depth: int = 3

    @nn.compact
    def __call__(self, z):  # z: physical coordinates (m)
        h = jnp.tanh(nn.Dense(self.width, kernel_init=nn.initializers.normal(1 / self.length))(z))
        for _ in range(self.depth - 1):
            h = jnp.tanh(nn.Dense(self.width)(h))
        return nn.Dense(1)(h)[0]


def exact(z, length):
    return jnp.prod(jnp.sin(jnp.pi * z / length), axis=-1)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--length", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    L = args.length

    model = MLP(length=L)
    params = model.init(jax.random.PRNGKey(args.seed), jnp.zeros(2))
    u_net = model.apply

    def residual(params, z):
        lap = jnp.trace(jax.hessian(u_net, argnums=1)(params, z))
        return L**2 * (lap + 2 * (jnp.pi / L) ** 2 * exact(z, L))  # dimensionless

    def loss_fn(params, batch):
        pde = jnp.mean(jax.vmap(residual, (None, 0))(params, batch["interior"]) ** 2)
        bc = jnp.mean(jax.vmap(u_net, (None, 0))(params, batch["edges"]) ** 2)
        return pde + 100.0 * bc

    def sample(key, n=512, m=256):
        k1, k2, k3 = jax.random.split(key, 3)
        s = jax.random.uniform(k1, (m,))
        side = jax.random.randint(k2, (m,), 0, 4)
        edges = jnp.stack([jnp.where(side < 2, s, side - 2), jnp.where(side < 2, side, s)], -1)
        return {"interior": L * jax.random.uniform(k3, (n, 2)), "edges": L * edges}

    schedule = optax.cosine_decay_schedule(1e-2, args.steps)
    tx = optax.adam(schedule)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        state = state.apply_gradients(grads=grads)
        return state, loss

    key, logged = jax.random.PRNGKey(args.seed + 1), []
    for step in range(args.steps):
        state, loss = train_step(state, sample(jax.random.fold_in(key, step)))
        if step % 250 == 0 or step == args.steps - 1:
            logged.append(float(loss))
            print(f"step {step} loss {float(loss):.3e}")

    g = jnp.linspace(0.0, L, 64)
    z = jnp.stack([c.ravel() for c in jnp.meshgrid(g, g)], -1)
    u, ref = jax.vmap(u_net, (None, 0))(state.params, z), exact(z, L)
    error = float(jnp.linalg.norm(u - ref) / jnp.linalg.norm(ref))
    print(f"relative L2 error {error:.3e}")
    print(port_verdict(params, state.params, logged, args.steps))  # stalled when every step was skipped
    return {"error": error, "loss": float(loss)}


if __name__ == "__main__":
    main()
