"""Nested :func:`jaxamp.grad` along per-point scalar inputs, computed by the Derivatives engine.

A user's ``grad(grad(u_net, 2), 2)(params, t, x)`` with scalar ``t, x`` is one *chain*, the
plan of one named derivative (``u__a2__a2``), its steps marked with the orders and names the
nested calls would have reported (docs/algorithm.md, "Engines").
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.derivatives import forward_engine as forward
from jaxamp._src.derivatives.plan import make_plan, order_of, run_marked
from jaxamp._src.core.interpreter import bind, cse, eval_jaxpr, substitute
from jaxamp._src.core.marks import SEP, fresh

__all__ = ["Along", "Chain", "METHODS", "check_output", "register", "link_of", "extend", "eligible", "positions",
           "evaluate"]

METHODS = ("auto", "forward", "reverse")
# per-term keys (the parents' plan names): the plan's own step keys, each mapped to a mark below
_PLAN_AMP = AmpConfig(mode="per_term_scaler")


@dataclasses.dataclass(frozen=True)
class Along:
    """A step along a direction (``jaxamp.jvp`` along a vector): the arguments at positions
    ``args`` move by the direction operands at positions ``dirs`` of the chain's equation (its
    operands after the point's, :mod:`jaxamp._src.derivatives.chain_call`)."""

    args: Tuple[int, ...]
    dirs: Tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Chain:
    """A nest of ``grad`` calls: ``base`` and, innermost first, the argnum (an int, or an
    :class:`Along` direction) and name of each step; ``out``: the entry of ``base``'s value it
    differentiates (``()``: the value is a scalar).

    Equal when ``base`` is the same function object (``is``: the chain holds it) and the steps are
    equal; hashed by the steps: a user's callable is never hashed or compared by value, as an
    Equinox or NNX module holding arrays (tracers, under a trace) can be neither."""

    base: Callable[..., Any]
    argnums: Tuple[Any, ...]
    wrts: Tuple[Optional[str], ...]
    of: Optional[str]
    out: Tuple[int, ...] = ()

    def _steps(self) -> Tuple[Any, ...]:
        return (self.argnums, self.wrts, self.of, self.out)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Chain) and self.base is other.base and self._steps() == other._steps()

    def __hash__(self) -> int:
        return hash(self._steps())


# The attribute of a jaxamp.grad derivative function naming the chain it computes, with the code
# of the function that set it: a wrapper of it (functools.wraps copies attributes: another jaxamp
# transform, autocast, the user's own) has other code, so it is not that derivative and starts a
# chain of its own.
_ATTRIBUTE = "__jaxamp_chain__"


def register(derivative: Callable[..., Any], link: Optional[Chain]) -> None:
    """Record on ``derivative`` (a ``jaxamp.grad`` function) that it computes ``link`` (None: no
    chain; set on every derivative, so one never keeps what ``functools.wraps`` copied)."""
    setattr(derivative, _ATTRIBUTE, (link, derivative.__code__))


def link_of(fun: Any) -> Optional[Chain]:
    """The chain ``fun`` computes if it is a ``jaxamp.grad`` function registered as one, else None."""
    entry = getattr(fun, _ATTRIBUTE, None)
    if not (isinstance(entry, tuple) and len(entry) == 2):
        return None
    link, code = entry
    return link if code is getattr(fun, "__code__", None) else None


def extend(fun: Callable[..., Any], argnums: Any, of: Optional[str], wrt: Any) -> Optional[Chain]:
    """The chain of ``grad(fun, argnums)``: ``fun``'s chain one step longer, a new one, or None."""
    if not isinstance(argnums, int) or isinstance(argnums, bool):
        return None
    inner = link_of(fun)
    if inner is not None and of is None:
        return Chain(inner.base, inner.argnums + (argnums,), inner.wrts + (wrt,), inner.of, inner.out)
    return Chain(fun, (argnums,), (wrt,), of)


def positions(chain: Chain) -> Tuple[int, ...]:
    """The argument positions ``chain``'s steps move, in order of first use."""
    return tuple(dict.fromkeys(i for a in chain.argnums for i in (a.args if isinstance(a, Along) else (a,))))


def eligible(chain: Optional[Chain], args: Tuple[Any, ...], kwargs: dict) -> bool:
    """Whether every argument ``chain`` differentiates is a float32 scalar given by position."""
    if chain is None or kwargs:
        return False
    return all(i < len(args) and (hasattr(args[i], "dtype") or isinstance(args[i], float))
               and jnp.shape(args[i]) == () and jnp.result_type(args[i]) == jnp.float32
               for i in positions(chain))


def check_output(caller: str, fun: Callable, out: Any, *, scalar: bool = True) -> Any:
    """``out`` if it is one array, a scalar unless ``scalar`` is False; else a TypeError (for a
    vector where a scalar is needed, one that names the way out: jacrev)."""
    if not hasattr(out, "dtype"):
        raise TypeError(f"{caller}: `fun`={fun!r} must return one array, got {type(out).__name__}.")
    if scalar and jnp.shape(out) != ():
        raise TypeError(f"{caller}: `fun`={fun!r} returned shape {jnp.shape(out)}; grad needs a scalar output. "
                        "For a vector-valued function use jaxamp.jacrev (or jaxamp.jacfwd).")
    return out


def _name(step: Any, along: Dict["Along", int]) -> str:
    """A step's input in the plan: ``a2`` for argument 2, ``d0`` for the first direction."""
    return f"d{along[step]}" if isinstance(step, Along) else f"a{step}"


def _node(chain: Chain, k: int, output: str, along: Optional[Dict["Along", int]] = None) -> str:
    """The plan name (``u0__a2__a2``) of the value ``k`` steps of ``chain`` above ``output``."""
    return SEP.join((output,) + tuple(_name(a, along or {}) for a in chain.argnums[:k]))


def _order_key(step: Any) -> Tuple[Any, ...]:
    """Steps sorted: arguments by position, then directions."""
    return (1, step.args, step.dirs) if isinstance(step, Along) else (0, step)


def canonical(chain: Chain) -> Chain:
    """``chain`` with its steps in the order of their arguments where that changes none of its
    marks (the variables' names read in the same order): mixed partials are symmetric, so
    ``u__y__x`` and ``u__x__y`` are one path of the plan."""
    order = sorted(range(len(chain.argnums)), key=lambda k: _order_key(chain.argnums[k]))
    if tuple(chain.wrts[k] for k in order) != chain.wrts:
        return chain
    return Chain(chain.base, tuple(chain.argnums[k] for k in order), chain.wrts, chain.of, chain.out)


# Steps of a chain up to which the plan weighs every order of them (beyond: the arguments' order
# and the pure runs first).
_PERMUTED = 6


def _orders(c: Chain) -> List[Tuple[Any, ...]]:
    """The orders of ``c``'s steps that read its marks the same (mixed partials are symmetric):
    the arguments' order (:func:`canonical`), the longest pure runs first (a pure run is one
    Taylor pass), then every other."""
    steps, k = c.argnums, len(c.argnums)
    count = collections.Counter(steps)
    perms = [sorted(range(k), key=lambda i: _order_key(steps[i])),
             sorted(range(k), key=lambda i: (-count[steps[i]], _order_key(steps[i])))]
    if k <= _PERMUTED:
        perms += itertools.permutations(range(k))
    out = (tuple(steps[i] for i in perm) for perm in perms if tuple(c.wrts[i] for i in perm) == c.wrts)
    return list(dict.fromkeys(out))


def ordered(chains: Sequence[Chain]) -> List[Chain]:
    """``chains`` (planned at one point) with their steps in the orders (:func:`_orders`) whose
    passes carry the least: the arguments' order, or each chain in turn, shortest or longest
    first, the order adding least to the passes before it (ties: the arguments' order)."""
    options = [_orders(c) for c in chains]
    if all(len(o) == 1 for o in options):
        return list(chains)
    first = forward.Passes()
    for o in options:
        first.add(o[0])
    plans = [(first.cost, [o[0] for o in options])]
    for longest in (False, True):
        passes, choice = forward.Passes(), [o[0] for o in options]
        for i in sorted(range(len(chains)), key=lambda i: len(chains[i].argnums), reverse=longest):
            choice[i] = min(options[i], key=passes.extra)
            passes.add(choice[i])
        plans.append((passes.cost, choice))
    best = min(plans, key=lambda p: p[0])[1]
    return [dataclasses.replace(c, argnums=steps) for c, steps in zip(chains, best)]


def _expanded(c: Chain) -> List[Tuple[Tuple[int, ...], Chain]]:
    """``c`` with each direction step replaced by the steps along the arguments it moves:
    ``[(direction operands whose product is the coefficient, chain along arguments)]``, whose
    sum is ``c`` (derivatives are linear in the direction)."""
    out: List[Tuple[Tuple[int, ...], Chain]] = [((), dataclasses.replace(c, argnums=()))]
    for step in c.argnums:
        pairs = zip(step.args, step.dirs) if isinstance(step, Along) else [(step, None)]
        out = [(coef + (() if d is None else (d,)), dataclasses.replace(b, argnums=b.argnums + (i,)))
               for coef, b in out for i, d in pairs]
    return [(coef, canonical(b)) for coef, b in out]


def _requests(chains: Sequence[Chain], base_of: Sequence[int]):
    """The chains a plan computes for ``chains`` and, per chain, ``[(coefficient operands, index
    into them)]`` summing to it. A chain with direction steps is the sum of its steps along the
    arguments (:func:`_expanded`) when at most one of those is not computed anyway (each is a
    pass along its steps, of every output of every base: one function of the point); else its
    direction is one more input of the plan (one tangent along it)."""
    present = {c.argnums[:k] for c in chains
               if not any(isinstance(a, Along) for a in c.argnums) for k in range(len(c.argnums) + 1)}
    planned: List[Tuple[int, Chain]] = []
    sums: List[List[Tuple[Tuple[int, ...], int]]] = []
    at: Dict[Tuple[Any, ...], int] = {}  # (base, entry, steps) -> its place in planned: one plan node

    def index(b: int, c: Chain) -> int:
        if (b, c.out, c.argnums) not in at:
            at[(b, c.out, c.argnums)] = len(planned)
            planned.append((b, c))
        return at[(b, c.out, c.argnums)]

    for b, c in zip(base_of, chains):
        parts = _expanded(c)
        if len(parts) > 1 and sum(e.argnums not in present for _, e in parts) > 1:
            parts = [((), c)]  # one pass along the direction
        sums.append([(coef, index(b, e)) for coef, e in parts])
    return planned, sums


def _along_arguments(s: Chain) -> List[Any]:
    """``s``'s steps, a direction moving one argument as a step along that argument."""
    return [a.args[0] if isinstance(a, Along) and len(a.args) == 1 else a for a in s.argnums]


def _covers(s: Chain, b: int, planned: Sequence[Tuple[int, Chain]]) -> List[int]:
    """The planned chains (indices) whose passes hold a value of ``s``'s order below their top,
    along the same arguments, with the same marks: chains of base ``b``'s entry ``s.out``
    whose steps include ``s``'s (a direction moving one argument: a step along it) and whose
    first steps' names are ``s``'s."""
    steps = _along_arguments(s)
    k, need = len(steps), collections.Counter(steps)
    if any(isinstance(a, Along) for a in steps):
        return []
    return [j for j, (bj, c) in enumerate(planned)
            if bj == b and c.out == s.out and c.of == s.of and len(c.argnums) >= k and c.wrts[:k] == s.wrts
            and not any(isinstance(a, Along) for a in c.argnums) and not need - collections.Counter(c.argnums)]


def evaluate(chains: Sequence[Chain], base_of: Sequence[int], bases: Sequence[Callable], args: Tuple[Any, ...],
             base_order: int, base_term: Optional[str], shapes: Optional[Sequence[Tuple[int, ...]]] = None,
             dirs: Sequence[Any] = (), soft: Sequence[bool] = (), scaled: bool = False) -> List[jax.Array]:
    """The top derivatives of ``chains`` at the positional ``args`` by one engine plan, marked.

    ``chains[i]`` differentiates entry ``chains[i].out`` of ``bases[base_of[i]]`` (a function
    of ``args`` returning an array of shape ``shapes[b]``, a scalar when ``shapes`` is None: each
    entry one output of the plan, their passes shared); ``base_order``, ``base_term``: the order
    and name of the bases' values
    (:mod:`jaxamp._src.core.nesting`); a chain's ``of`` names its base first; ``dirs``: the
    float32 scalars its :class:`Along` steps' ``dirs`` index. Each value is marked as its last
    step's derivative. ``soft[i]``: the program reads ``chains[i]`` only as flags
    (:func:`jaxamp._src.core.marks.flags_only`: the value below the check of a longer chain), so
    it is the value of its order that the passes of a chain taking its steps and more compute
    (the plan orders those steps for the chains read, :func:`ordered`), not a pass of its own;
    it is planned as the others where no chain covers it. ``scaled``: the passes carry the
    scales of :func:`jaxamp.scaled` (each level its own, so no two streams are equal): the
    steps are taken in the order that costs least (:func:`ordered`)."""
    soft = [bool(f) for f in soft] or [False] * len(chains)
    hard = [i for i, f in enumerate(soft) if not f] or list(range(len(chains)))
    while True:
        planned, sums = _requests([canonical(chains[i]) for i in hard], [base_of[i] for i in hard])
        bare = [i for i in range(len(chains)) if i not in hard and not _covers(chains[i], base_of[i], planned)]
        if not bare:
            break
        hard = sorted(hard + bare)
    if scaled:  # (unscaled, XLA merges the passes' equal streams: the arguments' order, alike in every plan)
        planned = list(zip([b for b, _ in planned], ordered([c for _, c in planned])))
    below: Dict[int, Tuple[int, int]] = {}  # a soft chain -> (the planned chain covering it, its order)
    for i in range(len(chains)):
        if i not in hard:
            covers = _covers(chains[i], base_of[i], planned)
            k = len(chains[i].argnums)
            need = collections.Counter(_along_arguments(chains[i]))
            exact = [j for j in covers if collections.Counter(planned[j][1].argnums[:k]) == need]
            below[i] = ((exact or covers)[0], k)
    base_of, chains = [b for b, _ in planned], [c for _, c in planned]
    cols = tuple(sorted({i for c in chains for i in positions(c)}))
    along = {a: j for j, a in enumerate(dict.fromkeys(a for c in chains for a in c.argnums if isinstance(a, Along)))}
    inputs = tuple(f"a{i}" for i in cols) + tuple(f"d{j}" for j in range(len(along)))
    shapes = [()] * len(bases) if shapes is None else [tuple(s) for s in shapes]
    offsets = np.cumsum([0] + [int(np.prod(s, dtype=int)) for s in shapes])
    output = {i: f"u{offsets[b] + int(np.ravel_multi_index(c.out, shapes[b]) if c.out else 0)}"
              for i, (b, c) in enumerate(zip(base_of, chains))}
    tops = [_node(c, len(c.argnums), output[i], along) for i, c in enumerate(chains)]
    plan = make_plan(inputs, tuple(f"u{k}" for k in range(offsets[-1])), tuple(dict.fromkeys(tops)), _PLAN_AMP)
    terms: Dict[str, Optional[str]] = {}  # plan parent name -> the user's name of that value
    wrts: Dict[str, Optional[str]] = {}  # plan derivative name -> the user's name of its variable
    for i, c in enumerate(chains):
        term = c.of if c.of is not None else base_term  # the name of the value step k differentiates
        for k, w in enumerate(c.wrts):
            node = _node(c, k, output[i], along)
            terms[node] = terms.get(node) or term
            wrts[_node(c, k + 1, output[i], along)] = w
            term = SEP.join((term, w)) if term is not None and w is not None else None
    # the user's own scalars (eligible: float32), not a stack: the passes' primals are the user's calls
    x = tuple(args[i] if hasattr(args[i], "dtype") else jnp.float32(args[i]) for i in cols)
    directions = [(tuple(cols.index(i) for i in a.args), tuple(dirs[d] for d in a.dirs)) for a in along]

    def f(z):
        full = substitute(args, cols, fresh(tuple(z)))
        return jnp.concatenate([jnp.ravel(jnp.asarray(b(*full), jnp.float32)) for b in bases])

    if len(bases) > 1:  # u and v of one network: its shared work traced once, before the passes
        f = _merged(f, x)
    # per-term plan keys are the parents' plan names: each becomes the mark of its step (a
    # scale's order is relative to the point, of order 0: the base's order is added here)
    marks_of = {k: dict(order=base_order + order_of(k) + 1, term=terms.get(k)) for k in plan.step_keys}
    engine = functools.partial(forward.point_values, directions=directions)
    values, _ = run_marked(plan, engine, f, x, marks_of, wrts)
    top = [values[t] for t in tops]
    found = iter([functools.reduce(lambda a, b: a + b, [_product([dirs[d] for d in coef], top[j]) for coef, j in parts])
                  for parts in sums])
    return [values[_node(chains[below[i][0]], below[i][1], output[below[i][0]], along)] if i in below else next(found)
            for i in range(len(soft))]


def _product(factors: Sequence[Any], value: jax.Array) -> jax.Array:
    """``value`` times each of ``factors`` (a direction's entries), in float32."""
    for v in factors:
        value = value * jnp.asarray(v, jnp.float32)
    return value


def _merged(f: Callable, x: Tuple[jax.Array, ...]) -> Callable:
    """``f`` with the work its bases repeat done once (:func:`jaxamp._src.core.interpreter.cse`: the
    bases are functions of the point only, no scale enters them)."""
    closed = cse(jax.make_jaxpr(f)(x))
    return lambda z: eval_jaxpr(closed.jaxpr, closed.consts, list(z), bind)[0]
