"""Scaled input derivatives of a per-point network: the DerivScaler's derivative engine.

A derivative is named like Modulus: ``u__x`` is du/dx, ``u__x__y`` is d/dy(du/dx). The
engine computes all requested derivatives of a per-point function with nested AD and
``vmap`` over points: by default nested forward mode (``jax.jvp`` of the level below, the
tangent seeded with the scale; a pure second order propagates one tangent, see
:mod:`jaxamp.taylor`); ``method="reverse"`` is nested ``jax.grad`` as Modulus' autograd,
the reference path. Each differentiation follows SPEC.md "One derivative step":

1. multiply the differentiated variable by its scaler's scale (the backward seed; in
   forward mode the tangent seed, which scales every float16 tangent the same way);
2. differentiate through the network's mixed-precision graph;
3. flag inf/NaN in the *scaled* result under the scaler's key;
4. multiply by ``1/scale`` in float32, inside the differentiable graph.

Everything is traced: scales come in as arrays, flags come out as arrays, so the engine
runs inside one ``jax.jit`` with no host synchronisation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from jaxamp import taylor, taylor_series
from jaxamp.config import AmpConfig
from jaxamp.scaler import DynamicScaler, ScaleState

METHODS = ("reverse", "forward", "forward_over_reverse")
# Reserved key of found_inf: True when an input, a network output or a level below a
# derivative is non-finite at some point (bad values: no scale can cure them).
NONFINITE_VALUES = "nonfinite_values"
# Pure derivatives of at least this order take Taylor mode in the forward engine
# (jaxamp.taylor_series); pure second orders take jaxamp.taylor.second_order.
_SERIES_MIN_ORDER = 3
PointFn = Callable[..., jax.Array]  # fn(params, x: f32[n_inputs]) -> f32[n_outputs]
SEP = "__"


def parse_name(name: str) -> Tuple[str, Tuple[str, ...]]:
    """``"u__x__y"`` -> ``("u", ("x", "y"))``."""
    parts = name.split(SEP)
    return parts[0], tuple(parts[1:])


def order_of(name: str) -> int:
    return len(parse_name(name)[1])


@dataclasses.dataclass(frozen=True)
class _Level:
    """How one derivative order is obtained from the order below it (static, hashable)."""

    parents: Tuple[str, ...]  # names differentiated at this level (all of the order below)
    parent_rows: Tuple[int, ...]  # their rows in the level below's value vector
    parent_keys: Tuple[str, ...]  # scaler key of each parent (empty strings when unscaled)
    names: Tuple[str, ...]  # derivatives this level produces
    child_parent: Tuple[int, ...]  # for each produced name, the index into `parents`
    child_input: Tuple[int, ...]  # for each produced name, the input index it differentiates by


class Derivatives:
    """Engine for named, scaled derivatives of a per-point network function.

    Args:
      fn: ``fn(params, x) -> y`` for ONE point: ``x`` is ``f32[len(inputs)]``, ``y`` is
        ``f32[len(outputs)]``. (A Flax model: ``lambda p, x: model.apply(p, x)``.)
      inputs: names of the entries of ``x`` (e.g. ``("x", "y")``).
      outputs: names of the entries of ``y`` (e.g. ``("u", "v", "p")``).
      derivatives: names to compute, e.g. ``("u__x", "u__y__y", "p__x")``; every lower-order
        derivative they need is computed (and returned) too.
      amp: mixed-precision settings (scaler mode, special terms, max scales). ``None`` or a
        config whose scalers are inactive (AMP off, bf16, fp32) computes plain derivatives
        with no scaling, no checks and no scaler keys.
      method: how derivatives are taken; all three give the same values (to rounding) and
        the same checks under the same scaler keys.
        ``"forward"`` (default): nested ``jax.jvp``, one chain per derivative path (its
        (scaler key, input) steps), each tangent seeded with its scale; a pass yields every
        output's derivative along the path and the lower orders on the way, so under
        per-order scaling ``u__x__x`` and ``v__x__x`` share a pass. Pure second derivatives
        (``u__x__x``) propagate one tangent instead of nested ``jax.jvp``'s two
        (:mod:`jaxamp.taylor`), so scaling costs no extra network passes; pure derivatives of
        order 3 and more (``u__x__x__x__x``) take Taylor mode, one chain per order, each with
        its own scale (:mod:`jaxamp.taylor_series`); mixed ones (``u__x__y``) stay nested
        ``jax.jvp``. Fastest measured for
        PINN-sized inputs (see the README's benchmark section); per-term scaling needs a pass
        per term.
        ``"reverse"``: nested ``jax.grad``, one reverse pass per differentiated variable, as
        Modulus' autograd; the reference path of the torch parity tests.
        ``"forward_over_reverse"``: order 1 by ``jax.jacrev``, orders >= 2 by ``jax.jvp``;
        kept for benchmarks.

    Call ``engine(params, points, scales)`` (see :meth:`__call__`).
    """

    def __init__(
        self,
        fn: PointFn,
        *,
        inputs: Sequence[str],
        outputs: Sequence[str],
        derivatives: Sequence[str],
        amp: Optional[AmpConfig] = None,
        method: str = "forward",
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"Derivatives: `method`={method!r} is not supported: expected one of {list(METHODS)}.")
        self.method = method
        if not callable(fn):
            raise TypeError(f"Derivatives: `fn`={fn!r} must be callable as fn(params, x).")
        self.fn = fn
        self.inputs = _check_names("inputs", inputs)
        self.outputs = _check_names("outputs", outputs)
        if set(self.inputs) & set(self.outputs):
            raise ValueError(
                f"Derivatives: names {sorted(set(self.inputs) & set(self.outputs))} appear in both "
                "`inputs` and `outputs`; each name must be one or the other."
            )
        if isinstance(derivatives, str):
            raise TypeError(f"Derivatives: `derivatives`={derivatives!r} must be a list of names, not a string.")
        self.amp = amp if amp is not None else AmpConfig(enabled=False)
        if not isinstance(self.amp, AmpConfig):
            raise TypeError(f"Derivatives: `amp`={amp!r} must be an AmpConfig or None.")
        self.scaled = self.amp.scaler_enabled
        self.requested = tuple(derivatives)
        for name in self.requested:
            self._check_derivative_name(name)
        self.levels = self._plan()
        self.names = self.outputs + tuple(n for level in self.levels for n in level.names)
        keys = (k for level in self.levels for k in level.parent_keys if k)
        self.scaler_keys: Tuple[str, ...] = tuple(dict.fromkeys(keys))

    # ------------------------------------------------------------------ planning
    def _check_derivative_name(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Derivatives: derivative name {name!r} must be a string like 'u__x'.")
        base, wrt = parse_name(name)
        if base not in self.outputs:
            raise ValueError(
                f"Derivatives: derivative {name!r} differentiates {base!r}, which is not an output; "
                f"outputs are {list(self.outputs)}."
            )
        for var in wrt:
            if var not in self.inputs:
                raise ValueError(
                    f"Derivatives: derivative {name!r} is taken with respect to {var!r}, which is not an "
                    f"input; inputs are {list(self.inputs)}."
                )

    def scaler_key(self, parent: str) -> str:
        """The scaler key that guards differentiating ``parent`` (SPEC "Names of derivatives")."""
        if self.amp.mode == "per_term_scaler" or parent in self.amp.special_terms:
            return parent
        return str(order_of(parent) + 1)

    def _plan(self) -> Tuple[_Level, ...]:
        needed = set()
        for name in self.requested:
            base, wrt = parse_name(name)
            for k in range(1, len(wrt) + 1):
                needed.add(SEP.join((base, *wrt[:k])))
        max_order = max((order_of(n) for n in needed), default=0)
        below = list(self.outputs)
        levels = []
        for order in range(1, max_order + 1):
            names = tuple(sorted(n for n in needed if order_of(n) == order))
            parents = tuple(sorted({n.rsplit(SEP, 1)[0] for n in names}))
            levels.append(
                _Level(
                    parents=parents,
                    parent_rows=tuple(below.index(p) for p in parents),
                    parent_keys=tuple(self.scaler_key(p) if self.scaled else "" for p in parents),
                    names=names,
                    child_parent=tuple(parents.index(n.rsplit(SEP, 1)[0]) for n in names),
                    child_input=tuple(self.inputs.index(parse_name(n)[1][-1]) for n in names),
                )
            )
            below = list(names)
        return tuple(levels)

    # ------------------------------------------------------------------ scalers
    @property
    def scalers(self) -> Dict[str, DynamicScaler]:
        """The scale rule of every scaler key this engine uses (empty when scaling is off)."""
        return {key: self.amp.derivative_scaler_for(key) for key in self.scaler_keys}

    def init_scaler_states(self) -> Dict[str, ScaleState]:
        return {key: rule.init() for key, rule in self.scalers.items()}

    # ------------------------------------------------------------------ evaluation
    def point_values(
        self, params, x: jax.Array, scales: Mapping[str, jax.Array]
    ) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
        """All values at one point ``x: f32[n_inputs]``: ``({name: f32[]}, {key: bool[]})``.

        Every method differentiates the variable below through its scaled, unscaled graph, so
        higher orders see the lower orders' ``1/scale``. ``"reverse"`` (here): one reverse
        pass per differentiated variable, its gradient with respect to every input at once.
        """
        if self.method == "forward":
            return _forward(self, params, x, scales)
        if self.method == "forward_over_reverse":
            return _jvp_chain(self, params, x, scales)
        fns = _VariableFns(self, params, scales)
        y = fns.outputs(x)
        values = {name: y[i] for i, name in enumerate(self.outputs)}
        flags: Dict[str, jax.Array] = {}
        for level in self.levels:
            for p, parent in enumerate(level.parents):
                children = [(n, col) for n, cp, col in zip(level.names, level.child_parent, level.child_input) if cp == p]
                grad = fns.scaled_grad(parent)(x)  # steps 1-2: f32[n_inputs], scaled
                picked = jnp.stack([grad[col] for _, col in children])
                if self.scaled:
                    key = level.parent_keys[p]
                    hit = jnp.any(~jnp.isfinite(picked))  # step 3: check the scaled values
                    flags[key] = hit if key not in flags else flags[key] | hit
                    picked = picked * fns.inv_scale(parent)  # step 4: unscale in f32
                values.update({n: picked[i] for i, (n, _) in enumerate(children)})
        return values, flags

    def __call__(
        self,
        params,
        points: Union[Mapping[str, jax.Array], jax.Array],
        scales: Optional[Mapping[str, jax.Array]] = None,
    ) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
        """Values and derivatives at a batch of points.

        Args:
          params: the network parameters passed to ``fn``.
          points: ``{input name: f32[N]}`` or an array ``f32[N, n_inputs]``.
          scales: ``{scaler key: f32[]}`` with at least :attr:`scaler_keys` (e.g. the
            ``scale`` of each state from :meth:`init_scaler_states`). Ignored when scaling is off.

        Returns:
          ``(values, found_inf)``: ``values[name]`` is ``f32[N]`` (unscaled) for every output
          and every derivative computed; ``found_inf[key]`` is ``bool[]``, True when any scaled
          derivative guarded by ``key`` is inf/NaN at any point.
        """
        x = self._stack_points(points)
        scales = self._check_scales(scales)
        # One seed per point, as torch's grad_outputs=ones_like(var)*scale: an unbatched seed
        # would make the seed's products (the final layer's backward s*W, a tangent W*s)
        # point-independent, and the weight gradient would then sum their cotangents over the
        # batch *before* the factor s is applied, storing that sum, ~1/s times larger than
        # any per-point value, in float16 (the transpose of the f16->f32 cast). Per point, the
        # batch sum happens in the weight cotangent's own contraction with s folded in.
        # (Measured on the Poisson parity pair, scales 2^-8: overflow from loss scale 256
        # unbatched vs 512 batched, torch_ref 512.)
        scales = {k: jnp.broadcast_to(s, x.shape[:1]) for k, s in scales.items()}
        values, flags = jax.vmap(lambda p, s: self.point_values(params, p, s))(x, scales)
        return values, {key: jnp.any(flag) for key, flag in flags.items()}

    def _check_scales(self, scales) -> Dict[str, jax.Array]:
        if not self.scaled:
            return {}
        if scales is None:
            raise ValueError(
                f"Derivatives: `scales` is required when float16 derivative scaling is on; pass "
                f"{{key: scale}} for the keys {list(self.scaler_keys)} (e.g. from a TrainState)."
            )
        missing = [k for k in self.scaler_keys if k not in scales]
        if missing:
            raise KeyError(
                f"Derivatives: `scales` lacks the scaler key(s) {missing}; it has {sorted(scales)}. "
                "Create the states with engine.init_scaler_states() (or TrainState.create(..., engines=...))."
            )
        return {k: jnp.asarray(scales[k], jnp.float32) for k in self.scaler_keys}

    def _stack_points(self, points) -> jax.Array:
        if isinstance(points, Mapping):
            missing = [n for n in self.inputs if n not in points]
            if missing:
                raise KeyError(f"Derivatives: `points` lacks input(s) {missing}; it has {sorted(points)}.")
            cols = [jnp.asarray(points[n]) for n in self.inputs]
            for n, c in zip(self.inputs, cols):
                if c.ndim != 1 or c.shape != cols[0].shape:
                    raise ValueError(
                        f"Derivatives: points[{n!r}] has shape {c.shape}; every input must be a 1-D array "
                        f"of the same length N (here {cols[0].shape})."
                    )
            x = jnp.stack(cols, axis=-1)
        else:
            x = jnp.asarray(points)
            if x.ndim != 2 or x.shape[-1] != len(self.inputs):
                raise ValueError(
                    f"Derivatives: `points` has shape {x.shape}; expected [N, {len(self.inputs)}] "
                    f"for inputs {list(self.inputs)}."
                )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"Derivatives: `points` must be floating point (float32), got dtype {x.dtype}.")
        return x.astype(jnp.float32)


class _VariableFns:
    """Per-point functions of ``x`` for every variable an engine needs, built once per trace.

    ``value(name)(x)`` is the unscaled value of a variable (an output or a derivative);
    ``scaled_grad(name)(x)`` is ``grad(scale * value(name))(x)``, the scaled gradient with
    respect to every input. Indices are static, so no gather/scatter enters the graph.
    """

    def __init__(self, engine: "Derivatives", params, scales: Mapping[str, jax.Array]) -> None:
        self.engine, self.params, self.scales = engine, params, scales
        self._values: Dict[str, Callable] = {}
        self._grads: Dict[str, Callable] = {}

    def outputs(self, x: jax.Array) -> jax.Array:
        outputs = self.engine.outputs
        y = jnp.asarray(self.engine.fn(self.params, x))
        if y.shape != (len(outputs),):
            raise ValueError(
                f"Derivatives: fn(params, x) returned shape {y.shape} for one point; expected "
                f"({len(outputs)},) for outputs {list(outputs)}."
            )
        return y.astype(jnp.float32)

    def scale(self, name: str) -> Optional[jax.Array]:
        return self.scales[self.engine.scaler_key(name)] if self.engine.scaled else None

    def inv_scale(self, name: str) -> jax.Array:
        return jnp.float32(1.0) / self.scale(name)

    def value(self, name: str) -> Callable[[jax.Array], jax.Array]:
        if name not in self._values:
            if name in self.engine.outputs:
                i = self.engine.outputs.index(name)
                fn = lambda x: self.outputs(x)[i]  # noqa: E731
            else:
                parent, var = name.rsplit(SEP, 1)
                col, grad = self.engine.inputs.index(var), self.scaled_grad(parent)
                if self.engine.scaled:
                    fn = lambda x: grad(x)[col] * self.inv_scale(parent)  # noqa: E731
                else:
                    fn = lambda x: grad(x)[col]  # noqa: E731
            self._values[name] = fn
        return self._values[name]

    def scaled_grad(self, name: str) -> Callable[[jax.Array], jax.Array]:
        if name not in self._grads:
            value = self.value(name)
            if self.engine.scaled:
                seeded = lambda x: value(x) * self.scale(name)  # noqa: E731
            else:
                seeded = value
            self._grads[name] = jax.grad(seeded)
        return self._grads[name]


def _forward(engine: "Derivatives", params, x: jax.Array, scales: Mapping[str, jax.Array],
             series_min_order: Optional[int] = None):
    """``point_values`` by nested forward mode, one chain of ``jax.jvp`` per derivative path.

    A derivative's path is its sequence of (scaler key, input) steps: ``u__x__y`` under
    per-order scaling is ``(("1", x), ("2", y))``. Step k is ``jax.jvp`` of the *scaled*
    level below, ``s_{k-1} * f`` (as float16 tangents computed it), along its input with the
    tangent seed ``s_k / s_{k-1}``: by linearity this is ``s_k * df/dx``, SPEC's steps 1-2 for
    the already unscaled ``f``, and every float16 value of the step carries at most the scale
    of the step (``s_k`` or ``s_k / s_{k-1}``, as in nested reverse mode), never the product
    ``s_{k-1} * s_k`` that differentiating ``f = (s_{k-1} f) / s_{k-1}`` itself would put in
    the tangents (and ``1 / (s_{k-1} s_k)`` in the weight gradient's cotangents). The scaled
    tangent is checked (step 3) and multiplied by ``1/s_k`` in float32 (step 4).

    One pass per maximal path: its primal outputs are the lower-order values along the path,
    and every output's tangent comes out of it, so under per-order scaling ``u__x__x`` and
    ``v__x__x`` (and ``u__x``, ``p__x``) share one pass. A pure second-order step (the same
    input twice) is :func:`jaxamp.taylor.second_order`: the outer tangent is formed from the
    inner one by the power of two ``s_2 / s_1**2`` at each primitive rather than propagated
    through the network a second time (float32 primitives scale their second-order term by it
    instead, the same values). A pure path of order >= ``series_min_order`` (default
    ``_SERIES_MIN_ORDER``) is Taylor mode
    (:func:`jaxamp.taylor_series.derivatives`), every order's chain carrying ``s_k``; other
    paths with a pure second-order prefix are ``jax.jvp`` of :func:`jaxamp.taylor.second_order`.
    """
    base_fns = _VariableFns(engine, params, scales)
    out_row = {name: i for i, name in enumerate(engine.outputs)}
    one = jnp.float32(1.0)
    series_min_order = _SERIES_MIN_ORDER if series_min_order is None else series_min_order

    def path_of(name: str) -> Tuple[Tuple[str, int], ...]:
        base, wrt = parse_name(name)
        steps, parent = [], base
        for var in wrt:
            steps.append((engine.scaler_key(parent) if engine.scaled else "", engine.inputs.index(var)))
            parent = SEP.join((parent, var))
        return tuple(steps)

    names = [n for level in engine.levels for n in level.names]
    paths = {n: path_of(n) for n in names}
    maximal = [p for p in dict.fromkeys(paths.values()) if not any(q != p and q[: len(p)] == p for q in paths.values())]

    def scale_at(path) -> jax.Array:
        """The scale the float16 tangents of the level ``path`` ends at carry (1 for outputs)."""
        return scales[path[-1][0]] if (path and engine.scaled) else one

    def chain(path):
        """``x -> (scaled tangents f32[n_outputs], aux)`` after the steps of ``path``; aux holds
        the unscaled vectors of the levels up to this one and the scaled tangents of each step."""
        if not path:

            def outputs(x):
                y = base_fns.outputs(x)
                return y, {"unscaled": [y], "scaled": []}

            return outputs
        pure = all(step[1] == path[0][1] for step in path)
        if pure and len(path) >= series_min_order:
            return pure_series(path)
        if pure and len(path) == 2:
            return pure_second(path)
        below, col = chain(path[:-1]), path[-1][1]

        def fn(x):
            seed = scale_at(path) / scale_at(path[:-1]) if engine.scaled else one  # s_k / s_{k-1}
            tangent = jnp.zeros((len(engine.inputs),), jnp.float32).at[col].set(seed)
            _, scaled, aux = jax.jvp(below, (x,), (tangent,), has_aux=True)
            unscaled = scaled * (one / scale_at(path)) if engine.scaled else scaled
            return scaled, {"unscaled": aux["unscaled"] + [unscaled], "scaled": aux["scaled"] + [scaled]}

        return fn

    def pure_second(path):
        """``chain(path)`` for a pure second derivative (``u__x__x``): one propagated tangent
        instead of nested ``jax.jvp``'s two (:mod:`jaxamp.taylor`)."""
        col = path[0][1]

        def fn(x):
            s1, s2 = scale_at(path[:1]), scale_at(path)
            tangent = jnp.zeros((len(engine.inputs),), jnp.float32).at[col].set(s1)
            # outer seed s2/s1 over inner seed s1, as two factors: s1**2 may underflow float32
            ratio = (s2 / s1, one / s1) if engine.scaled else None
            y, first, second = taylor.second_order(base_fns.outputs, x, tangent, ratio)
            levels = [y, first * (one / s1), second * (one / s2)] if engine.scaled else [y, first, second]
            return second, {"unscaled": levels, "scaled": [first, second]}

        return fn

    def pure_series(path):
        """``chain(path)`` for a pure derivative of order >= 3 (``u__x__x__x``): Taylor mode,
        one propagated chain per order, each carrying its own scale (:mod:`jaxamp.taylor_series`)."""
        col, order = path[0][1], len(path)

        def fn(x):
            direction = jnp.zeros((len(engine.inputs),), jnp.float32).at[col].set(one)
            s = [scale_at(path[: j + 1]) for j in range(order)] if engine.scaled else None
            y, scaled = taylor_series.derivatives(base_fns.outputs, x, direction, order, s)
            levels = [y] + ([d * (one / sj) for d, sj in zip(scaled, s)] if engine.scaled else list(scaled))
            return scaled[-1], {"unscaled": levels, "scaled": list(scaled)}

        return fn

    results = {}
    for path in maximal:
        _, aux = chain(path)(x)
        results[path] = (aux["unscaled"], aux["scaled"])
    values = {}
    flags: Dict[str, jax.Array] = {}
    for name in names:
        path = paths[name]
        levels, scaled = results[next(m for m in maximal if m[: len(path)] == path)]
        row = out_row[parse_name(name)[0]]
        values[name] = levels[len(path)][row]
        if engine.scaled:
            key = path[-1][0]
            hit = ~jnp.isfinite(scaled[len(path) - 1][row])  # step 3 on the scaled value
            flags[key] = hit if key not in flags else flags[key] | hit
    outputs = results[maximal[0]][0][0] if maximal else base_fns.outputs(x)
    values.update({n: outputs[i] for i, n in enumerate(engine.outputs)})
    return values, flags


def _jvp_chain(engine: "Derivatives", params, x: jax.Array, scales: Mapping[str, jax.Array]):
    """``point_values`` for ``forward_over_reverse``, as one chain of nested per-level functions.

    Each level's function returns its *scaled* derivatives (each row times the scale of the
    key that produced it) and, as auxiliary outputs, every level's unscaled values and scaled
    derivatives so far. Order 1: one ``jax.jacrev`` of the outputs, each row's seed scaled.
    Order k >= 2: ``jax.jvp`` of the order-(k-1) function along one input per (scaler key,
    input, key of the parent), the tangent seeded with ``s_k / s_{k-1}``, which by linearity
    is ``s_k`` times the derivative of the unscaled parent (as in :func:`_forward`). Every value
    the loss sees is computed once, and the weight gradient flows through one graph. Tangents
    no derivative needs are dead code that XLA removes.
    """
    n_in = len(engine.inputs)
    one = jnp.float32(1.0)

    def scale(key: str) -> jax.Array:
        return scales[key] if (key and engine.scaled) else one

    def by_jacrev(level):
        rows = jnp.asarray(level.parent_rows)
        keys = [level.parent_keys[p] for p in level.child_parent]

        def seeded(x):
            vals = _VariableFns(engine, params, scales).outputs(x)
            return vals[rows] * jnp.stack([scale(k) for k in level.parent_keys]), vals

        def level_fn(x):
            jac, vals = jax.jacrev(seeded, has_aux=True)(x)
            scaled = jnp.stack([jac[p, col] for p, col in zip(level.child_parent, level.child_input)])
            unscaled = scaled * jnp.stack([one / scale(k) for k in keys])
            return scaled, {"values": [vals, unscaled], "scaled": [scaled]}

        return level_fn

    def by_jvp(below, level, below_keys: Sequence[str]):
        """``below_keys``: for each row of the level below, the key its scale came from."""
        keys = [level.parent_keys[p] for p in level.child_parent]
        groups: Dict[Tuple[str, int, str], List[int]] = {}
        for c, (key, col) in enumerate(zip(keys, level.child_input)):
            prev = below_keys[level.parent_rows[level.child_parent[c]]]
            groups.setdefault((key, col, prev), []).append(c)

        def level_fn(x):
            scaled: List = [None] * len(level.names)
            for (key, col, prev), children in groups.items():
                tangent = jnp.zeros((n_in,), jnp.float32).at[col].set(scale(key) / scale(prev))
                _, tangents, aux = jax.jvp(below, (x,), (tangent,), has_aux=True)
                for c in children:
                    scaled[c] = tangents[level.parent_rows[level.child_parent[c]]]
            stacked = jnp.stack(scaled)
            unscaled = stacked * jnp.stack([one / scale(k) for k in keys])
            return stacked, {"values": aux["values"] + [unscaled], "scaled": aux["scaled"] + [stacked]}

        return level_fn

    fn, produced_by = None, None
    for depth, level in enumerate(engine.levels):
        fn = by_jvp(fn, level, produced_by) if depth else by_jacrev(level)
        produced_by = [level.parent_keys[p] for p in level.child_parent]
    if fn is None:
        vectors = [_VariableFns(engine, params, scales).outputs(x)]
        aux = {"scaled": []}
    else:
        _, aux = fn(x)
        vectors = aux["values"]
    values = {}
    for names, vec in zip([engine.outputs] + [lv.names for lv in engine.levels], vectors):
        values.update({n: vec[i] for i, n in enumerate(names)})
    flags: Dict[str, jax.Array] = {}
    if engine.scaled:
        for level, scaled in zip(engine.levels, aux["scaled"]):
            bad = ~jnp.isfinite(scaled)  # step 3: check the scaled values, per key
            for key in dict.fromkeys(level.parent_keys):
                hit = jnp.any(jnp.stack([bad[c] for c, p in enumerate(level.child_parent) if level.parent_keys[p] == key]))
                flags[key] = hit if key not in flags else flags[key] | hit
    return values, flags


def _check_names(arg: str, names: Sequence[str]) -> Tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"Derivatives: `{arg}`={names!r} must be a list of names (strings).")
    names = tuple(names)
    if not names:
        raise ValueError(f"Derivatives: `{arg}` is empty; give at least one name.")
    for n in names:
        if not n or SEP in n or not n.isidentifier():
            raise ValueError(
                f"Derivatives: {arg} name {n!r} is not allowed: names must be identifiers without '{SEP}'."
            )
    if len(set(names)) != len(names):
        raise ValueError(f"Derivatives: `{arg}`={list(names)} has duplicates.")
    return names
