"""Precision placement for any JAX network function: :func:`autocast` (torch.autocast's op lists,
applied to the traced program).

``autocast(fn, amp)`` traces ``fn`` and re-evaluates its jaxpr through
:func:`jaxamp.interpreter.eval_jaxpr` with a per-primitive rule, giving a user's own network
the placement of :class:`jaxamp.models.FullyConnected` without touching the model code:

* matmuls and convolutions (``dot_general``, ``conv_general_dilated``) that use a parameter run
  in ``amp.compute_dtype``: their floating operands are cast at use (parameters stay float32) and
  the result is cast back to the dtype the original program gave it, so every other operation
  sees exactly the dtypes it was written for. The casts ``f16 -> f32 -> f16`` between two
  layers are exact, so this costs no precision; XLA fuses them with the neighbouring ops;
* the first layer -- a parameter-using matmul/convolution fed by the inputs with no such layer
  before it -- runs as written (float32) unless ``amp.autocast_firstlayer``;
* matmuls that use no parameter (fixed Fourier features ``x @ F``, products of inputs) run as
  written, as :class:`jaxamp.models.FourierNet` computes its features in float32;
* activations (:data:`ACTIVATION_PRIMITIVES`: tanh, logistic, sin, exp, erf, ...) run as written
  (float32) unless ``amp.autocast_activation``; then those downstream of a compute-dtype layer
  run in the compute dtype (the first layer's activation stays float32, as in FullyConnected);
* everything else runs as written. Bodies of ``jit``/``closed_call`` are inlined and rewritten;
  ``jax.checkpoint``, ``lax.cond``, ``lax.scan`` and ``lax.while_loop`` keep their structure
  with rewritten bodies (a loop carry's dependencies are widened until stable, so inside a
  scan over layers every iteration gets one placement); ``custom_jvp``/``custom_vjp`` functions
  (``jax.nn.relu``, ``jax.nn.softplus``) are bound as written, keeping their derivative rules,
  unless their body holds a matmul or an activation to move (then it is inlined and
  differentiated as ordinary primitives). Matmuls left inside other higher-order primitives
  are reported by a warning.

Compared with :class:`jaxamp.models.FullyConnected`, which adds its biases in the compute dtype
(as torch's fused ``linear``), bias adds here run as written (float32): on the same weights the
outputs agree bitwise when the biases are zero and to fp16 rounding of the pre-activations
otherwise.

The rewritten program is made of JAX's own primitives (casts and the original equations), so the
wrapped function composes with ``jax.jit``, ``jax.vmap``, ``jax.grad`` (any order, w.r.t.
parameters or inputs) and ``jax.jacrev``/``jax.jacfwd``; derivatives of a compute-dtype matmul
are compute-dtype matmuls.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxamp.config import AmpConfig
from jaxamp.placement.rules import ACTIVATION_PRIMITIVES, COMPUTE_PRIMITIVES, Placement, Val
from jaxamp.interpreter import bind, eval_jaxpr

__all__ = ["autocast", "ACTIVATION_PRIMITIVES", "COMPUTE_PRIMITIVES"]


def _describe(fn: Callable) -> str:
    owner = getattr(fn, "__self__", None)
    if owner is not None and hasattr(fn, "__name__"):
        return f"{type(owner).__name__}.{fn.__name__}"
    return getattr(fn, "__qualname__", None) or repr(fn)


def _argnums(value: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    nums = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        nums = tuple(nums)
    except TypeError:
        nums = None
    if nums is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nums):
        raise ValueError(
            f"autocast: `params_argnums`={value!r} must be an int >= 0 or a sequence of them: the "
            "positions of fn's parameter arguments, e.g. 0 for apply_fn(params, x)."
        )
    return nums


def autocast(fn: Callable, amp: Optional[AmpConfig], *, params_argnums: Union[int, Sequence[int]] = 0) -> Callable:
    """``fn`` with jaxamp's precision placement, by rewriting its traced program per primitive.

    Matmuls/convolutions that use a parameter run in ``amp.compute_dtype`` (operands cast at
    use, result cast back to the dtype ``fn`` gave it); the first layer on the inputs and the
    activations stay float32 unless ``amp.autocast_firstlayer`` / ``amp.autocast_activation``;
    everything else runs as written (see the module docstring for the full rule). The model code
    is not changed: a Flax ``nn.Dense`` with ``dtype=None`` or ``float32`` is rewritten as well.

    Args:
      fn: the network function, e.g. ``model.apply`` or ``u_net(params, t, x)``. Its positional
        and keyword arguments are pytrees; array and number leaves are traced, other leaves
        (bools, strings, functions) are static, as Flax's ``apply(..., train=False)`` expects.
        Outputs keep ``fn``'s dtypes (float32 for a float32 network).
      amp: the settings. ``None``, ``amp.enabled=False`` or ``amp.dtype="float32"`` return ``fn``
        itself (no rewrite).
      params_argnums: positions of the parameter arguments (default ``0``). Every other
        argument (keyword arguments included) is an input: it decides which layer is the first.
        ``()``: ``fn`` closes over its parameters; the arrays it captures count as parameters.

    Returns:
      A function with ``fn``'s signature. It traces ``fn`` once per argument structure, shapes and
      dtypes (cached, so eager calls and ``jax.jit`` do not retrace per call). It raises
      ``ValueError`` naming ``fn`` when nothing in ``fn`` runs in the compute dtype.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from jaxamp import AmpConfig, autocast
      >>> model = nn.Sequential([nn.Dense(64), jnp.tanh, nn.Dense(64), jnp.tanh, nn.Dense(1)])
      >>> params = model.init(jax.random.PRNGKey(0), jnp.ones((8, 2)))
      >>> apply = autocast(model.apply, AmpConfig(dtype="float16"))
      >>> apply(params, jnp.ones((8, 2))).dtype  # layers 2 and 3 ran in float16
      dtype('float32')
    """
    if not callable(fn):
        raise TypeError(f"autocast: `fn`={fn!r} must be callable (the network's apply function).")
    if amp is not None and not isinstance(amp, AmpConfig):
        raise TypeError(
            f"autocast: `amp`={amp!r} must be a jaxamp.AmpConfig or None; build one with "
            "AmpConfig(...) or AmpConfig.from_dict(cfg)."
        )
    argnums = _argnums(params_argnums)
    if amp is None or amp.compute_dtype == jnp.float32:
        return fn
    cache: Dict[Any, Tuple[jcore.ClosedJaxpr, Any]] = {}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if argnums and max(argnums) >= len(args):
            raise ValueError(
                f"autocast({_describe(fn)}): `params_argnums`={params_argnums!r} names an argument "
                f"beyond the {len(args)} positional arguments given; pass the parameters positionally."
            )
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        traced = [_is_array(x) for x in leaves]
        arrays = [x for x, t in zip(leaves, traced) if t]
        types = [jax.typeof(x) for x in arrays]
        key = (tree, tuple(traced), tuple(x for x, t in zip(leaves, traced) if not t),
               tuple((t.shape, t.dtype, t.weak_type) for t in types))
        try:
            entry = cache.get(key)
        except TypeError:  # an unhashable static argument: trace every call
            key, entry = None, None
        if entry is None:
            is_param = [i in argnums for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
            is_param += [False] * (len(leaves) - len(is_param))

            def call(*xs):
                it = iter(xs)
                full = [next(it) if t else x for x, t in zip(leaves, traced)]
                args, kwargs = jax.tree_util.tree_unflatten(tree, full)
                return fn(*args, **kwargs)

            entry = _rewrite(fn, call, amp, types, [p for p, t in zip(is_param, traced) if t], argnums)
            if key is not None and not any(isinstance(c, jax.core.Tracer) for c in entry[0].consts):
                cache[key] = entry  # a closure over an outer tracer is traced again next call
        closed, out_tree = entry
        return jax.tree_util.tree_unflatten(out_tree, eval_jaxpr(closed.jaxpr, closed.consts, arrays, bind))

    return wrapped


def _is_array(x: Any) -> bool:
    """Traced argument leaves: arrays and numbers; the others (bools, strings, functions) are static."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)) and not isinstance(x, bool)


def _rewrite(fn: Callable, call: Callable, amp: AmpConfig, types: Sequence[Any], is_param: Sequence[bool],
             argnums: Tuple[int, ...]) -> Tuple[jcore.ClosedJaxpr, Any]:
    """The placed program of ``call`` (``fn`` on array leaves of ``types``) and its output tree."""
    specs = [jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type) for t in types]
    out_trees = []

    def flat_fn(*leaves):
        outs, out_tree = jax.tree_util.tree_flatten(call(*leaves))
        out_trees.append(out_tree)
        return outs

    program = jax.make_jaxpr(flat_fn)(*specs)
    rule = Placement(amp)

    def placed(*leaves):
        vals = [Val(x, inputs=not p, params=p) for x, p in zip(leaves, is_param)]
        consts = [Val(c, params=not argnums) for c in program.consts]
        return [v.x for v in eval_jaxpr(program.jaxpr, consts, vals, rule, literal=Val)]

    rewritten = jax.make_jaxpr(placed)(*specs)
    found = ", ".join(f"{n} {why}" for why, n in sorted(rule.counts.items())) or "none"
    if rule.counts["compute dtype"] and any("left as written" in why for why in rule.counts):
        warnings.warn(
            f"autocast: some matmuls of `fn`={_describe(fn)} stay as written ({found}): autocast "
            "does not rewrite the bodies of these primitives.", stacklevel=3,
        )
    if not rule.counts["compute dtype"]:
        raise ValueError(
            f"autocast: nothing in `fn`={_describe(fn)} runs in {amp.compute_dtype} (amp.dtype="
            f"{amp.dtype!r}). Matmuls/convolutions found: {found}. Only a matmul that uses a "
            f"parameter (arguments at params_argnums={argnums}) and is "
            "not the first layer on the inputs is moved. Fix: pass params_argnums= naming the "
            "parameter arguments, set amp.autocast_firstlayer=True for a one-layer model, or call "
            "fn without autocast."
        )
    return rewritten, out_trees[0]
