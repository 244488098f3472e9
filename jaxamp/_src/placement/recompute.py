"""Stored in 16 bits, recomputed in float32: the weight gradient of an AMP step
(``AmpConfig.recompute_float32``, on by default).

A float16 step under the default placement computes its first layer and its activations in
float32 (Modulus' advice). Left to ``jax.grad``, the backward pass keeps every one of those float32
values (each activation's output, the first layer's, and their derivative streams) beside the
float16 copies the next matmul reads: on the GPU most of the step's device memory
(docs/gpu.md). :func:`recomputed_grad` takes the gradient of the loss under :func:`jax.checkpoint`
with the policy :data:`SAVED`: the backward pass keeps only the 16-bit matmul outputs and the
parameters' 16-bit casts (named :data:`WEIGHT_CAST` where :func:`jaxamp.autocast` and
:class:`jaxamp.models.FullyConnected` make them) and recomputes the float32 elementwise values from
them: the same operations on the same operands, so the same numbers (tests/test_recompute.py).

``jax.checkpoint`` puts an optimization barrier on every input of the recomputation so that XLA
does not merge it back into the forward pass. XLA's GPU compiler merges the matmuls that share a
weight (a layer's value and derivative streams) into one GEMM, so a barrier on each stream's
output copies it out of that GEMM's result (a kernel per stream). :func:`recomputed_grad` keeps the
barriers on the differentiated arguments only: what the recomputation redoes depends on a
parameter (a layer's bias, added in float32 or cast from it, never saved), so it still cannot be
merged; the saved matmul outputs stay slices of one buffer, and the casts of one weight (a network
called on several point sets) stay one. A layer without a bias: its activation depends on saved
values only, XLA merges it back and stores it, as without the option (the same numbers either way).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

from jaxamp._src.core.interpreter import bind, eval_jaxpr

__all__ = ["WEIGHT_CAST", "SAVED", "Saved16", "recomputed_grad"]

# The name (jax.ad_checkpoint.checkpoint_name) of a parameter's cast to the compute dtype.
WEIGHT_CAST = "jaxamp_weight_cast"
_NARROW = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Saved16:
    """The remat policy of :func:`recomputed_grad`: a matmul's 16-bit output and a value named
    :data:`WEIGHT_CAST` are saved for the backward pass; everything else is recomputed."""

    def __call__(self, prim: jcore.Primitive, *avals: Any, **params: Any) -> bool:
        if prim is jp.name_p:
            return params["name"] == WEIGHT_CAST
        if prim is jp.dot_general_p:
            out = params.get("preferred_element_type") or avals[0].dtype
            return jnp.dtype(out) in _NARROW
        return False


SAVED = Saved16()


def recomputed_grad(fun: Callable[..., Tuple[jax.Array, Any]], argnums: Union[int, Sequence[int]]
                    ) -> Callable[..., Tuple[Any, Tuple[jax.Array, Any]]]:
    """``jax.grad(fun, argnums, has_aux=True)`` whose backward pass stores only what :data:`SAVED`
    saves and recomputes the rest (the module docstring); the same values.

    Args:
      fun: ``fun(*args) -> (loss, aux)``, arrays out.
      argnums: the differentiated positions, as ``jax.grad``.

    Returns:
      ``g(*args) -> (grads, (loss, aux))``.
    """

    def g(*args: Any) -> Tuple[Any, Tuple[jax.Array, Any]]:
        nums = [i % len(args) for i in ((argnums,) if isinstance(argnums, int) else argnums)]

        def of(*differentiated: Any) -> Any:
            full = list(args)
            for i, x in zip(nums, differentiated):
                full[i] = x
            return jax.grad(jax.checkpoint(fun, policy=SAVED), argnums, has_aux=True)(*full)

        differentiated = [args[i] for i in nums]
        closed, shapes = jax.make_jaxpr(of, return_shape=True)(*differentiated)
        jaxpr = _barriers_on(closed.jaxpr, set(closed.jaxpr.invars))
        outs = eval_jaxpr(jaxpr, closed.consts, jax.tree_util.tree_leaves(differentiated), bind)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)

    return g


def _barriers_on(jaxpr: jcore.Jaxpr, kept: set) -> jcore.Jaxpr:
    """``jaxpr`` with the barriers of its recomputations under :data:`SAVED` on ``kept`` (the
    differentiated arguments) only, not on the saved values."""
    eqns = []
    for eqn in jaxpr.eqns:
        params = eqn.params
        if eqn.primitive is jp.remat_p and isinstance(params.get("policy"), Saved16) and params.get("differentiated"):
            barrier = tuple(isinstance(v, jcore.Var) and v in kept for v in eqn.invars)
            eqn = eqn.replace(params={**params, "prevent_cse": barrier})
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns)
