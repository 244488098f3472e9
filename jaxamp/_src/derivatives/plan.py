"""The plan of a derivative engine (:func:`make_plan`): names, levels, paths and scaler keys.

A derivative's *path* is its steps ``(key, input index)``: per order, ``u__x__y`` is
``(("1", 0), ("2", 1))``; a step's key guards differentiating the variable below it
(docs/algorithm.md, "Scaler keys").
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import jax.numpy as jnp

from jaxamp._src.core import marks
from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.core.marks import SEP

__all__ = ["LAP", "Step", "Path", "parse_name", "order_of", "parent_of", "Level", "Plan", "scaler_key", "mark_params",
           "run_marked", "make_plan", "check_names"]

LAP = "lap"  # "u__lap": the Laplacian of u; its second step's per-term key

Step = Tuple[str, int]  # (scaler key, index of the input differentiated by)
Path = Tuple[Step, ...]


def parse_name(name: str) -> Tuple[str, Tuple[str, ...]]:
    """``"u__x__y"`` -> ``("u", ("x", "y"))``.

    Example:
      >>> from jaxamp._src.derivatives.plan import parse_name
      >>> parse_name("u__x__y")
      ('u', ('x', 'y'))
    """
    parts = name.split(SEP)
    return parts[0], tuple(parts[1:])


def order_of(name: str) -> int:
    """The derivative order of a name: ``order_of("u__x__y") == 2``, ``order_of("u") == 0``."""
    return len(parse_name(name)[1])


def parent_of(name: str) -> str:
    """The variable a derivative differentiates: ``parent_of("u__x__y") == "u__x"``."""
    return name.rsplit(SEP, 1)[0]


@dataclasses.dataclass(frozen=True)
class Level:
    """How one derivative order is obtained from the order below it.

    Attributes:
      parents, parent_rows, parent_keys: the names differentiated at this level (of the order
        below), their rows in the level below's value vector and their scaler keys.
      names: the derivatives this level produces; ``child_parent``, ``child_input``: per name,
        its index into ``parents`` and the index of the input it differentiates by.
    """

    parents: Tuple[str, ...]
    parent_rows: Tuple[int, ...]
    parent_keys: Tuple[str, ...]
    names: Tuple[str, ...]
    child_parent: Tuple[int, ...]
    child_input: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an engine computes and under which scaler keys (static).

    Attributes:
      inputs, outputs: the names of the network's inputs and outputs.
      requested: the derivatives asked for.
      scaled: whether float16 derivative scaling acts (the engine checks and reports flags).
      levels: one :class:`Level` per derivative order, lowest first.
      derivatives: every derivative computed (requested and those below them), by order.
      paths: ``{derivative: ((key, input index), ...)}``; step_keys: every key a step uses.
      scaler_keys: the keys a user keeps scalers for (steps' and Laplacians'); empty unscaled.
      laplacians, laplacian_cols: the ``"u__lap"`` asked for and the inputs they sum over.
    """

    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    requested: Tuple[str, ...]
    scaled: bool
    levels: Tuple[Level, ...]
    derivatives: Tuple[str, ...]
    paths: Mapping[str, Path]
    step_keys: Tuple[str, ...]
    scaler_keys: Tuple[str, ...]
    laplacians: Tuple[str, ...] = ()
    laplacian_cols: Tuple[int, ...] = ()

    @property
    def names(self) -> Tuple[str, ...]:
        """Every value the engine returns: the outputs, the derivatives by order, the Laplacians."""
        return self.outputs + self.derivatives + self.laplacians

    def maximal_paths(self) -> Tuple[Path, ...]:
        """The paths that are no other path's prefix: one evaluation of each yields every value."""
        paths = tuple(dict.fromkeys(self.paths[n] for n in self.derivatives))
        return tuple(p for p in paths if not any(q != p and q[: len(p)] == p for q in paths))


def scaler_key(amp: Optional[AmpConfig], parent: str) -> str:
    """The scaler key that guards differentiating ``parent`` (docs/algorithm.md, "Scaler keys").

    Example:
      >>> from jaxamp import AmpConfig
      >>> from jaxamp._src.derivatives.plan import scaler_key
      >>> scaler_key(AmpConfig(), "u__x")
      '2'
    """
    return marks.scaler_key(amp, order_of(parent) + 1, parent)


def mark_params(key: str) -> Dict[str, object]:
    """The ``order`` and ``term`` of the scale mark of a step under ``key`` at a point of order 0
    (which :func:`jaxamp._src.core.marks.scaler_key` maps back to ``key``)."""
    return {"order": int(key), "term": None} if key.isdigit() else {"order": order_of(key) + 1, "term": key}


def run_marked(plan: "Plan", point_engine: Callable, f: Callable, x, marks_of: Mapping[str, Dict[str, object]],
               wrt_of: Optional[Mapping[str, Optional[str]]] = None):
    """One point of ``plan`` by ``point_engine``, marked: ``(values, checked)``. Each key's scale
    is a ``deriv_scale_p`` of ``marks_of[key]`` at the point; each value is named the derivative
    one step above its parent (``wrt_of[name]``: its variable's name; default the plan's input),
    so that a step's order follows from the program (:mod:`jaxamp._src.core.nesting`); scaled plans check
    each scaled result."""
    step_scales = {k: marks.deriv_scale(x[0], **marks_of[k]) for k in plan.step_keys}
    values, scaled_values = point_engine(plan, f, x, step_scales)
    values, checked, ok = dict(values), {}, {}
    if plan.scaled:
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in (x if isinstance(x, tuple) else (x,))]))
        ok = {o: finite for o in plan.outputs}
    for name in plan.derivatives:  # by order: a parent is named before its children
        parent, key = parent_of(name), plan.paths[name][-1][0]
        wrt = parse_name(name)[1][-1] if wrt_of is None else wrt_of.get(name)
        step = dict(order=1, term=marks_of[key]["term"], wrt=wrt)
        if plan.scaled:
            ok[name] = ok[parent] & jnp.isfinite(values[parent])
            below = jnp.where(ok[name], values[parent], jnp.nan)  # finite where every value below is
            checked[name] = marks.deriv_check(scaled_values[name], below, **step)
        values[name] = marks.deriv_check(values[name], values[parent], **step, check=False)
    return values, checked if plan.scaled else scaled_values


def make_plan(inputs: Sequence[str], outputs: Sequence[str], derivatives: Sequence[str], amp: AmpConfig, *,
              laplacian_inputs: Optional[Sequence[str]] = None) -> Plan:
    """Validate the names (errors name the bad argument) and build the :class:`Plan`."""
    inputs, outputs = check_names("inputs", inputs), check_names("outputs", outputs)
    if set(inputs) & set(outputs):
        raise ValueError(f"Derivatives: names {sorted(set(inputs) & set(outputs))} appear in both "
                         "`inputs` and `outputs`; each name must be one or the other.")
    if isinstance(derivatives, str):
        raise TypeError(f"Derivatives: `derivatives`={derivatives!r} must be a list of names, not a string.")
    requested = tuple(derivatives)
    laplacians = tuple(dict.fromkeys(n for n in requested if _is_laplacian(n, inputs, outputs)))
    for name in requested:
        if name not in laplacians:
            _check_derivative_name(name, inputs, outputs)
    lap_inputs = inputs if laplacian_inputs is None else check_names("laplacian_inputs", laplacian_inputs)
    if set(lap_inputs) - set(inputs):
        raise ValueError(f"Derivatives: `laplacian_inputs` names {sorted(set(lap_inputs) - set(inputs))}, which "
                         f"are not inputs; inputs are {list(inputs)}.")
    scaled = amp.scaler_enabled
    key = lambda parent: scaler_key(amp if scaled else None, parent)  # noqa: E731
    needed = {SEP.join((base, *wrt[:k])) for base, wrt in map(parse_name, requested) if SEP.join((base, *wrt))
              not in laplacians for k in range(1, len(wrt) + 1)}
    below, levels = list(outputs), []
    for order in range(1, max((order_of(n) for n in needed), default=0) + 1):
        names = tuple(sorted(n for n in needed if order_of(n) == order))
        parents = tuple(sorted({parent_of(n) for n in names}))
        levels.append(Level(
            parents=parents,
            parent_rows=tuple(below.index(p) for p in parents),
            parent_keys=tuple(key(p) for p in parents),
            names=names,
            child_parent=tuple(parents.index(parent_of(n)) for n in names),
            child_input=tuple(inputs.index(parse_name(n)[1][-1]) for n in names),
        ))
        below = list(names)
    derivs = tuple(n for level in levels for n in level.names)
    paths: Dict[str, Path] = {}
    for name in derivs:  # by order, so the parent's path is known
        parent = parent_of(name)
        paths[name] = paths.get(parent, ()) + ((key(parent), inputs.index(parse_name(name)[1][-1])),)
    step_keys = tuple(dict.fromkeys(k for level in levels for k in level.parent_keys))
    lap_keys = [k for n in laplacians for k in (marks.scaler_key(amp, 1, parent_of(n)), marks.scaler_key(amp, 2, n))]
    return Plan(inputs=inputs, outputs=outputs, requested=requested, scaled=scaled, levels=tuple(levels),
                derivatives=derivs, paths=paths, step_keys=step_keys,
                scaler_keys=tuple(dict.fromkeys(step_keys + tuple(lap_keys))) if scaled else (),
                laplacians=laplacians, laplacian_cols=tuple(inputs.index(n) for n in lap_inputs))


def _is_laplacian(name, inputs: Tuple[str, ...], outputs: Tuple[str, ...]) -> bool:
    """Whether ``name`` is ``"<output>__lap"`` (``lap`` not an input); a derivative's: an error."""
    parts = name.split(SEP) if isinstance(name, str) else ()
    if not parts or parts[-1] != LAP or LAP in inputs or parts[0] not in outputs:
        return False
    if len(parts) != 2:
        raise ValueError(f"Derivatives: derivative {name!r} is not allowed: a Laplacian is '<output>{SEP}{LAP}' "
                         "(of an output, over `laplacian_inputs`); take derivatives of it with jaxamp.laplacian.")
    return True


def _check_derivative_name(name, inputs: Tuple[str, ...], outputs: Tuple[str, ...]) -> None:
    if not isinstance(name, str):
        raise TypeError(f"Derivatives: derivative name {name!r} must be a string like 'u__x'.")
    base, wrt = parse_name(name)
    if base not in outputs:
        raise ValueError(f"Derivatives: derivative {name!r} differentiates {base!r}, which is not "
                         f"an output; outputs are {list(outputs)}.")
    for var in wrt:
        if var not in inputs:
            raise ValueError(f"Derivatives: derivative {name!r} is taken with respect to {var!r}, "
                             f"which is not an input; inputs are {list(inputs)}.")


def check_names(arg: str, names: Sequence[str]) -> Tuple[str, ...]:
    """``names`` as a tuple, or an error naming ``arg``: identifiers without ``__``, unique, non-empty."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"Derivatives: `{arg}`={names!r} must be a list of names (strings).")
    names = tuple(names)
    if not names:
        raise ValueError(f"Derivatives: `{arg}` is empty; give at least one name.")
    for n in names:
        if not n or SEP in n or not n.isidentifier():
            raise ValueError(f"Derivatives: {arg} name {n!r} is not allowed: names must be "
                             f"identifiers without '{SEP}'.")
    if len(set(names)) != len(names):
        raise ValueError(f"Derivatives: `{arg}`={list(names)} has duplicates.")
    return names
