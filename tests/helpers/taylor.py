"""Builders shared by the Taylor-mode tests (jaxamp/_src/taylor): test functions, nested-jvp references, costs."""

from typing import Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

import jaxamp
from jaxamp.models import FullyConnected

# fp16 ops round to fp16 (XLA's excess precision off): values match nested jvp's roundings.
STRICT_FP16 = {"xla_allow_excess_precision": False}


def mlp(activation: str, dtype=jnp.float32, **kw) -> Callable[[jax.Array], jax.Array]:
    """A 3x16 float32 FullyConnected ``(x, y) -> 2 outputs`` with fixed parameters."""
    net = FullyConnected(out_features=2, layer_size=16, nr_layers=3, activation=activation, dtype=dtype, **kw)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros(2))
    return lambda x: net.apply(params, x)


FUNCTIONS: Dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu_mlp_weight_norm": mlp("silu"),  # silu is a jit (pjit) call: the interpreter recurses
    "tanh_mlp": mlp("tanh"),
    "product_of_series": lambda x: jnp.stack([jnp.sin(2 * x[0]) * jnp.exp(x[1]), x[0] * x[1] / (1 + x[0] ** 2)]),
    "custom_jvp_and_where": lambda x: jnp.stack([jax.nn.softplus(3 * x[0]) + jax.nn.relu(x[1]),
                                                 jnp.where(x[0] > 0, x[0] ** 3, jnp.cos(x[1]))]),
    "multiple_results_and_constant_row": lambda x: jnp.concatenate([jnp.split(jnp.tanh(x) * x[::-1], 2)[1],
                                                                    jnp.ones(1)]),
}


def nested_second(f, x, t, ratio):
    """Reference of ``second_order``: inner tangent ``t``, outer ``ratio * t`` (factors applied
    in float32 one after another, rounded to ``t``'s dtype); returns ``(f, df, d2f)``."""
    outer = t
    if ratio is not None:
        outer = t.astype(jnp.float32)
        for r in ratio if isinstance(ratio, tuple) else (ratio,):
            outer = outer * r
        outer = outer.astype(t.dtype)
    (y, d1), (_, d2) = jax.jvp(lambda z: jax.jvp(f, (z,), (t,)), (x,), (outer,))
    return y, d1, d2


def nested_series(f, x, e, scales: Sequence[float]):
    """Reference of ``series``: K nested jax.jvp, seeds ``S_1 e`` then ``(S_k / S_{k-1}) e``
    (the forward engine's generic chain); returns ``[f, S_1 f', ..., S_K f^(K)]``."""
    out, g, prev = [f(x)], f, 1.0
    for s in scales:
        seed = (e * (s / prev)).astype(x.dtype)
        g = (lambda inner, seed: lambda z: jax.jvp(inner, (z,), (seed,))[1])(g, seed)
        out.append(g(x))
        prev = s
    return out


def fp16_net(activation: Optional[str] = None, **amp_kw) -> Tuple[Callable[[jax.Array], jax.Array], jax.Array]:
    """A 3x32 float16 FullyConnected ``(x, y) -> 2 outputs`` (jaxamp's placement, ``amp_kw``
    on top; ``activation`` None: the default) with fixed parameters, and 64 points in [-1, 1]^2."""
    amp = jaxamp.AmpConfig(dtype="float16", **amp_kw)
    kw = {} if activation is None else {"activation": activation}
    net = FullyConnected.from_amp(amp, out_features=2, layer_size=32, nr_layers=3, **kw)
    params = net.init(jax.random.PRNGKey(2), jnp.zeros(2))
    xs = jax.random.uniform(jax.random.PRNGKey(3), (64, 2), minval=-1, maxval=1)
    return (lambda x: net.apply(params, x)), xs


def cost(fn: Callable, *args, **jit_kw) -> Tuple[float, float]:
    """XLA's ``(flops, bytes accessed)`` of ``jax.jit(fn)(*args)``, compiled, not run."""
    c = jax.jit(fn, **jit_kw).lower(*args).compile().cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return c["flops"], c["bytes accessed"]
