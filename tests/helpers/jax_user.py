"""Builders for the drop-in tests: one network seen two ways.

``engine_fn(params, x_vec) -> f32[1]`` as :class:`jaxamp.Derivatives` takes it, and the
scalar ``u_net(params, *coords)`` a JAX user writes, with nested :func:`jaxamp._src.derivatives.grad`
for a derivative name like ``"u__x__y"``.
"""

from typing import Callable, Sequence, Tuple

import jax
import jax.numpy as jnp

import jaxamp
from jaxamp import AmpConfig
from jaxamp.models import FullyConnected

INPUTS = ("t", "x")


def make_net(amp: AmpConfig, *, layer_size: int = 16, nr_layers: int = 2, seed: int = 0,
             weight_scale: float = 1.0) -> Tuple[Callable, Callable, dict]:
    """``(engine_fn, u_net, params)`` for a tanh FullyConnected placed as ``amp`` asks;
    ``weight_scale`` multiplies the first layer's kernel (large derivatives)."""
    model = FullyConnected.from_amp(amp, out_features=1, layer_size=layer_size, nr_layers=nr_layers,
                                    activation="tanh")
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros(len(INPUTS)))
    first = params["params"]["layers_0"]
    params["params"]["layers_0"] = dict(first, kernel=first["kernel"] * weight_scale)

    def engine_fn(p, x):
        return model.apply(p, x)

    def u_net(p, *coords):
        return model.apply(p, jnp.stack(coords))[0]

    return engine_fn, u_net, params


def nested(u_net: Callable, name: str, inputs: Sequence[str] = INPUTS, method: str = "reverse") -> Callable:
    """``u_net``'s derivative ``name`` ("u__x__y") by nested :func:`jaxamp.grad` (nested reverse
    mode by default, as a JAX user's nested ``jax.grad``; ``method="auto"``: the engine's plan)."""
    parts = name.split("__")
    fn = u_net
    for i, var in enumerate(parts[1:]):
        fn = jaxamp.grad(fn, argnums=1 + inputs.index(var), of=parts[0] if i == 0 else None, wrt=var, method=method)
    return fn


def batched(u_net: Callable, names: Sequence[str], inputs: Sequence[str] = INPUTS, method: str = "reverse") -> Callable:
    """``fn(params, points {input: f32[N]}) -> {name: f32[N]}`` under ``vmap``."""
    fns = {n: nested(u_net, n, inputs, method) for n in names}

    def fn(params, points):
        cols = [points[i] for i in inputs]
        axes = (None,) + (0,) * len(inputs)
        return {n: jax.vmap(f, axes)(params, *cols) for n, f in fns.items()}

    return fn


def points(n: int = 8, seed: int = 1, scale: float = 1.0):
    key = jax.random.PRNGKey(seed)
    return {name: scale * jax.random.uniform(jax.random.fold_in(key, i), (n,)) for i, name in enumerate(INPUTS)}


def physical_fourier_net(amp: AmpConfig, *, c: float = 0.02, seed: int = 0) -> Tuple[Callable, dict]:
    """``(u_net, params)``: examples/jax_user's MLP on physical inputs, its Fourier features
    ``cos(z @ b), sin(z @ b)`` with ``b ~ N(0, (2 pi / c)^2)`` (the length scale in the first
    layer's weights, as jaxpi's FourierEmbs), under :func:`jaxamp._src.derivatives.autocast`."""
    from examples.jax_user.fp32 import MLP

    model = MLP(fourier_sigma=2 * jnp.pi / c)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros(2))

    def u_net(p, t, x):
        return jaxamp.autocast(model.apply, amp)(p, jnp.stack([t, x]))

    return u_net, params


def u_xx_under_scaled(u_net: Callable, params, amp: AmpConfig, t, x):
    """``(u_xx f32[N], found_inf)``: nested :func:`jaxamp.grad` under ``vmap``, every scale 1, in
    reverse mode (``method="reverse"``: the cotangents meet the length scale in the float32
    first layer last; forward mode carries it through the float16 layers)."""
    rev = dict(argnums=2, method="reverse")
    f = jax.vmap(jaxamp.grad(jaxamp.grad(u_net, **rev), **rev), (None, 0, 0))
    keys = jaxamp._src.core.profile.scaler_keys(f, amp)(params, t, x)
    return jax.jit(jaxamp.scaled(f, amp))({k: 1.0 for k in keys}, params, t, x)
