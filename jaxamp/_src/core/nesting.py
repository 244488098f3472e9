"""A derivative's order and name, read from how jaxamp's marks nest in the traced program.

Every variable of a jaxpr gets an :data:`Info`: the highest order of the marked derivatives it
depends on, and their names. A mark (``deriv_scale_p(v)`` or ``deriv_check_p(g, v)``, see
:mod:`jaxamp._src.core.marks`) of relative order ``r`` guards a derivative of order ``order(v) + r``; its
term is its own ``term`` parameter, else the one name ``v`` depends on. A check's output is that
derivative (its order, its name ``term__wrt``); a scale's output is no derivative, and neither is
a variable derivatives are taken along (:func:`jaxamp._src.core.marks.fresh`: ``d/dx u(x)`` at an ``x``
computed from derivatives is a first derivative of ``u``).

The rule is a static pass over the jaxpr (one per jaxpr and input infos, kept by the
:class:`Analyses` of one interpretation), so the order
is the same under any ``jax.jit`` (cached or not), ``remat``, custom derivatives, loops and
branches: nothing is reported while tracing.

Example:
  >>> import jax, jax.numpy as jnp, jaxamp
  >>> u_x = jax.jit(jaxamp.grad(jnp.sin, method="reverse"))
  >>> closed = jax.make_jaxpr(jaxamp.grad(u_x, method="reverse"))(1.0)
  >>> sorted(m for m in analyze(closed.jaxpr, [NO_DERIVATIVE]).marks if m[0] > 0)
  [(1, None), (2, None)]
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

from jax.extend import core as jcore
from jax.extend.core import primitives as jp

from jaxamp._src.core.interpreter import custom_body, sub_jaxpr, sub_jaxprs
from jaxamp._src.core.marks import SEP, deriv_check_p, deriv_scale_p
from jaxamp._src.core.rules import rules_of

__all__ = ["Info", "NO_DERIVATIVE", "UNNAMED", "Analysis", "Analyses", "analyze", "resolve", "single_name"]

UNNAMED = None  # the name of a derivative whose differentiated value or variable has none


class Info(NamedTuple):
    """What a value is made of: the highest derivative order it depends on and those names."""

    order: int
    names: FrozenSet[Optional[str]]


NO_DERIVATIVE = Info(0, frozenset())


class Analysis(NamedTuple):
    """One jaxpr under given input infos.

    Attributes:
      outs: the infos of ``jaxpr.outvars``.
      resolved: ``{eqn: (order, term)}`` of every mark equation of this jaxpr (order 0: a
        value check), keyed on the equation objects (held by the map).
      bodies: ``{eqn: [infos of each body's invars]}`` for equations with bodies, in the
        order the body rules of :mod:`jaxamp._src.core.control` use them.
      marks: ``(order, term)`` of every mark in this jaxpr and its bodies, once each.
    """

    outs: List[Info]
    resolved: Dict[jcore.JaxprEqn, Tuple[int, Optional[str]]]
    bodies: Dict[jcore.JaxprEqn, List[List[Info]]]
    marks: Tuple[Tuple[int, Optional[str]], ...]


def join(infos: Sequence[Info]) -> Info:
    """The info of a value computed from values of ``infos``."""
    if not infos:
        return NO_DERIVATIVE
    return Info(max(i.order for i in infos), frozenset().union(*(i.names for i in infos)))


def single_name(info: Info) -> Optional[str]:
    """The one name ``info`` depends on, else :data:`UNNAMED`."""
    return next(iter(info.names)) if len(info.names) == 1 else UNNAMED


def resolve(params: Dict[str, Any], v: Info) -> Tuple[int, Optional[str]]:
    """``(order, term)`` of a mark with ``params`` whose differentiated value has info ``v``."""
    rel = params["order"]
    if rel == 0:
        return 0, params["term"] if not params.get("check", True) else None
    term = params["term"] if params["term"] is not None else single_name(v)
    return v.order + rel, term


def _named(order: int, term: Optional[str], wrt: Optional[str]) -> Info:
    return Info(order, frozenset((SEP.join((term, wrt)) if term is not None and wrt is not None else UNNAMED,)))


class Analyses:
    """The analyses of one interpretation (an evaluation, a profile, a trace's checks): each
    jaxpr under each input infos analysed once, however often its bodies are entered. Calling
    it is :func:`analyze`; the jaxprs are held alive as the keys of its dict."""

    def __init__(self) -> None:
        self.done: Dict[Tuple[jcore.Jaxpr, Tuple[Info, ...]], Analysis] = {}

    def __call__(self, jaxpr: jcore.Jaxpr, in_infos: Sequence[Info]) -> Analysis:
        key = (jaxpr, tuple(in_infos))
        if key not in self.done:
            self.done[key] = _analyze(jaxpr, key[1], self)
        return self.done[key]


def analyze(jaxpr: jcore.Jaxpr, in_infos: Sequence[Info], analyses: Optional[Analyses] = None) -> Analysis:
    """The :class:`Analysis` of ``jaxpr`` whose invars have ``in_infos`` (constvars: none),
    kept by ``analyses`` (default: a fresh one, for this call)."""
    return (Analyses() if analyses is None else analyses)(jaxpr, in_infos)


def _analyze(jaxpr: jcore.Jaxpr, key: Tuple[Info, ...], analyses: Analyses) -> Analysis:
    env: Dict[Any, Info] = dict(zip(jaxpr.invars, key))
    resolved: Dict[jcore.JaxprEqn, Tuple[int, Optional[str]]] = {}
    bodies: Dict[jcore.JaxprEqn, List[List[Info]]] = {}
    marks: List[Tuple[int, Optional[str]]] = []

    def read(v) -> Info:
        return NO_DERIVATIVE if isinstance(v, jcore.Literal) else env.get(v, NO_DERIVATIVE)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        prim = eqn.primitive
        if prim is deriv_scale_p or prim is deriv_check_p:
            v_info = ins[0] if prim is deriv_scale_p else ins[1]
            order, term = resolved[eqn] = resolve(eqn.params, v_info)
            marks.append((order, term))
            if prim is deriv_scale_p or (order == 0 and not eqn.params["check"]):
                outs = [NO_DERIVATIVE]  # a scale, or a variable derivatives are taken along (marks.fresh)
            elif order == 0:
                outs = [ins[0]]
            else:
                outs = [_named(order, term, eqn.params["wrt"])]
        elif sub_jaxprs(eqn):
            outs, body_ins, inner = _through_bodies(eqn, ins, analyses)
            bodies[eqn] = body_ins
            marks.extend(inner)
        else:
            outs = [join(ins)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return Analysis([read(v) for v in jaxpr.outvars], resolved, bodies, tuple(dict.fromkeys(marks)))


def _open(j) -> jcore.Jaxpr:
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


MAX_LOOP_PASSES = 16


def _fixpoint(run, consts: List[Info], carry: List[Info], rest: List[Info], n_carry_out: int):
    """Iterate a loop body until the carry's infos stop growing: ``(analysis, carry)``."""
    for _ in range(MAX_LOOP_PASSES):
        an = run(consts + carry + rest)
        new = [join([c, o]) for c, o in zip(carry, an.outs[:n_carry_out])]
        if new == carry:
            return an, carry
        carry = new
    raise NotImplementedError(
        "jaxamp: a loop's carry is differentiated again on every iteration (its derivative order "
        f"grows past {max(c.order for c in carry)}), so no scaler key can be fixed for it. Unroll the "
        "loop in Python, or take the loop's derivatives with jax.grad outside jaxamp.scaled.")


def _through_bodies(eqn, ins: List[Info], analyze: Analyses):
    """``(out infos, [body invars' infos], marks)`` of an equation with bodies."""
    p, prim = eqn.params, eqn.primitive
    body = sub_jaxpr(eqn) or custom_body(eqn)
    wrapped = rules_of(prim).wrapped  # jax.checkpoint's, shard_map's body: analysed as a call's
    if body is not None or wrapped is not None:
        jaxpr = body.jaxpr if body is not None else _open(p[wrapped])
        an = analyze(jaxpr, ins)
        return an.outs, [ins], an.marks
    if prim is jp.scan_p:
        nc, nk = p["num_consts"], p["num_carry"]
        jaxpr = _open(p["jaxpr"])
        an, carry = _fixpoint(lambda i: analyze(jaxpr, i), ins[:nc], ins[nc : nc + nk], ins[nc + nk :], nk)
        return an.outs, [ins[:nc] + carry + ins[nc + nk :]], an.marks
    if prim is jp.while_p:
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        body_j, cond_j = _open(p["body_jaxpr"]), _open(p["cond_jaxpr"])
        init = ins[cn + bn :]
        an, carry = _fixpoint(lambda i: analyze(body_j, i), ins[cn : cn + bn], init, [], len(init))
        cond_an = analyze(cond_j, ins[:cn] + carry)
        return carry, [ins[:cn] + carry, ins[cn : cn + bn] + carry], an.marks + cond_an.marks
    if prim is jp.cond_p:
        ans = [analyze(_open(b), ins[1:]) for b in p["branches"]]
        outs = [join(list(o)) for o in zip(*(a.outs for a in ans))]
        return outs, [ins[1:]] * len(ans), tuple(m for a in ans for m in a.marks)
    # Another primitive with bodies: its outputs depend on all its inputs; marks inside it
    # are rejected by the interpreters that meet them.
    return [join(ins)] * len(eqn.outvars), [], ()
