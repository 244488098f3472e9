"""Viscous Burgers PINN written the way a JAX user writes one: fp32.py, and its float16 port fp16.py.

u_t + u u_x = nu u_xx on t in [0, T], x in [-X, X], u = 0 on x = +-X, with the exact
solution of Cole-Hopf for phi = a + exp(-nu pi^2 t) cos(pi x): scalar u_net(params, t, x) on
the physical (t, x), Fourier features cos(z @ b), sin(z @ b) with b ~ N(0, (2 pi / X)^2) (the
domain's length scale in the first layer's weights, as jaxpi's FourierEmbs), residual by nested
jax.grad under vmap, own train loop, optax adam with exponential decay, and loss weights from
the gradient norms of the loss terms (jax.jacrev), updated every 100 steps. --domain-scale 0.02
states the same problem in physical units (domain x 0.02, nu x 0.02): |b| ~ 300 and |u_xx| at
initialization is past float16's 65504.
fp16.py differs from fp32.py by the lines a port to float16 + DerivScaler needs (its
--plain-fp16: the same port without derivative scaling, for comparison): the network under
autocast, the derivatives by the scaled siblings of jax.grad, one AMP state started from a
float32 profile of the losses on a first batch, the optimizer wrapped so that it skips an
overflowing step and advances the scalers, the loss-weight update skipped on overflow. The port
runs the first layer in float16 too (autocast_firstlayer=True, as a jmp policy casting
everything would), so in physical units plain fp16 overflows from step 0 and never trains.

    python -m examples.jax_user.fp32 --steps 1500 --domain-scale 0.02   (from the repository root)
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import jaxamp

from examples.common.verdict import port_verdict


class MLP(nn.Module):
    width: int = 64
    depth: int = 3
    fourier_features: int = 32
    fourier_sigma: float = 2 * jnp.pi

    @nn.compact
    def __call__(self, z):
        b = self.param("fourier", nn.initializers.normal(self.fourier_sigma), (z.shape[-1], self.fourier_features))
        h = jnp.concatenate([jnp.cos(z @ b), jnp.sin(z @ b)], -1)
        for _ in range(self.depth):
            h = jnp.tanh(nn.Dense(self.width)(h))
        return nn.Dense(1)(h)[0]


def exact(t, x, nu, a=1.5):
    e = jnp.exp(-nu * jnp.pi**2 * t)
    return 2 * nu * jnp.pi * e * jnp.sin(jnp.pi * x) / (a + e * jnp.cos(jnp.pi * x))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--domain-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plain-fp16", action="store_true")
    args = p.parse_args(argv)
    amp = jaxamp.AmpConfig(derivative_scaling=not args.plain_fp16, autocast_firstlayer=True)
    c = args.domain_scale
    T, X, NU = 1.0 * c, 1.0 * c, 0.1 * c  # u(t, x) = exact(t / c, x / c, 0.1)

    model = MLP(fourier_sigma=2 * jnp.pi / X)  # Fourier features of the domain's length scale
    params = model.init(jax.random.PRNGKey(args.seed), jnp.zeros(2))

    def u_net(params, t, x):
        return jaxamp.autocast(model.apply, amp)(params, jnp.stack([t, x]))

    def r_net(params, t, x):
        u = u_net(params, t, x)
        u_t, u_x = jaxamp.grad(u_net, argnums=(1, 2))(params, t, x)
        u_xx = jaxamp.grad(jaxamp.grad(u_net, argnums=2), argnums=2)(params, t, x)
        return u_t + u * u_x - NU * u_xx

    def losses(params, batch):
        r = jax.vmap(r_net, (None, 0, 0))(params, batch["t"], batch["x"])
        u0 = jax.vmap(u_net, (None, None, 0))(params, 0.0, batch["x0"])
        ub = jax.vmap(u_net, (None, 0, None))(params, batch["tb"], X) ** 2
        ub = ub + jax.vmap(u_net, (None, 0, None))(params, batch["tb"], -X) ** 2
        return {"res": jnp.mean(r**2), "ic": jnp.mean((u0 - exact(0.0, batch["x0"] / X, 0.1)) ** 2), "bc": jnp.mean(ub)}

    def loss_fn(params, weights, batch):
        terms = losses(params, batch)
        return sum(weights[k] * terms[k] for k in terms)

    def sample(key, n=256):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return {"t": T * jax.random.uniform(k1, (n,)), "x": X * jax.random.uniform(k2, (n,), minval=-1.0),
                "x0": X * jax.random.uniform(k3, (n // 2,), minval=-1.0), "tb": T * jax.random.uniform(k4, (n // 4,))}

    schedule = optax.exponential_decay(1e-3, transition_steps=1000, decay_rate=0.9)
    amp_state = jaxamp.init(losses, amp)(params, sample(jax.random.PRNGKey(0)))  # from a profile
    optimizer = jaxamp.optimizer(optax.chain(optax.adam(schedule)), amp_state=amp_state)
    opt_state = optimizer.init(params)
    weights = {"res": 1.0, "ic": 1.0, "bc": 1.0}

    @jax.jit
    def update_weights(state, batch):
        params, opt_state, weights = state
        grads, found = jaxamp.scaled(jax.jacrev(losses))(opt_state, params, batch)
        norms = {k: optax.tree.norm(g) for k, g in grads.items()}
        new = {k: sum(norms.values()) / norms[k] for k in norms}
        new = jax.tree.map(lambda w, n: 0.9 * w + 0.1 * n, weights, new)
        return params, opt_state, jaxamp.apply_or_skip(opt_state, None, found, new, weights)[0]

    @jax.jit
    def train_step(state, batch):
        params, opt_state, weights = state
        loss, grads, flags = jaxamp.value_and_grad(loss_fn)(opt_state, params, weights, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params, flags=flags)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, weights), loss

    state, key = (params, opt_state, weights), jax.random.PRNGKey(args.seed + 1)
    logged = []
    for step in range(args.steps):
        batch = sample(jax.random.fold_in(key, step))
        if step % 100 == 0:
            state = update_weights(state, batch)
        state, loss = train_step(state, batch)
        if step % 500 == 0 or step == args.steps - 1:
            logged.append(float(loss))
            print(f"step {step} loss {float(loss):.3e}")

    t, x = [g.ravel() for g in jnp.meshgrid(jnp.linspace(0, T, 64), jnp.linspace(-X, X, 128))]
    u = jax.vmap(u_net, (None, 0, 0))(state[0], t, x)
    ref = exact(t / c, x / c, 0.1)
    error = float(jnp.linalg.norm(u - ref) / jnp.linalg.norm(ref))
    print(f"relative L2 error {error:.3e}")
    print(port_verdict(params, state[0], logged, args.steps))  # stalled when every step was skipped
    return {"error": error, "loss": float(loss)}


if __name__ == "__main__":
    main()
