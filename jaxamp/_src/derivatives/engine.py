"""`Derivatives`: the engine of named, scaled derivatives of a per-point network (see the package docstring)."""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from jaxamp._src.scaling.config import AmpConfig, check_flags
from jaxamp._src.derivatives import forward_engine as forward
from jaxamp._src.derivatives.plan import Plan, make_plan, mark_params, parent_of, parse_name, run_marked, scaler_key
from jaxamp._src.derivatives.grad import grad
from jaxamp._src.derivatives.laplacian import laplacian
from jaxamp._src.core.marks import deriv_check

PointFn = Callable[..., jax.Array]  # fn(params, x: f32[n_inputs]) -> f32[n_outputs]
# engine(plan, f, x, scales) -> (values {name: f32[]}, scaled {derivative: f32[]}) at one point
PointEngine = Callable[[Plan, Callable[[jax.Array], jax.Array], jax.Array, Mapping[str, jax.Array]],
                       Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]]
ENGINES: Dict[str, PointEngine] = {"forward": forward.point_values}
METHODS = ("forward", "reverse")

__all__ = ["Derivatives", "ENGINES", "METHODS", "PointEngine"]


class Derivatives:
    """Engine for named, scaled derivatives of a per-point network function.

    Args:
      fn: ``fn(params, x) -> y`` for ONE point, ``x: f32[len(inputs)]``, ``y: f32[len(outputs)]``.
      inputs, outputs: names of the entries of ``x`` and ``y`` (``("x", "y")``, ``("u", "p")``).
      derivatives: names to compute (``("u__x", "u__y__y")``), lower orders included;
        ``"u__lap"`` is the Laplacian of ``u`` over ``laplacian_inputs`` (:func:`jaxamp.laplacian`).
      amp: mixed-precision settings; ``None`` or inactive derivative scalers: plain derivatives
        (every scale 1, no checks, no scaler keys).
      method: ``"forward"`` (default, :mod:`jaxamp._src.derivatives.forward_engine`), ``"reverse"`` (nested
        :func:`jaxamp.grad`, the reference path), or a point engine of your own,
        ``engine(plan, f, x, scales) -> (values, scaled)`` (:data:`PointEngine`).
      laplacian_inputs: the inputs a ``"<output>__lap"`` sums over; None (default): every input.
      mask_nonfinite_points: when True, points with a non-finite input return 0 and raise no
        flag (weigh them out with :meth:`point_weights`); else they flag :data:`NONFINITE_VALUES`.

    Use ``jaxamp.scaled(engine)(scales, params, points) -> (values, found_inf)`` or a loss under
    :func:`jaxamp.value_and_grad` / :func:`jaxamp.make_train_step`.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> eng = jaxamp.Derivatives(lambda p, x: jnp.stack([jnp.sin(x[0])]), inputs=("x",),
      ...                          outputs=("u",), derivatives=("u__x__x",), amp=jaxamp.AmpConfig())
      >>> values, found_inf = jaxamp.scaled(eng)({"1": 1.0, "2": 1.0}, None, {"x": jnp.zeros(4)})
      >>> sorted(values), sorted(found_inf)
      (['u', 'u__x', 'u__x__x'], ['1', '2', 'nonfinite_values'])
    """

    def __init__(self, fn: PointFn, *, inputs: Sequence[str], outputs: Sequence[str], derivatives: Sequence[str],
                 amp: Optional[AmpConfig] = None, method: Union[str, PointEngine] = "forward",
                 laplacian_inputs: Optional[Sequence[str]] = None, mask_nonfinite_points: bool = False) -> None:
        if not (callable(method) or method in METHODS):
            raise ValueError(f"Derivatives: `method`={method!r} is not supported: expected one of "
                             f"{list(METHODS)} or a point engine engine(plan, f, x, scales) -> "
                             "(values, scaled).")
        if not callable(fn):
            raise TypeError(f"Derivatives: `fn`={fn!r} must be callable as fn(params, x).")
        check_flags("Derivatives", mask_nonfinite_points=mask_nonfinite_points)
        self.amp = amp if amp is not None else AmpConfig(enabled=False)
        if not isinstance(self.amp, AmpConfig):
            raise TypeError(f"Derivatives: `amp`={amp!r} must be an AmpConfig or None.")
        self.fn, self.method, self.mask_nonfinite_points = fn, method, mask_nonfinite_points
        self.engine: Optional[PointEngine] = ENGINES.get(method) if isinstance(method, str) else method
        self.plan: Plan = make_plan(inputs, outputs, derivatives, self.amp, laplacian_inputs=laplacian_inputs)
        self.inputs, self.outputs, self.requested = self.plan.inputs, self.plan.outputs, self.plan.requested
        self.levels, self.names, self.scaled = self.plan.levels, self.plan.names, self.plan.scaled
        self.scaler_keys: Tuple[str, ...] = self.plan.scaler_keys

    def scaler_key(self, parent: str) -> str:
        """The scaler key that guards differentiating ``parent`` (docs/algorithm.md, "Scaler keys")."""
        return scaler_key(self.amp, parent)

    def __call__(self, params, points: Union[Mapping[str, jax.Array], jax.Array], *extra) -> Dict[str, jax.Array]:
        """Values and derivatives at a batch of points (at scale 1 outside :func:`jaxamp.scaled`).

        Args:
          params: the network parameters passed to ``fn``.
          points: ``{input name: f32[N]}`` or an array ``f32[N, n_inputs]``.

        Returns:
          ``values[name]``: ``f32[N]`` (unscaled) for every output and derivative, 0 at masked
          points. Under :func:`jaxamp.scaled`, ``found_inf[key]`` is True where a derivative of
          ``key`` overflowed, ``found_inf[NONFINITE_VALUES]`` where an input or output is bad.
        """
        if extra:
            raise TypeError(f"Derivatives: called with {2 + len(extra)} arguments; an engine takes "
                            "(params, points) and no scales: jaxamp.scaled(engine)(scales, params, "
                            "points) returns (values, found_inf), and in a loss under "
                            "jaxamp.value_and_grad or make_train_step the state gives the scales.")
        x = self.stack_points(points)
        if not self.mask_nonfinite_points:
            return self.marked(params, x)[0]
        weights = self._weights(x)
        x = jnp.where(weights[:, None] > 0, x, jnp.zeros_like(x))  # a finite stand-in
        values = self.marked(params, x)[0]
        return {k: jnp.where(weights > 0, v, jnp.zeros_like(v)) for k, v in values.items()}

    def marked_program(self, params, points) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
        """:meth:`marked` at ``points`` as the engine takes them (what :func:`jaxamp.profile` reads)."""
        return self.marked(params, self.stack_points(points))

    def marked(self, params, x: jax.Array) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
        """The derivative program of jaxamp's marks at the points ``x`` (``f32[N, n_inputs]``):
        ``(values, checked)``, the unscaled values and the checked scaled results (none for
        ``method="reverse"`` and the Laplacians, checked by their own calls)."""
        plan, marks_of = self.plan, {k: mark_params(k) for k in self.plan.step_keys}

        def f(z: jax.Array) -> jax.Array:  # fn(params, .) at one point, its shape checked
            y = jnp.asarray(self.fn(params, z))
            if y.shape != (len(self.outputs),):
                raise ValueError(f"Derivatives: fn(params, x) returned shape {y.shape} for one "
                                 f"point; expected ({len(self.outputs)},) for outputs "
                                 f"{list(self.outputs)}.")
            return y.astype(jnp.float32)

        how = "reverse" if self.engine is None else "collapsed"
        laps = {name: laplacian(lambda z, i=self.outputs.index(parse_name(name)[0]): f(z)[i], of=parse_name(name)[0],
                                indices=plan.laplacian_cols, method=how) for name in plan.laplacians}

        def point(p):
            if self.engine is None:  # method="reverse": nested jaxamp.grad
                values, checked = self._nested_grads(f, p)
            else:
                values, checked = run_marked(plan, self.engine, f, p, marks_of)
            return {**values, **{name: lap(p) for name, lap in laps.items()}}, checked

        values, checked = jax.vmap(point)(x)  # batched marks: one seed per point, as torch
        if plan.scaled:  # bad values of every output, derivatives taken of it or not (order 0)
            # one check per output, no stack: the values' graph stays the unscaled engine's
            values = {**values, **{o: deriv_check(values[o], values[o], order=0, term=None) for o in self.outputs}}
        return values, checked

    def _nested_grads(self, f: Callable[[jax.Array], jax.Array], x: jax.Array):
        """One point as nested :func:`jaxamp.grad`: one reverse pass per differentiated variable."""
        plan, fns, grads = self.plan, {}, {}

        def value(name: str) -> Callable[[jax.Array], jax.Array]:
            if name not in fns:
                if name in plan.outputs:
                    row, fun = plan.outputs.index(name), f
                else:  # a column of its parent's gradient
                    row, fun = plan.inputs.index(parse_name(name)[1][-1]), grad_of(parent_of(name))
                fns[name] = lambda z: fun(z)[row]
            return fns[name]

        def grad_of(name: str) -> Callable[[jax.Array], jax.Array]:
            if name not in grads:
                grads[name] = grad(value(name), of=name, method="reverse")
            return grads[name]

        y = f(x)
        values = {name: y[i] for i, name in enumerate(plan.outputs)}
        for level in plan.levels:
            g = {parent: grad_of(parent)(x) for parent in level.parents}
            for name, p, col in zip(level.names, level.child_parent, level.child_input):
                values[name] = g[level.parents[p]][col]
        return values, {}

    def point_weights(self, points: Union[Mapping[str, jax.Array], jax.Array]) -> jax.Array:
        """``f32[N]``: each point's weight in a residual mean, 0 where the engine masks it, else 1.

        Example:
          >>> import jax.numpy as jnp, jaxamp
          >>> eng = jaxamp.Derivatives(lambda p, x: x[:1] ** 2, inputs=("x",), outputs=("u",),
          ...                          derivatives=("u__x",), mask_nonfinite_points=True)
          >>> points = jnp.array([[1.0], [jnp.nan], [2.0]])
          >>> w = eng.point_weights(points)
          >>> values = eng(None, points)
          >>> w, jnp.sum(w * values["u__x"] ** 2) / jnp.maximum(jnp.sum(w), 1.0)
          (Array([1., 0., 1.], dtype=float32), Array(10., dtype=float32))
        """
        x = self.stack_points(points)
        return self._weights(x) if self.mask_nonfinite_points else jnp.ones(x.shape[:1], jnp.float32)

    @staticmethod
    def _weights(x: jax.Array) -> jax.Array:
        return jnp.all(jnp.isfinite(x), axis=-1).astype(jnp.float32)

    def stack_points(self, points: Union[Mapping[str, jax.Array], jax.Array]) -> jax.Array:
        """``f32[N, n_inputs]`` from ``{input: f32[N]}`` or an array, or an error naming the problem."""
        if isinstance(points, Mapping):
            missing = [n for n in self.inputs if n not in points]
            if missing:
                raise KeyError(f"Derivatives: `points` lacks input(s) {missing}; it has {sorted(points)}.")
            cols = [jnp.asarray(points[n]) for n in self.inputs]
            for n, c in zip(self.inputs, cols):
                if c.ndim != 1 or c.shape != cols[0].shape:
                    raise ValueError(f"Derivatives: points[{n!r}] has shape {c.shape}; every input "
                                     "must be a 1-D array of the same length N (here "
                                     f"{cols[0].shape}).")
            x = jnp.stack(cols, axis=-1)
        else:
            x = jnp.asarray(points)
            if x.ndim != 2 or x.shape[-1] != len(self.inputs):
                raise ValueError(f"Derivatives: `points` has shape {x.shape}; expected [N, "
                                 f"{len(self.inputs)}] for inputs {list(self.inputs)}.")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"Derivatives: `points` must be floating point (float32), got dtype {x.dtype}.")
        return x.astype(jnp.float32)
