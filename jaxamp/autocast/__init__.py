"""Precision placement for any JAX network function: :func:`autocast` (torch.autocast's op lists,
applied to the traced program).

``autocast(fn, amp)`` traces ``fn`` and re-evaluates its jaxpr through
:func:`jaxamp.interpreter.eval_jaxpr` with a per-primitive rule, giving a user's own network
the placement of :class:`jaxamp.models.FullyConnected` without touching the model code:

* matmuls and convolutions (``dot_general``, ``conv_general_dilated``) that use a parameter run
  in ``amp.compute_dtype``: their floating operands are cast at use (parameters stay float32) and
  the result is cast back to the dtype the original program gave it, so every other operation
  sees exactly the dtypes it was written for. The casts ``f16 -> f32 -> f16`` between two
  layers are exact, so this costs no precision; XLA fuses them into the neighbouring ops;
* the first layer -- a parameter-using matmul/convolution fed by the inputs with no such layer
  before it -- runs as written (float32) unless ``amp.autocast_firstlayer``;
* matmuls that use no parameter (fixed Fourier features ``x @ F``, products of inputs) run as
  written, as :class:`jaxamp.models.FourierNet` computes its features in float32;
* activations (:data:`ACTIVATION_PRIMITIVES`: tanh, logistic, sin, exp, erf, ...) run as written
  (float32) unless ``amp.autocast_activation``; then those downstream of a compute-dtype layer
  run in the compute dtype (the first layer's activation stays float32, as in FullyConnected);
* everything else runs as written. Bodies of ``jit``/``closed_call`` are inlined and rewritten;
  ``custom_jvp``/``custom_vjp`` functions (``jax.nn.relu``, ``jax.nn.softplus``) are bound as
  written, keeping their derivative rules, unless their body holds a matmul or an activation
  to move (then it is inlined and differentiated as ordinary primitives); ``lax.scan``,
  ``while_loop`` and ``cond`` bodies and ``jax.checkpoint`` blocks run as written.

The rewritten program holds only ordinary primitives, so the wrapped function composes with
``jax.jit``, ``jax.vmap``, ``jax.grad`` (any order, w.r.t. parameters or inputs) and
``jax.jacrev``/``jax.jacfwd``; derivatives of a compute-dtype matmul are compute-dtype matmuls.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxamp.config import AmpConfig
from jaxamp.interpreter import bind, eval_jaxpr, sub_jaxpr

COMPUTE_PRIMITIVES = frozenset(("dot_general", "conv_general_dilated"))
ACTIVATION_PRIMITIVES = frozenset((
    "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "asinh", "acosh", "atanh", "exp", "exp2", "expm1", "log", "log1p", "erf", "erfc", "erf_inv",
))
CUSTOM_PRIMITIVES = frozenset(("custom_jvp_call", "custom_vjp_call"))


class _Val(NamedTuple):
    """A value of the rewritten program and what it depends on."""

    x: Any  # the array (or tracer), in the dtype the original program gave it
    inputs: bool = False  # depends on a non-parameter argument
    params: bool = False  # depends on a parameter argument
    deep: bool = False  # downstream of a layer fed by the inputs: later layers are not the first
    low: bool = False  # downstream of an operation that ran in the compute dtype


def _const(x: Any) -> _Val:
    return _Val(x)


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _primitives(jaxpr: jcore.Jaxpr) -> collections.Counter:
    """How many times each primitive occurs in ``jaxpr`` and all its sub-jaxprs."""
    found = collections.Counter(eqn.primitive.name for eqn in jaxpr.eqns)
    for sub in jcore.subjaxprs(jaxpr):
        found.update(_primitives(sub))
    return found


class _Placement:
    """The rule: one decision per equation, from its primitive and its operands' dependencies."""

    def __init__(self, amp: AmpConfig):
        self.dtype = amp.compute_dtype
        self.firstlayer = amp.autocast_firstlayer
        self.activation = amp.autocast_activation
        self.counts: Dict[str, int] = collections.Counter()

    def __call__(self, eqn: jcore.JaxprEqn, invals: List[_Val]) -> List[_Val]:
        name = eqn.primitive.name
        body = sub_jaxpr(eqn)
        if body is None and name in CUSTOM_PRIMITIVES and self._move_inside(eqn, invals):
            body = eqn.params["call_jaxpr"]
        if body is not None:  # inline: the body's equations get their own decisions
            return eval_jaxpr(body.jaxpr, [_const(c) for c in body.consts], invals, self, literal=_const)
        flags = _Val(None, *(any(getattr(v, f) for v in invals) for f in _Val._fields[1:]))
        xs = [v.x for v in invals]
        floating = bool(eqn.outvars) and _floating(eqn.outvars[0].aval.dtype)
        if name in COMPUTE_PRIMITIVES and floating:
            if not flags.params:
                self.counts["without a parameter"] += 1
                outs = bind(eqn, xs)
            elif flags.inputs and not flags.deep and not self.firstlayer:
                self.counts["first layer"] += 1
                outs = bind(eqn, xs)
                flags = flags._replace(deep=True)
            else:
                self.counts["compute dtype"] += 1
                outs = self._lowered(eqn, xs)
                flags = flags._replace(deep=flags.deep or flags.inputs, low=True)
        elif name in ACTIVATION_PRIMITIVES and floating and self.activation and flags.low:
            outs = self._lowered(eqn, xs)
        else:
            if name not in CUSTOM_PRIMITIVES:  # custom calls were counted by _move_inside
                self._count_as_written(eqn)
            outs = bind(eqn, xs)
        return [flags._replace(x=o) for o in outs]

    def _lowered(self, eqn: jcore.JaxprEqn, xs: List[Any]) -> List[Any]:
        """``eqn`` in the compute dtype: floating operands cast at use, results cast back."""
        xs = [jax.lax.convert_element_type(x, self.dtype) if _floating(jnp.result_type(x)) else x for x in xs]
        if eqn.params.get("preferred_element_type") is not None:
            eqn = eqn.replace(params={**eqn.params, "preferred_element_type": self.dtype})
        outs = bind(eqn, xs)
        return [jax.lax.convert_element_type(o, v.aval.dtype) for o, v in zip(outs, eqn.outvars)]

    def _count_as_written(self, eqn: jcore.JaxprEqn) -> int:
        """Count the matmuls inside a body left as written (scan, cond, checkpoint, custom)."""
        found = 0
        for sub in jcore.jaxprs_in_params(eqn.params):
            found += sum(_primitives(sub)[p] for p in COMPUTE_PRIMITIVES)
        if found:
            self.counts[f"inside {eqn.primitive.name} (left as written)"] += found
        return found

    def _move_inside(self, eqn: jcore.JaxprEqn, invals: List[_Val]) -> bool:
        """Whether a custom_jvp/custom_vjp body holds something to rewrite (then it is inlined)."""
        inside = _primitives(eqn.params["call_jaxpr"].jaxpr)
        if any(inside[p] for p in COMPUTE_PRIMITIVES):
            return True
        low = any(v.low for v in invals)
        if self.activation and low and any(inside[p] for p in ACTIVATION_PRIMITIVES):
            return True
        self._count_as_written(eqn)
        return False


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
        and keyword arguments are pytrees of arrays; outputs keep ``fn``'s dtypes (float32 for a
        float32 network).
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
      >>> from jaxamp import AmpConfig
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
        types = [jax.typeof(x) for x in leaves]
        key = (tree, tuple((t.shape, t.dtype, t.weak_type) for t in types))
        entry = cache.get(key)
        if entry is None:
            is_param = [i in argnums for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
            is_param += [False] * (len(leaves) - len(is_param))
            entry = _rewrite(fn, amp, tree, types, is_param, argnums)
            if not any(isinstance(c, jax.core.Tracer) for c in entry[0].consts):
                cache[key] = entry  # a closure over an outer tracer is traced again next call
        closed, out_tree = entry
        return jax.tree_util.tree_unflatten(out_tree, eval_jaxpr(closed.jaxpr, closed.consts, leaves, bind))

    return wrapped


def _rewrite(fn: Callable, amp: AmpConfig, tree: Any, types: Sequence[Any],
             is_param: Sequence[bool], argnums: Tuple[int, ...]) -> Tuple[jcore.ClosedJaxpr, Any]:
    """The placed program of ``fn`` for argument leaves of ``types``, and its output tree."""
    specs = [jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type) for t in types]
    out_trees = []

    def flat_fn(*leaves):
        args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
        outs, out_tree = jax.tree_util.tree_flatten(fn(*args, **kwargs))
        out_trees.append(out_tree)
        return outs

    program = jax.make_jaxpr(flat_fn)(*specs)
    rule = _Placement(amp)

    def placed(*leaves):
        vals = [_Val(x, inputs=not p, params=p) for x, p in zip(leaves, is_param)]
        consts = [_Val(c, params=not argnums) for c in program.consts]
        return [v.x for v in eval_jaxpr(program.jaxpr, consts, vals, rule, literal=_const)]

    rewritten = jax.make_jaxpr(placed)(*specs)
    if not rule.counts["compute dtype"]:
        found = ", ".join(f"{n} {why}" for why, n in sorted(rule.counts.items())) or "none"
        raise ValueError(
            f"autocast: nothing in `fn`={_describe(fn)} runs in {amp.compute_dtype} (amp.dtype="
            f"{amp.dtype!r}). Matmuls/convolutions found: {found}. Only a matmul that uses a "
            f"parameter (arguments at params_argnums={argnums}) and is "
            "not the first layer on the inputs is moved. Fix: pass params_argnums= naming the "
            "parameter arguments, set amp.autocast_firstlayer=True for a one-layer model, or call "
            "fn without autocast."
        )
    return rewritten, out_trees[0]
