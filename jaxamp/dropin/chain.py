"""Nested :func:`jaxamp.grad` along per-point scalar inputs, computed by the Derivatives engine.

A user's ``grad(grad(u_net, 2), 2)(params, t, x)`` with scalar ``t, x`` is one *chain*: the base
function and the argument differentiated at each step. Nested reverse mode pays one backward
pass per step, each through the one below; the chain is the plan of one named derivative
(``u__a2__a2``), and :func:`jaxamp.derivatives.forward.point_values` computes it the engine's
way: nested forward mode, one propagated tangent for a pure second order, Taylor mode for
pure orders >= 3. Its steps are jaxamp's marks as every other path's (:mod:`jaxamp.marks`):
each step's scale a ``deriv_scale_p`` (order and name as the nested calls would have reported
them), each level's scaled result a ``deriv_check_p`` against the value it differentiates, so
:func:`jaxamp.scaled` gives the chain its scales and flags, and the float16 values of a step
carry that step's scale only (docs/algorithm.md, "Engines").
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxamp.config import AmpConfig
from jaxamp.derivatives import forward
from jaxamp.derivatives.plan import make_plan, order_of, run_marked
from jaxamp.interpreter import bind, cse, eval_jaxpr
from jaxamp.marks import SEP

__all__ = ["Chain", "METHODS", "Session", "sessions", "check_scalar", "extend", "eligible", "evaluate", "shared"]

METHODS = ("auto", "forward", "reverse")
# per-term keys (the parents' plan names): the plan's own step keys, each mapped to a mark below
_PLAN_AMP = AmpConfig(mode="per_term_scaler")


@dataclasses.dataclass(frozen=True)
class Chain:
    """A nest of ``grad`` calls: ``base`` and, innermost first, the argnum and name of each step."""

    base: Callable[..., Any]
    argnums: Tuple[int, ...]
    wrts: Tuple[Optional[str], ...]
    of: Optional[str]


def extend(fun: Callable[..., Any], argnums: Any, of: Optional[str], wrt: Any) -> Optional[Chain]:
    """The chain of ``grad(fun, argnums)``: one step on ``fun``'s chain, or a new one (None when
    the step cannot be a chain step: a tuple ``argnums``)."""
    if not isinstance(argnums, int) or isinstance(argnums, bool):
        return None
    inner: Optional[Chain] = getattr(fun, "_jaxamp_chain", None)
    if inner is not None and of is None:
        return Chain(inner.base, inner.argnums + (argnums,), inner.wrts + (wrt,), inner.of)
    return Chain(fun, (argnums,), (wrt,), of)


def eligible(chain: Optional[Chain], args: Tuple[Any, ...], kwargs: dict) -> bool:
    """Whether ``chain`` can run as an engine plan at these arguments: every differentiated
    argument a float32 scalar, given by position."""
    if chain is None or kwargs:
        return False
    for i in set(chain.argnums):
        if i >= len(args) or not hasattr(args[i], "dtype") and not isinstance(args[i], float):
            return False
        a = args[i]
        if jnp.shape(a) != () or jnp.result_type(a) != jnp.float32:
            return False
    return True


def _term(chain: Chain, k: int) -> Optional[str]:
    """The name of the value step ``k`` (0-based) of ``chain`` differentiates, or None."""
    name = chain.of
    for w in chain.wrts[:k]:
        name = SEP.join((name, w)) if name is not None and w is not None else None
    return name


def check_scalar(caller: str, fun: Callable, out: Any) -> Any:
    """``out`` if it is one scalar array, else a TypeError that names the way out (jacrev)."""
    if not hasattr(out, "dtype"):
        raise TypeError(f"{caller}: `fun`={fun!r} must return one array, got {type(out).__name__}.")
    if jnp.shape(out) != ():
        raise TypeError(f"{caller}: `fun`={fun!r} returned shape {jnp.shape(out)}; grad needs a scalar output. "
                        "For a vector-valued function use jaxamp.jacrev (or jaxamp.jacfwd).")
    return out


def _node(chain: Chain, k: int, output: str) -> str:
    """The plan name of the value after ``k`` steps of ``chain`` (``u0__a2__a2``), whose base
    is the plan's ``output``."""
    return SEP.join((output,) + tuple(f"a{i}" for i in chain.argnums[:k]))


class Session:
    """Shared passes across the chain calls of one traced program (:func:`jaxamp.scaled`).

    The program is traced twice. The first trace records every chain call: its base, its
    steps and its arguments; calls at the very same arguments (the same traced values: one
    point of one ``vmap``) form a group, whatever their bases (``u`` and ``v`` of one network
    are the outputs of one plan). In the second trace the first call of a group evaluates one
    plan holding every derivative of the group, the engine's way (paths along the same inputs
    share one pass, for every output), and every call takes its derivative from it.
    A call that does not match the record (a trace cache skipped a call) computes its own.
    """

    def __init__(self) -> None:
        self.recording, self.calls, self.groups, self.index = True, [], [], 0
        self.results: Dict[int, Dict[str, Any]] = {}
        self.first_args: Dict[int, Tuple[Any, ...]] = {}

    def finish_recording(self) -> None:
        by_args: Dict[Any, int] = {}
        for _, ids, _, base_order in self.calls:
            self.groups.append(by_args.setdefault((ids, base_order), len(by_args)))
        self.recording, self.index = False, 0


_STATE = threading.local()


def sessions() -> List[Session]:
    if not hasattr(_STATE, "sessions"):
        _STATE.sessions = []
    return _STATE.sessions


def shared(chain: Chain, args: Tuple[Any, ...], base_order: int) -> Tuple[jax.Array, int, Optional[str]]:
    """:func:`evaluate`, with the passes shared within the group of the current session."""
    session = sessions()[-1] if sessions() else None
    if session is None:
        return evaluate([chain], args, base_order)[0]
    ids = tuple(id(a) for a in args)
    if session.recording:
        session.calls.append((chain, ids, args, base_order))  # kept alive: no id is reused while recording
        return evaluate([chain], args, base_order)[0]
    i, session.index = session.index, session.index + 1
    if i >= len(session.calls) or session.calls[i][0] != chain:
        return evaluate([chain], args, base_order)[0]
    g = session.groups[i]
    if g not in session.results:
        members = [session.calls[j][0] for j in range(len(session.calls)) if session.groups[j] == g]
        session.results[g], session.first_args[g] = dict(zip(members, evaluate(members, args, base_order))), args
    elif any(a is not b for a, b in zip(args, session.first_args[g])) or len(args) != len(session.first_args[g]):
        return evaluate([chain], args, base_order)[0]
    return session.results[g][chain]


def evaluate(chains, args: Tuple[Any, ...], base_order: int):
    """The top derivatives of ``chains`` (at the same arguments) by one engine plan, marked.

    Args:
      chains: chains whose base functions take these arguments (each base an output of the plan).
      args: the positional arguments of the outermost calls.
      base_order: the highest order of derivative calls the base function makes (its marks'
        orders start above it).

    Returns:
      Per chain ``(value, order, term)``: the unscaled derivative (float32 scalar), the order of
      its last step and the name of the value that step differentiates, for :func:`report`.
    """
    cols = tuple(sorted({i for c in chains for i in c.argnums}))
    inputs = tuple(f"a{i}" for i in cols)
    bases = list(dict.fromkeys(c.base for c in chains))
    output = {c: f"u{bases.index(c.base)}" for c in chains}
    tops = [_node(c, len(c.argnums), output[c]) for c in chains]
    plan = make_plan(inputs, tuple(f"u{b}" for b in range(len(bases))), tuple(dict.fromkeys(tops)), _PLAN_AMP)
    terms: Dict[str, Optional[str]] = {}  # plan parent name -> the user's name of that value
    for c in chains:
        for k in range(len(c.argnums)):
            node = _node(c, k, output[c])
            terms[node] = terms.get(node) or _term(c, k)
    # the user's own scalars (eligible: float32), not a stack: the passes' primals are the user's calls
    x = tuple(args[i] if hasattr(args[i], "dtype") else jnp.float32(args[i]) for i in cols)

    def f(z):
        full = list(args)
        for j, i in enumerate(cols):
            full[i] = z[j]
        return jnp.stack([jnp.asarray(check_scalar("jaxamp.grad", b, b(*full)), jnp.float32) for b in bases])

    if len(bases) > 1:  # u and v of one network: its shared work traced once, before the passes
        f = _merged(f, x)
    # per-term plan keys are the parents' plan names: each becomes the mark of its step
    marks_of = {k: dict(order=base_order + order_of(k) + 1, term=terms.get(k)) for k in plan.step_keys}
    values, _ = run_marked(plan, forward.point_values, f, x, marks_of)
    out = []
    for c, top in zip(chains, tops):
        m = marks_of[plan.paths[top][-1][0]]
        out.append((values[top], m["order"], m["term"]))
    return out


def _merged(f: Callable, x: Tuple[jax.Array, ...]) -> Callable:
    """``f`` with the work its bases repeat done once (:func:`jaxamp.interpreter.cse`: the
    bases are functions of the point only, no scale enters them)."""
    closed = cse(jax.make_jaxpr(f)(x))
    return lambda z: eval_jaxpr(closed.jaxpr, closed.consts, list(z), bind)[0]
