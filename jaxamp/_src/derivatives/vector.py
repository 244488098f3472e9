"""Derivatives along a small argument, planned as chains.

``jaxamp.jacfwd`` / ``jacrev`` / ``hessian`` of a function returning float32 values (a scalar or
an array of at most :data:`MAX_SIZE` entries), taken along a float32 scalar or vector ``z`` of at
most :data:`MAX_SIZE` entries (``u(params, z)`` with ``z = [t, x]``): each entry of the Jacobian or
Hessian is a nest of ``grad`` steps along one of ``z``'s entries of one entry of the value
(:mod:`jaxamp._src.derivatives.chain`), all of one call bound as one request (one plan), planned
beside the user's other derivatives at the same point; the entries the program never reads are
dropped. The Hessian's entries above the diagonal are computed once and mirrored (exact: both
orders of a mixed derivative are the same function). Values are laid out as JAX returns them;
every other call takes JAX's route (:mod:`jaxamp._src.derivatives.forward`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.core.interpreter import substitute
from jaxamp._src.derivatives import chain, chain_call

__all__ = ["MAX_SIZE", "NotScalar", "Route", "eligible"]

# Entries of ``z`` (and of the value) up to which derivatives are planned entry by entry (a
# Hessian is MAX_SIZE * (MAX_SIZE + 1) / 2 chains per value entry); larger ones take JAX's route.
MAX_SIZE = chain_call.MAX_SIZE


class NotScalar(Exception):
    """``fun`` does not return float32 values of at most :data:`MAX_SIZE` entries: the caller
    takes JAX's route instead."""


def eligible(argnums: Any, args: Tuple[Any, ...], kwargs: dict, has_aux: bool = False,
             holomorphic: bool = False) -> bool:
    """Whether a derivative along ``args[argnums]`` is planned entry by entry: one int
    ``argnums`` at a float32 scalar or vector of at most :data:`MAX_SIZE` entries given by
    position, no keyword arguments or aux (``fun``'s value is checked when the route runs:
    else :class:`NotScalar` is raised)."""
    if has_aux or holomorphic or kwargs or not isinstance(argnums, int) or isinstance(argnums, bool):
        return False
    if not 0 <= argnums < len(args) or not hasattr(args[argnums], "dtype"):
        return False
    z = args[argnums]
    return jnp.result_type(z) == jnp.float32 and (jnp.ndim(z) == 0 or jnp.ndim(z) == 1 and
                                                  1 <= jnp.shape(z)[0] <= MAX_SIZE)


def _entries(z: Any) -> Tuple[Any, ...]:
    """``z``'s entries ``z[k]`` (a scalar: itself). Two calls at ``z`` read them twice; the chains
    still group (:func:`jaxamp._src.derivatives.chain_call.expand` reads equal reads of one
    variable as one)."""
    return (z,) if jnp.ndim(z) == 0 else tuple(z[k] for k in range(jnp.shape(z)[0]))


class Route:
    """The entry-by-entry derivatives of ``fun`` along ``args[argnum]``: one per jaxamp
    derivative function, its ``fun`` of scalars made once per argument layout (the chains' base),
    so nothing outlives that function."""

    def __init__(self, fun: Callable[..., Any], argnum: int):
        self.fun, self.argnum = fun, argnum
        self._flat: Dict[Tuple[int, bool], Callable[..., Any]] = {}

    def flat(self, nargs: int, vector: bool) -> Callable[..., Any]:
        """``fun`` with ``z = args[argnum]`` given as scalars after the ``nargs`` arguments (a
        scalar ``z``: in its place, as the user's call has it)."""
        if (nargs, vector) not in self._flat:
            fun, argnum = self.fun, self.argnum

            def flat(*b):
                out = fun(*substitute(b[:nargs], (argnum,), [jnp.stack(b[nargs:])])) if vector else fun(*b)
                if not (hasattr(out, "dtype") and jnp.result_type(out) == jnp.float32 and jnp.size(out) <= MAX_SIZE):
                    raise NotScalar()
                return out

            self._flat[(nargs, vector)] = flat
        return self._flat[(nargs, vector)]

    def _chains(self, args: Tuple[Any, ...], steps: Sequence[Tuple[int, ...]], of: Optional[str],
                wrt: Optional[str]) -> Tuple[Tuple[int, ...], Dict[Tuple[Any, ...], jax.Array]]:
        """``(value shape, {(value entry, steps): derivative})``: the top derivatives along the
        entries of ``args[argnum]`` listed in ``steps`` (innermost first) of every entry of
        ``fun``'s value, one chain each, bound as one request."""
        i = self.argnum
        entries = _entries(args[i])
        vector = jnp.ndim(args[i]) == 1
        # z itself is no operand (its place holds None): only its entries are, so that chains at
        # the same entries group whatever vmap does to z
        full = tuple(args[:i]) + (None,) + tuple(args[i + 1:]) + entries if vector else tuple(args)
        at = [len(args) + k for k in range(len(entries))] if vector else [i]  # each entry's position
        # every entry carries the vector's name: per-term keys are those of JAX's route (u, u__z)
        base = self.flat(len(args), vector)
        links = [chain.Chain(base, tuple(at[k] for k in s), (wrt,) * len(s), of) for s in steps]
        shape, values = chain_call.bind_entries(links, full)  # (raises NotScalar: JAX's route)
        return shape, dict(zip([(o, s) for o in np.ndindex(*shape) for s in steps], values))

    def jacobian(self, args: Tuple[Any, ...], of: Optional[str], wrt: Optional[str]) -> jax.Array:
        """``jax.jacfwd(fun, argnum)(*args)`` (shape ``value.shape + z.shape``) by one chain per entry."""
        z = args[self.argnum]
        d = len(_entries(z))
        shape, found = self._chains(args, [(k,) for k in range(d)], of, wrt)
        rows = [jnp.stack([found[(o, (k,))] for k in range(d)]) if jnp.ndim(z) else found[(o, (0,))]
                for o in np.ndindex(*shape)]
        return jnp.stack(rows).reshape(shape + jnp.shape(z)) if shape else rows[0]

    def hessian(self, args: Tuple[Any, ...], of: Optional[str], wrt: Optional[str]) -> jax.Array:
        """``jax.hessian(fun, argnum)(*args)`` (shape ``value.shape + z.shape * 2``) by one chain
        per entry on and above the diagonal."""
        z = args[self.argnum]
        d = len(_entries(z))
        upper = [(j, k) for j in range(d) for k in range(j, d)]
        shape, found = self._chains(args, upper, of, wrt)

        def matrix(o):
            if not jnp.ndim(z):
                return found[(o, (0, 0))]
            return jnp.stack([jnp.stack([found[(o, (min(j, k), max(j, k)))] for k in range(d)]) for j in range(d)])

        rows = [matrix(o) for o in np.ndindex(*shape)]
        return jnp.stack(rows).reshape(shape + jnp.shape(z) * 2) if shape else rows[0]
