"""The evaluation rules of JAX's higher-order primitives holding a ``jaxamp.grad`` (the
``evaluate`` field of :data:`jaxamp._src.core.rules.RULES`, which lists them): a call's or a
custom-derivative function's body is inlined (:func:`call`); a loop's, a branch's,
``jax.checkpoint``'s and ``shard_map``'s body is rebuilt with its flags as extra outputs. Each is
``rule(eqn, invals, ctx, bodies) -> (outs, flags)``, ``bodies`` the infos of each body's inputs
(:class:`jaxamp._src.core.nesting.Analysis`), ``ctx`` the evaluation's context
(:class:`jaxamp._src.core.evaluate.Context`). Nothing here is registered on import: the rule
table names these functions.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

__all__ = ["full_flags", "call", "scan", "while_loop", "cond", "remat", "checkpointed", "remat_body", "shard_map"]


def full_flags(flags: Mapping[str, jax.Array], keys: Sequence[str]) -> Dict[str, jax.Array]:
    """``{key: bool[]}`` for every key, False where ``flags`` has none."""
    return {k: jnp.asarray(flags.get(k, False), bool) for k in keys}


def call(eqn, invals, ctx, bodies):
    """A ``jit`` body (``jaxpr``), or a custom-derivative call's primal body (``call_jaxpr``),
    inlined: ``(outs, flags)`` (a custom rule around jaxamp.grad would not see the scales)."""
    body = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
    if isinstance(body, jcore.Jaxpr):
        body = jcore.ClosedJaxpr(body, ())
    return ctx.evaluate(body.jaxpr, body.consts, invals, bodies[0])


def _flagged(jaxpr, consts, infos, ctx):
    """The body as a function of its operands, returning ``(outs, flags of every key)``."""
    keys = ctx.keys(jaxpr, infos)

    def fn(*args):
        outs, fl = ctx.evaluate(jaxpr, consts, args, infos)
        return outs, full_flags(fl, keys)

    return fn


def scan(eqn, invals, ctx, bodies):
    p = eqn.params
    body, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    keys = ctx.keys(body.jaxpr, bodies[0])

    def step(carry, x):
        vals, fl = carry
        outs, new = ctx.evaluate(body.jaxpr, body.consts, [*consts, *vals, *x], bodies[0])
        return (outs[:nk], {k: fl[k] | new.get(k, False) for k in keys}), outs[nk:]

    (final, fl), ys = lax.scan(step, (list(init), full_flags({}, keys)), list(xs), length=p["length"],
                               reverse=p["reverse"], unroll=p["unroll"])
    return [*final, *ys], fl


def while_loop(eqn, invals, ctx, bodies):
    p = eqn.params
    cond, body, cn, bn = p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    keys = ctx.keys(body.jaxpr, bodies[1])

    def cond_fn(carry):
        return ctx.evaluate(cond.jaxpr, cond.consts, [*cconsts, *carry[0]], bodies[0])[0][0]

    def body_fn(carry):
        vals, fl = carry
        outs, new = ctx.evaluate(body.jaxpr, body.consts, [*bconsts, *vals], bodies[1])
        return outs, {k: fl[k] | new.get(k, False) for k in keys}

    return lax.while_loop(cond_fn, body_fn, (list(init), full_flags({}, keys)))


def cond(eqn, invals, ctx, bodies):
    branches = eqn.params["branches"]
    keys = list(dict.fromkeys(k for b, i in zip(branches, bodies) for k in ctx.keys(b.jaxpr, i)))

    def branch_fn(b, infos):
        def fn(*args):
            outs, fl = ctx.evaluate(b.jaxpr, b.consts, args, infos)
            return outs, full_flags(fl, keys)

        return fn

    return lax.switch(invals[0], [branch_fn(b, i) for b, i in zip(branches, bodies)], *invals[1:])


def remat(eqn, invals, ctx, bodies):
    # jax.checkpoint keeps its rematerialization: the rewritten body is checkpointed again
    return checkpointed(eqn, _flagged(eqn.params["jaxpr"], (), bodies[0], ctx))(*invals)


def checkpointed(eqn, fn: Callable) -> Callable:
    """``fn`` under ``jax.checkpoint`` as ``eqn`` (a ``jax.checkpoint`` equation) applies it: its
    policy and ``prevent_cse``. A body rewritten or propagated keeps its rematerialisation."""
    p = eqn.params
    return jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])


def remat_body(eqn) -> Optional[jcore.ClosedJaxpr]:
    """The body of a ``jax.checkpoint`` equation, else None."""
    return jcore.ClosedJaxpr(eqn.params["jaxpr"], ()) if eqn.primitive is jp.remat_p else None


def shard_map(eqn, invals, ctx, bodies):
    # Re-stage through jax.shard_map with one more, replicated output per flag: each flag is
    # ORed over the manual mesh axes inside the body. (jax.pmap is a shard_map too.)
    p = eqn.params
    body, axes = p["jaxpr"], tuple(p["newly_manual_axes"])
    keys = ctx.keys(body, bodies[0])

    def local(*args):
        outs, fl = ctx.evaluate(body, (), args, bodies[0])
        return outs, {k: lax.psum(v.astype(jnp.int32), axes) > 0 for k, v in full_flags(fl, keys).items()}

    out_specs = (list(p["out_specs"]), {k: jax.sharding.PartitionSpec() for k in keys})
    mapped = jax.shard_map(local, mesh=p["mesh"], in_specs=tuple(p["in_specs"]), out_specs=out_specs,
                           axis_names=set(axes), check_vma=p["check_vma"])
    return jax.jit(mapped)(*invals)
