"""Worker for tests/test_one_graph.py: scaled vs unscaled derivative engines, bit by bit.

Run as ``python -m tests.helpers.one_graph`` in a subprocess whose ``XLA_FLAGS`` are set before
JAX initialises (``--xla_allow_excess_precision=false`` or XLA's default). Prints one JSON
object: for every case, how many entries of the derivative values and of the weight gradient
(``jax.grad`` of a loss of the values) differ between the unscaled engine and the scaled one
(after unscaling), and for the train step whether params, optimizer state and loss agree.
"""

from __future__ import annotations

import json
import sys
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from jaxamp.models import FullyConnected

PLACEMENTS = {
    "default": dict(),
    "fp16": dict(autocast_activation=True, autocast_firstlayer=True),
}
PROBLEMS = {  # name: (inputs, outputs, derivatives)
    "cavity": (("x", "y"), ("u", "v", "p"), ("u__x", "u__y", "v__x", "v__y", "p__x", "p__y",
                                               "u__x__x", "u__y__y", "v__x__x", "v__y__y", "u__x__y")),
    "order4": (("x",), ("u",), ("u__x__x__x__x",)),
}
SCALE_LOG2 = (0, -1, 1, 2)
# The loss is multiplied by this (as the train step's loss scaler does) so that the backward
# pass's float16 cotangents stay normal, where binary scaling commutes with rounding.
LOSS_SCALE = 2.0**12


def _bits(tree) -> list:
    return [np.asarray(a).view(np.uint8) for a in jax.tree_util.tree_leaves(tree)]


def _n_diff(a, b) -> int:
    """Entries whose bits differ (a NaN equals itself)."""
    total = 0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        total += int(np.sum(x.view(f"u{x.dtype.itemsize}") != y.view(f"u{y.dtype.itemsize}")))
    return total


def _setup(placement: str, problem: str, method: str, layers: int = 3, width: int = 32, n: int = 32):
    inputs, outputs, names = PROBLEMS[problem]
    amp = jaxamp.AmpConfig(**PLACEMENTS[placement])
    net = FullyConnected.from_amp(amp, out_features=len(outputs), layer_size=width, nr_layers=layers)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros(len(inputs)))
    fn = lambda p, x: net.apply(p, x)  # noqa: E731
    kw = dict(inputs=inputs, outputs=outputs, derivatives=names, method=method)
    scaled = jaxamp.Derivatives(fn, **kw, amp=amp)
    plain = jaxamp.Derivatives(fn, **kw, amp=jaxamp.AmpConfig(**PLACEMENTS[placement], derivative_scaling=False))
    x = jax.random.uniform(jax.random.PRNGKey(1), (n, len(inputs)), minval=-1.0, maxval=1.0)
    return scaled, plain, params, x


def _value_and_grad(engine):
    """``jax.value_and_grad`` of the loss of the values of ``jaxamp.scaled(engine)`` (the scales
    are the first argument; ``{}`` for the unscaled engine)."""
    def loss(p, x, scales):
        values, found = jaxamp.scaled(engine)(scales, p, x)
        return LOSS_SCALE * sum(jnp.mean(v**2) for v in values.values()), (values, found)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def engine_cases(method: str, placements=tuple(PLACEMENTS), problems=tuple(PROBLEMS)) -> Dict[str, dict]:
    out = {}
    for placement in placements:
        for problem in problems:
            scaled, plain, params, x = _setup(placement, problem, method)
            (_, (ref, _)), ref_g = _value_and_grad(plain)(params, x, {})
            f = _value_and_grad(scaled)
            for k in SCALE_LOG2:
                scales = {key: jnp.float32(2.0**k) for key in scaled.scaler_keys}
                (_, (vals, found)), g = f(params, x, scales)
                out[f"{method}/{placement}/{problem}/{k}"] = {
                    "values_diff": _n_diff(vals, ref), "grads_diff": _n_diff(g, ref_g),
                    "n_values": sum(int(v.size) for v in ref.values()),
                    "n_grads": sum(int(v.size) for v in jax.tree_util.tree_leaves(ref_g)),
                    "flagged": sorted(key for key, v in found.items() if bool(v)),
                    "finite": all(bool(jnp.all(jnp.isfinite(v))) for v in vals.values()),
                }
    return out


def train_case(placement: str, steps: int = 3) -> dict:
    """make_train_step with AmpConfig() (every derivative scale 1) vs derivative_scaling=False,
    each program as written (merge=False: the identity is of the scaling, not of the merge)."""
    scaled, plain, params, x = _setup(placement, "cavity", "forward")
    opt = optax.adam(1e-3)
    results = []
    for engine in (scaled, plain):
        def loss_fn(p, batch, engine=engine):
            d = engine(p, batch)
            terms = {"mom": jnp.mean((d["u"] * d["u__x"] + d["v"] * d["u__y"] + d["p__x"]
                                      - 0.01 * (d["u__x__x"] + d["u__y__y"])) ** 2),
                     "cont": jnp.mean((d["u__x"] + d["v__y"]) ** 2)}
            return sum(terms.values()), terms

        state = jaxamp.TrainState.create(params=params, optimizer=opt, amp=engine.amp, engines=[engine])
        step = jax.jit(jaxamp.make_train_step(loss_fn, opt, amp=engine.amp, merge=False))
        losses = []
        for _ in range(steps):
            state, metrics = step(state, x)
            losses.append(metrics["loss"])
        results.append((state.params, state.opt_state.inner, losses))
    (p1, o1, l1), (p2, o2, l2) = results
    return {"params_diff": _n_diff(p1, p2), "opt_state_diff": _n_diff(o1, o2), "loss_diff": _n_diff(l1, l2),
            "losses": [float(v) for v in l1]}


def main() -> None:
    """``python -m tests.helpers.one_graph [METHOD ...] [--no-train] [--placement=NAME ...]
    [--problem=NAME ...]`` (default: both engines, every placement, every problem)."""
    args = sys.argv[1:]
    placements = [a.split("=", 1)[1] for a in args if a.startswith("--placement=")] or list(PLACEMENTS)
    problems = [a.split("=", 1)[1] for a in args if a.startswith("--problem=")] or list(PROBLEMS)
    out = {"xla_flags": __import__("os").environ.get("XLA_FLAGS", "")}
    for method in [a for a in args if not a.startswith("--")] or ["forward", "reverse"]:
        out.update(engine_cases(method, placements, problems))
    if "--no-train" not in args:
        out.update({f"train/{p}": train_case(p) for p in placements})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
