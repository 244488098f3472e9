"""Derivatives along a small vector argument, planned as chains.

``jaxamp.jacfwd`` / ``jacrev`` / ``hessian`` of a function returning one float32 scalar, taken
along a float32 vector ``z`` of at most :data:`MAX_SIZE` entries (``u(params, z)`` with
``z = [t, x]``): each entry of the Jacobian or Hessian is a nest of ``grad`` steps along one of
``z``'s entries (:mod:`jaxamp._src.derivatives.chain`), so the engine plans them beside the
user's other derivatives at the same point, and an entry the residual never reads is left to
XLA to drop. The Hessian's entries above the diagonal are computed once and mirrored (exact:
both orders of a mixed derivative are the same function). Values are stacked as JAX returns
them; every other call takes JAX's route (:mod:`jaxamp._src.derivatives.forward`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from jaxamp._src.core.interpreter import substitute
from jaxamp._src.derivatives import chain, chain_call

__all__ = ["MAX_SIZE", "NotScalar", "Route", "eligible"]

# Entries of ``z`` up to which derivatives are planned entry by entry (a Hessian is
# MAX_SIZE * (MAX_SIZE + 1) / 2 chains); a longer vector takes JAX's batched route.
MAX_SIZE = 16


class NotScalar(Exception):
    """``fun`` does not return one float32 scalar: the caller takes JAX's route instead."""


def eligible(argnums: Any, args: Tuple[Any, ...], kwargs: dict, has_aux: bool = False,
             holomorphic: bool = False) -> bool:
    """Whether a derivative along ``args[argnums]`` is planned entry by entry: one int
    ``argnums`` at a float32 vector of 1 to :data:`MAX_SIZE` entries given by position, no
    keyword arguments or aux (``fun`` must also return one float32 scalar: else
    :class:`NotScalar` is raised while the chains are traced)."""
    if has_aux or holomorphic or kwargs or not isinstance(argnums, int) or isinstance(argnums, bool):
        return False
    if not 0 <= argnums < len(args) or not hasattr(args[argnums], "dtype"):
        return False
    z = args[argnums]
    return jnp.result_type(z) == jnp.float32 and jnp.ndim(z) == 1 and 1 <= jnp.shape(z)[0] <= MAX_SIZE


def _entries(z: Any) -> Tuple[Any, ...]:
    """``z``'s entries ``z[k]``. Two calls at ``z`` read them twice; the chains still group
    (:func:`jaxamp._src.derivatives.chain_call.expand` reads equal reads of one variable as one)."""
    return tuple(z[k] for k in range(jnp.shape(z)[0]))


class Route:
    """The entry-by-entry derivatives of ``fun`` along ``args[argnum]``: one per jaxamp
    derivative function, its ``fun`` of scalars made once per argument count (the chains' base),
    so nothing outlives that function."""

    def __init__(self, fun: Callable[..., Any], argnum: int):
        self.fun, self.argnum = fun, argnum
        self._flat: Dict[int, Callable[..., Any]] = {}

    def flat(self, nargs: int) -> Callable[..., Any]:
        """``fun`` with ``z = args[argnum]`` given as scalars after the ``nargs`` arguments."""
        if nargs not in self._flat:
            fun, argnum = self.fun, self.argnum

            def flat(*b):
                out = fun(*substitute(b[:nargs], (argnum,), [jnp.stack(b[nargs:])]))
                if not (hasattr(out, "dtype") and jnp.shape(out) == () and jnp.result_type(out) == jnp.float32):
                    raise NotScalar()
                return out

            self._flat[nargs] = flat
        return self._flat[nargs]

    def _chains(self, args: Tuple[Any, ...], steps: Sequence[Tuple[int, ...]], of: Optional[str],
                wrt: Optional[str]) -> list:
        """The top derivatives along the entries of ``args[argnum]`` listed in ``steps``
        (innermost first), one chain each."""
        i = self.argnum
        entries = _entries(args[i])
        # z itself is no operand (its place holds None): only its entries are, so that chains at
        # the same entries group whatever vmap does to z
        full = tuple(args[:i]) + (None,) + tuple(args[i + 1:]) + entries
        # every entry carries the vector's name: per-term keys are those of JAX's route (u, u__z)
        n, names = len(args), (wrt,) * len(entries)
        base = self.flat(n)
        return [chain_call.bind_chain(chain.Chain(base, tuple(n + k for k in s), tuple(names[k] for k in s), of),
                                      full) for s in steps]

    def jacobian(self, args: Tuple[Any, ...], of: Optional[str], wrt: Optional[str]) -> jax.Array:
        """``jax.jacfwd(fun, argnum)(*args)`` (shape ``z.shape``) by one chain per entry."""
        d = jnp.shape(args[self.argnum])[0]
        return jnp.stack(self._chains(args, [(k,) for k in range(d)], of, wrt))

    def hessian(self, args: Tuple[Any, ...], of: Optional[str], wrt: Optional[str]) -> jax.Array:
        """``jax.hessian(fun, argnum)(*args)`` (shape ``z.shape * 2``) by one chain per entry on
        and above the diagonal."""
        d = jnp.shape(args[self.argnum])[0]
        upper = [(j, k) for j in range(d) for k in range(j, d)]
        found = dict(zip(upper, self._chains(args, upper, of, wrt)))
        return jnp.stack([jnp.stack([found[(min(j, k), max(j, k))] for k in range(d)]) for j in range(d)])
