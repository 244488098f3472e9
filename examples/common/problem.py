"""What a PINN example provides to the shared training loop."""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import numpy as np

from examples.common.config import Check

# derive(points {input: f32[N]}, derivatives=True) -> {name: f32[N]}: the outputs and (unless
# derivatives=False) every derivative of Problem.derivatives at the points.
Derive = Callable[..., Dict[str, jax.Array]]


class Problem:
    """A PINN problem: names, collocation sampling, the loss, and a reference to compare to.

    Subclasses set the class attributes and implement the methods; ``cfg`` is the whole
    validated config (they read ``cfg["problem"]`` and ``cfg["batch"]``).
    """

    name: str = ""
    default_config: str = ""  # config file run without --config (CPU-sized); default: ``name``
    inputs: Tuple[str, ...] = ()
    outputs: Tuple[str, ...] = ()
    derivatives: Tuple[str, ...] = ()
    eval_fields: Tuple[str, ...] = ()  # outputs compared with the reference
    checks: Dict[str, Check] = {}  # extra value checks, "section.key" -> (predicate, allowed)

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg

    def input_scale(self) -> Optional[Tuple[float, ...]]:
        """Per input, the factor the network's input layer multiplies the coordinates by
        (e.g. ``1 / domain size``: physical units in, unit-sized inputs to the network), or
        None (default): the network sees the coordinates as they are. The derivatives are
        still taken with respect to the coordinates."""
        return None

    def sample(self, key: jax.Array) -> Dict[str, Any]:
        """One batch of collocation points (traced: called inside the jitted step)."""
        raise NotImplementedError

    def loss(self, derive: Derive, batch: Mapping[str, Any]) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """``(loss f32[], {term: f32[]})`` of one batch."""
        raise NotImplementedError

    def eval_grid(self, n: int) -> Tuple[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
        """Evaluation points ``[n*n, n_inputs]`` on a grid and its two axes (for plots)."""
        raise NotImplementedError

    def reference(self, points: np.ndarray) -> Dict[str, np.ndarray]:
        """Reference values of :attr:`eval_fields` at ``points`` (``[N, n_inputs]``)."""
        raise NotImplementedError


def uniform(key: jax.Array, n: int, lo: float, hi: float) -> jax.Array:
    """``n`` float32 samples, uniform on ``[lo, hi]``."""
    return jax.random.uniform(key, (n,), minval=lo, maxval=hi)


def mean_sq(r: jax.Array, weight: Any = 1.0) -> jax.Array:
    return (weight * r**2).mean()


def rel_l2(pred: np.ndarray, ref: np.ndarray) -> float:
    """``||pred - ref|| / ||ref||`` (inf when pred has a non-finite entry)."""
    pred, ref = np.asarray(pred, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(pred)):
        return float("inf")
    return float(np.linalg.norm(pred - ref) / np.linalg.norm(ref))
