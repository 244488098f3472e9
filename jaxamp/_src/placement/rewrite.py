""":func:`autocast`: the placement of :class:`jaxamp.models.FullyConnected` for any JAX network
(torch.autocast's op lists, applied to the traced program by :func:`jaxamp._src.core.interpreter.eval_jaxpr`).

* matmuls/convolutions using a parameter run in ``amp.compute_dtype``, operands cast at use and
  the result cast back (exact ``f16 -> f32 -> f16`` casts, fused by XLA); the first layer on the
  inputs unless ``amp.autocast_firstlayer``, and parameter-free ones (``x @ F``), run as written;
* :data:`ACTIVATION_PRIMITIVES` after a compute-dtype layer run in it if ``amp.autocast_activation``;
* everything else, bias adds included (FullyConnected's agree bitwise for zero biases), as written.
  ``jit`` bodies are inlined; ``checkpoint``/``cond``/``scan``/``while`` bodies rewritten (carries'
  flags widened until stable); custom-derivative functions inlined only if they hold something to
  move; matmuls left in other higher-order primitives are warned about.

The result composes with ``jax.jit``, ``jax.vmap``, ``jax.grad`` and ``jax.jacrev``/``jax.jacfwd``.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxamp._src.core import boundary, policy
from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.placement.rules import ACTIVATION_PRIMITIVES, COMPUTE_PRIMITIVES, Placement, Val
from jaxamp._src.placement.held import evaluate_held
from jaxamp._src.core.interpreter import bind, eval_jaxpr
from jaxamp._src.core.modules import is_module

__all__ = ["autocast", "ACTIVATION_PRIMITIVES", "COMPUTE_PRIMITIVES"]


def _describe(fn: Callable) -> str:
    owner = getattr(fn, "__self__", None)
    if owner is not None and hasattr(fn, "__name__"):
        return f"{type(owner).__name__}.{fn.__name__}"
    if is_module(fn):  # its repr lists every array
        return f"{type(fn).__name__}(...)"
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


# `amp` omitted: an error naming the fix (the config is passed, never taken from a context).
_MISSING: Any = object()


def _flax_module(fn: Any) -> bool:
    """Whether ``fn`` is a Flax linen module (checked only when Flax is imported already)."""
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(fn, linen.Module)


def _check_flax(fn: Any) -> None:
    """A Flax module, or a method of it other than ``apply``, in place of ``model.apply``."""
    owner = getattr(fn, "__self__", None)
    if _flax_module(fn) or (_flax_module(owner) and getattr(fn, "__name__", None) != "apply"):
        given = f"{type(fn).__name__}(...)" if _flax_module(fn) else _describe(fn)
        raise TypeError(
            f"autocast: `fn`={given} is a Flax module or one of its methods, not a function of the parameters. "
            "Fix: pass its apply function, autocast(model.apply, amp), and call it as apply(params, x)."
        )


def _check_flax_args(fn: Callable, args: Tuple[Any, ...], argnums: Tuple[int, ...]) -> None:
    """A Flax ``model.apply`` takes its variables first: an array there is the inputs (swapped)."""
    if _flax_module(getattr(fn, "__self__", None)) and args and argnums == (0,) and _is_array(args[0]):
        raise TypeError(
            f"autocast({_describe(fn)}): the first argument, `params`, is an array of shape {jnp.shape(args[0])}, "
            "not the variables dict of model.init. Fix: call it as apply(params, x), the parameters first."
        )


def autocast(fn: Callable, amp: Optional[AmpConfig] = _MISSING, *,
             params_argnums: Union[int, Sequence[int], None] = None) -> Callable:
    """``fn`` with jaxamp's precision placement, by rewriting its traced program per primitive.

    Parameter-using matmuls/convolutions run in ``amp.compute_dtype``; the first layer and the
    activations stay float32 unless ``amp.autocast_firstlayer`` / ``amp.autocast_activation``
    (the module docstring has the full rule). A Flax ``nn.Dense`` with ``dtype=None`` is
    rewritten as well.

    Args:
      fn: the network function, e.g. ``model.apply``. Array and number leaves of its arguments
        are traced, other leaves (bools, strings, functions) are static. Outputs keep ``fn``'s
        dtypes.
      amp: the settings, the ``AmpConfig`` given to ``jaxamp.init`` (required: the config is
        passed, never taken from a context). ``None``, ``amp.enabled=False`` or
        ``amp.dtype="float32"`` return ``fn``. The output carries the policy
        (:func:`jaxamp._src.core.policy.mark`) for ``jaxamp.init`` and every other entry point to
        check against its own config (a :class:`~jaxamp.ConfigError` when they differ), as an
        outer ``autocast`` checks an inner one.
      params_argnums: positions of the parameter arguments; every other argument is an input.
        ``()``: ``fn`` closes over its parameters (captured arrays count as such). Default: ``()``
        for an Equinox or Flax NNX module (or its method), whose arrays are its parameters
        (``autocast(net, amp)(x)``), else ``0`` (``apply(params, x)``).

    Returns:
      A function with ``fn``'s signature, tracing ``fn`` once per argument structure, shapes and
      dtypes. It raises ``ValueError`` naming ``fn`` when nothing runs in the compute dtype.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from jaxamp import AmpConfig, autocast
      >>> model = nn.Sequential([nn.Dense(64), jnp.tanh, nn.Dense(64), jnp.tanh, nn.Dense(1)])
      >>> params = model.init(jax.random.PRNGKey(0), jnp.ones((8, 2)))
      >>> apply = autocast(model.apply, AmpConfig(dtype="float16"))
      >>> apply(params, jnp.ones((8, 2))).dtype  # layers 2 and 3 ran in float16
      dtype('float32')
    """
    _check_flax(fn)
    if not callable(fn):
        raise TypeError(f"autocast: `fn`={fn!r} must be callable (the network's apply function); pass the "
                        "function itself, e.g. autocast(model.apply, amp), not its output.")
    if amp is _MISSING:
        raise TypeError(
            f"autocast({_describe(fn)}): `amp` is missing. Pass the AmpConfig that jaxamp.init gets, "
            "autocast(fn, amp) (declare it once: amp = jaxamp.AmpConfig(...)); None returns fn unchanged."
        )
    if amp is not None and not isinstance(amp, AmpConfig):
        raise TypeError(
            f"autocast: `amp`={amp!r} must be a jaxamp.AmpConfig or None; build one with "
            "AmpConfig(...) or AmpConfig.from_dict(cfg)."
        )
    module = is_module(fn)
    if params_argnums is None:  # a module holds its parameters: every argument is an input
        params_argnums = () if module else 0
    argnums = _argnums(params_argnums)
    if amp is None or amp.off:
        return fn
    if module and _equinox_instance(fn):  # a module stays a module, with the same leaves
        from jaxamp._src.placement.eqx_module import AutocastModule

        return AutocastModule(fn, amp, argnums, params_argnums, placed_function)
    if module and _nnx_instance(fn):
        from jaxamp._src.placement.nnx_module import AutocastNNX

        return AutocastNNX(fn, amp, argnums, params_argnums, placed_function)
    return placed_function(fn, amp, module, argnums, params_argnums)


def _equinox_instance(fn: Any) -> bool:
    """Whether ``fn`` is an Equinox module itself (not a method bound to one)."""
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(fn, eqx.Module) and not hasattr(fn, "__self__")


def _nnx_instance(fn: Any) -> bool:
    """Whether ``fn`` is a Flax NNX module itself (not a method bound to one)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and hasattr(nnx, "Module") and isinstance(fn, nnx.Module)


def placed_function(fn: Callable, amp: AmpConfig, module: bool, argnums: Tuple[int, ...],
                    params_argnums: Any) -> Callable:
    """The function :func:`autocast` returns for ``fn`` (its arguments already checked)."""
    cache: Dict[Any, Tuple[jcore.ClosedJaxpr, Any, Tuple[Any, ...]]] = {}
    name = _describe(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        config = amp
        _check_flax_args(fn, args, argnums)
        if argnums and max(argnums) >= len(args):
            raise ValueError(
                f"autocast({_describe(fn)}): `params_argnums`={params_argnums!r} names an argument "
                f"beyond the {len(args)} positional arguments given; pass the parameters positionally."
            )
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        traced = [_is_array(x) for x in leaves]
        arrays = [x for x, t in zip(leaves, traced) if t]
        is_param = [i in argnums for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
        is_param += [False] * (len(leaves) - len(is_param))
        is_param = [p for p, t in zip(is_param, traced) if t]
        held = tuple(jax.tree_util.tree_leaves(fn)) if module else ()  # a module's own leaves
        closed, out_tree = _placed_program(fn, name, cache, config, leaves, tree, traced, is_param, argnums, held)
        outs = jax.tree_util.tree_unflatten(out_tree, _evaluate(closed, arrays, is_param, config))
        return policy.mark(outs, policy.Policy.of(config, name))  # the program carries its policy

    return wrapped


def _placed_program(fn: Callable, name: str, cache: Dict[Any, Any], config: AmpConfig, leaves: Sequence[Any],
                    tree: Any, traced: Sequence[bool], is_param: Sequence[bool], argnums: Tuple[int, ...],
                    held: Tuple[Any, ...]) -> Tuple[jcore.ClosedJaxpr, Any]:
    """``fn``'s placed program for these arguments, traced once per config, argument structure,
    static leaves, shapes and dtypes (and, for a module, its leaves, compared by ``is``: an NNX
    module updated in place is traced again); the result cached in ``cache``."""
    types = [jax.typeof(x) for x, t in zip(leaves, traced) if t]
    key = (config, tree, tuple(traced), tuple(x for x, t in zip(leaves, traced) if not t),
           tuple((t.shape, t.dtype, t.weak_type) for t in types))
    try:
        entry = cache.get(key)
    except TypeError:  # an unhashable static argument: trace every call
        key, entry = None, None
    if entry is not None and not (len(entry[2]) == len(held) and all(a is b for a, b in zip(entry[2], held))):
        entry = None
    if entry is None:

        def call(*xs):
            it = iter(xs)
            full = [next(it) if t else x for x, t in zip(leaves, traced)]
            args, kwargs = jax.tree_util.tree_unflatten(tree, full)
            return fn(*args, **kwargs)

        entry = (*_rewrite(fn, name, call, config, types, is_param, argnums), held)
        if key is not None and not any(isinstance(c, jax.core.Tracer) for c in entry[0].consts):
            cache[key] = entry  # a closure over an outer tracer is traced again next call
    return entry[0], entry[1]


def _evaluate(closed: jcore.ClosedJaxpr, arrays: Sequence[Any], is_param: Sequence[bool],
              config: AmpConfig) -> List[Any]:
    """The placed program's outputs on ``arrays``: one :mod:`~jaxamp._src.core.boundary` equation
    whose derivatives, whoever takes them, are scaled per order (per-term keys need the names only
    jaxamp.grad's ``of=``/``wrt=`` give: those configs keep jaxamp.grad's marks), or the program
    inlined."""

    def placed(consts, *xs):
        if config.matmul_formats:  # scaled products read the float16 results they follow as float16
            return evaluate_held(jcore.ClosedJaxpr(closed.jaxpr, consts), xs, sole_readers=True)
        return eval_jaxpr(closed.jaxpr, consts, xs, bind)

    per_order = config.mode == "per_order_scaler" or not config.derivative_scaling
    if config.loss_scaling_enabled and per_order and not config.special_terms:
        # captured arrays (an Equinox module's, maybe tracers) are operands: parameters
        body = jax.make_jaxpr(placed)(list(closed.consts), *arrays)
        return boundary.network(body, [*closed.consts, *arrays], [True] * len(closed.consts) + list(is_param))
    return placed(closed.consts, *arrays)


def _is_array(x: Any) -> bool:
    """Traced argument leaves: arrays and numbers; the others (bools, strings, functions) are static."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)) and not isinstance(x, bool)


def _rewrite(fn: Callable, name: str, call: Callable, amp: AmpConfig, types: Sequence[Any], is_param: Sequence[bool],
             argnums: Tuple[int, ...]) -> Tuple[jcore.ClosedJaxpr, Any]:
    """The placed program of ``call`` (``fn`` on array leaves of ``types``) and its output tree."""
    specs = [jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type) for t in types]
    out_trees = []

    def flat_fn(*leaves):
        outs, out_tree = jax.tree_util.tree_flatten(call(*leaves))
        out_trees.append(out_tree)
        return outs

    program, rule = jax.make_jaxpr(flat_fn)(*specs), Placement(amp)
    # an autocast inside runs under its own config, which must be this one
    policy.check(policy.policies_in(program), amp, "jaxamp.autocast",
                 f"the config of autocast({name}), which it runs in,")
    flags = [Val(None, inputs=not p, params=p) for p in is_param]
    rewritten, _ = rule.placed(program, flags, Val(None, params=not argnums))
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
