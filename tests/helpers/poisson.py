"""A small 1D Poisson PINN (u'' = -pi^2 sin(pi x), u(0)=u(1)=0) shared by the train-step and checkpoint tests.

``batch["poison"]`` (bool[]) replaces one collocation point by NaN on chosen steps: that
injects a non-finite derivative into the engine's own overflow check, not after it.
"""

import jax
import jax.numpy as jnp
import optax

import jaxamp
from jaxamp.models import FullyConnected


def make_problem(amp, *, layer_size=16, nr_layers=2, lr=1e-3, seed=0, n=32):
    model = FullyConnected.from_amp(amp, out_features=1, layer_size=layer_size, nr_layers=nr_layers)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros(1))
    engine = jaxamp.Derivatives(lambda p, x: model.apply(p, x), inputs=("x",), outputs=("u",),
                                derivatives=("u__x__x",), amp=amp)

    def loss_fn(params, batch):
        x = jnp.where(jnp.arange(n) == 0, jnp.where(batch["poison"], jnp.nan, batch["x"]), batch["x"])
        d = engine(params, {"x": x})
        residual = d["u__x__x"] + jnp.pi**2 * jnp.sin(jnp.pi * x)
        ub = engine(params, {"x": jnp.array([0.0, 1.0])})
        pde, bc = jnp.mean(residual**2), jnp.mean(ub["u"] ** 2)
        return pde + bc, {"pde": pde, "bc": bc}

    optimizer = optax.adam(lr)
    state = jaxamp.TrainState.create(params=params, optimizer=optimizer, amp=amp, engines=[engine])
    step = jaxamp.make_train_step(loss_fn, optimizer, amp=amp)
    batch = lambda poison=False: {"x": jnp.linspace(0.0, 1.0, n), "poison": jnp.asarray(poison)}
    return state, step, batch, engine


_AMP = {
    "fp16": lambda: jaxamp.AmpConfig(dtype="float16"),
    # A loss scale low enough not to overflow this small net's fp16 weight gradients, so that
    # applied steps can be told apart from loss-scaler skips.
    "fp16_low_loss_scale": lambda: jaxamp.AmpConfig(dtype="float16", loss_scaler={"init_scale": 2.0**8}),
    "bf16": lambda: jaxamp.AmpConfig(dtype="bfloat16"),
    "fp32": lambda: jaxamp.AmpConfig(dtype="float32"),
}
_CACHE = {}


def cached_problem(name):
    """``make_problem`` for a named AMP setting, with its step jitted once per test session."""
    if name not in _CACHE:
        state, step, batch, engine = make_problem(_AMP[name]())
        _CACHE[name] = (state, jax.jit(step), step, batch, engine)
    return _CACHE[name]


def poisoned(i):
    """Whether step ``i`` of the checkpoint run gets a NaN point: some skipped steps on both
    sides of the checkpoint (tests/checkpoint_worker.py and the test that resumes its run)."""
    return i % 4 == 3
