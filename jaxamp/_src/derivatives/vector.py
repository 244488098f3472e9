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

import functools

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


def _small_leaves(tree: Any) -> bool:
    """Whether ``tree`` is float32 arrays of rank <= 1 (a scalar, a vector, a pytree of them),
    :data:`MAX_SIZE` entries in all."""
    leaves = jax.tree_util.tree_leaves(tree)
    return (bool(leaves) and all(hasattr(a, "dtype") and jnp.result_type(a) == jnp.float32 and jnp.ndim(a) <= 1
                                 for a in leaves)
            and 1 <= sum(int(jnp.size(a)) for a in leaves) <= MAX_SIZE)


def eligible(argnums: Any, args: Tuple[Any, ...], kwargs: dict, has_aux: bool = False,
             holomorphic: bool = False) -> bool:
    """Whether a derivative along ``args[argnums]`` is planned entry by entry: one int
    ``argnums`` at a float32 scalar, vector or pytree of them of at most :data:`MAX_SIZE`
    entries given by position, no keyword arguments or aux (``fun``'s value is checked when
    the route runs: else :class:`NotScalar` is raised)."""
    if has_aux or holomorphic or kwargs or not isinstance(argnums, int) or isinstance(argnums, bool):
        return False
    return 0 <= argnums < len(args) and _small_leaves(args[argnums])


def is_pytree(z: Any) -> bool:
    """Whether ``z`` is a pytree of arrays rather than one array (a dict of coordinates)."""
    return not hasattr(z, "dtype")


def _entries(z: Any) -> Tuple[Any, ...]:
    """``z``'s entries ``z[k]`` (a scalar: itself; a pytree: its leaves' entries in order). Two
    calls at ``z`` read them twice; the chains still group
    (:func:`jaxamp._src.derivatives.chain_call.expand` reads equal reads of one variable as one)."""
    if is_pytree(z):
        return tuple(e for leaf in jax.tree_util.tree_leaves(z) for e in _entries(leaf))
    return (z,) if jnp.ndim(z) == 0 else tuple(z[k] for k in range(jnp.shape(z)[0]))


def _rebuilt(like: Any, entries: Sequence[Any]) -> Any:
    """The pytree of ``like``'s structure and shapes holding ``entries`` (:func:`_entries`'s inverse)."""
    leaves, tree = jax.tree_util.tree_flatten(like)
    out, at = [], 0
    for leaf in leaves:
        n = int(np.prod(leaf.shape, dtype=int))
        out.append(jnp.stack(entries[at:at + n]) if leaf.shape else entries[at])
        at += n
    return jax.tree_util.tree_unflatten(tree, out)


def _value(out: Any) -> Any:
    """``fun``'s value if it is one float32 array of at most :data:`MAX_SIZE` entries (a pytree
    of them, :data:`MAX_SIZE` entries in all: its leaves raveled into one vector), else
    :class:`NotScalar` (JAX's route, which names what is wrong)."""
    if is_pytree(out) and _small_leaves(out):
        return jnp.concatenate([jnp.ravel(a) for a in jax.tree_util.tree_leaves(out)])
    if not (hasattr(out, "dtype") and jnp.result_type(out) == jnp.float32 and jnp.size(out) <= MAX_SIZE):
        raise NotScalar()
    return out


def _shape(a: Any) -> Tuple[int, ...]:
    return tuple(a.shape) if hasattr(a, "shape") else tuple(jnp.shape(a))


def _shapes(tree: Any) -> Any:
    """``tree``'s structure, shapes and dtypes (values dropped)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _block(get: Callable[[Tuple[int, ...]], jax.Array], shape: Tuple[int, ...]) -> jax.Array:
    """The array of ``shape`` whose entry at each index is ``get(index)``, built by stacks (so that
    a later read of one entry reads that derivative alone: :mod:`jaxamp._src.derivatives.prune`)."""
    if not shape:
        return get(())
    return jnp.stack([_block(lambda rest, i=i: get((i,) + rest), shape[1:]) for i in range(shape[0])])


def _offsets(z: Any) -> Any:
    """``z``'s leaves as ``(offset of its first entry among z's entries, its shape)``."""
    leaves, tree = jax.tree_util.tree_flatten(z)
    starts = np.cumsum([0] + [int(np.prod(_shape(a), dtype=int)) for a in leaves])
    return jax.tree_util.tree_unflatten(tree, [(int(a), _shape(leaf)) for a, leaf in zip(starts, leaves)])


def _is_offset(x: Any) -> bool:
    """Whether ``x`` is an :func:`_offsets` pair (a leaf of that tree)."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], tuple)


def _entry(leaf: Tuple[int, Tuple[int, ...]], index: Tuple[int, ...]) -> int:
    """The position among ``z``'s entries of ``index`` in ``leaf`` (an :func:`_offsets` pair)."""
    start, shape = leaf
    return start + (int(np.ravel_multi_index(index, shape)) if shape else 0)


def _layout(nargs: int, z: Any) -> Tuple[Any, ...]:
    """The layout of a call: its argument count and ``z``'s structure and shapes."""
    return nargs, jax.tree_util.tree_structure(z), tuple(jnp.shape(a) for a in jax.tree_util.tree_leaves(z))


class Route:
    """The entry-by-entry derivatives of ``fun`` along ``args[argnum]``: one per jaxamp
    derivative function, its ``fun`` of scalars made once per argument layout (the chains' base),
    so nothing outlives that function."""

    def __init__(self, fun: Callable[..., Any], argnum: int):
        self.fun, self.argnum = fun, argnum
        self._flat: Dict[Tuple[Any, ...], Callable[..., Any]] = {}
        self._out: Dict[Tuple[Any, ...], Any] = {}  # per layout: the value's pytree (shapes), None: one array

    def flat(self, nargs: int, like: Any) -> Callable[..., Any]:
        """``fun`` with ``z = args[argnum]`` given as scalars after the ``nargs`` arguments (a
        scalar ``z``: in its place, as the user's call has it; ``like``: ``z``'s structure),
        its value one float32 array (:func:`_value`)."""
        vector = is_pytree(like) or jnp.ndim(like) == 1
        key, like = _layout(nargs, like), _shapes(like)  # (no tracer held by the function)
        if key not in self._flat:
            fun, argnum = self.fun, self.argnum

            def flat(*b):
                out = fun(*b) if not vector else fun(*substitute(b[:nargs], (argnum,), [_rebuilt(like, b[nargs:])]))
                self._out[key] = _shapes(out) if is_pytree(out) else None
                return _value(out)

            self._flat[key] = flat
        return self._flat[key]

    def _chains(self, args: Tuple[Any, ...], steps: Sequence[Tuple[Any, ...]], of: Optional[str],
                wrt: Any, direction: Any = None) -> Tuple[Tuple[int, ...], Dict[Tuple[Any, ...], jax.Array]]:
        """``(value shape, {(value entry, steps): derivative})``: the top derivatives along the
        entries of ``args[argnum]`` listed in ``steps`` (innermost first; ``None``: along
        ``direction``, a tangent of ``z``'s structure) of every entry of ``fun``'s value, one
        chain each, bound as one request; ``wrt``: the name of every step's variable, or a tuple
        of one per step."""
        i = self.argnum
        z = args[i]
        entries = _entries(z)
        vector = is_pytree(z) or jnp.ndim(z) == 1
        # z itself is no operand (its place holds None): only its entries are, so that chains at
        # the same entries group whatever vmap does to z
        full = tuple(args[:i]) + (None,) + tuple(args[i + 1:]) + entries if vector else tuple(args)
        at = [len(args) + k for k in range(len(entries))] if vector else [i]  # each entry's position
        # every entry carries the vector's name: per-term keys are those of JAX's route (u, u__z)
        base = self.flat(len(args), z)
        dirs = () if direction is None else _entries(direction)
        along = chain.Along(tuple(at), tuple(range(len(dirs))))
        names = lambda s: wrt if isinstance(wrt, tuple) else (wrt,) * len(s)  # noqa: E731
        links = [chain.Chain(base, tuple(along if k is None else at[k] for k in s), names(s), of) for s in steps]
        shape, values = chain_call.bind_entries(links, full, dirs)  # (raises NotScalar: JAX's route)
        return shape, dict(zip([(o, s) for o in np.ndindex(*shape) for s in steps], values))

    def _tree(self, args: Tuple[Any, ...]) -> Any:
        """The pytree of ``fun``'s value at ``args`` (shapes) when it is not one array, else None
        (known once its chains are bound)."""
        return self._out.get(_layout(len(args), args[self.argnum]))

    def jacobian(self, args: Tuple[Any, ...], of: Optional[str], wrt: Optional[str]) -> Any:
        """``jax.jacfwd(fun, argnum)(*args)`` (shape ``value.shape + z.shape``; a pytree ``z``:
        its structure, each leaf of shape ``value.shape + leaf.shape``; a pytree value: its
        structure, each leaf that layout) by one chain per entry."""
        z = args[self.argnum]
        d = len(_entries(z))
        shape, found = self._chains(args, [(k,) for k in range(d)], of, wrt)
        tree = self._tree(args)
        if tree is not None:  # JAX's layout: the value's structure, each leaf z's layout of its entries

            def of_leaf(out):
                n = len(out[1])
                if is_pytree(z):
                    return jax.tree_util.tree_map(lambda leaf: _block(
                        lambda ix: found[((_entry(out, ix[:n]),), (_entry(leaf, ix[n:]),))], out[1] + leaf[1]),
                        _offsets(z), is_leaf=_is_offset)
                return _block(lambda ix: found[((_entry(out, ix[:n]),), (ix[n] if jnp.ndim(z) else 0,))],
                              out[1] + tuple(jnp.shape(z)))

            return jax.tree_util.tree_map(of_leaf, _offsets(tree), is_leaf=_is_offset)
        if is_pytree(z):  # JAX's layout: z's structure, each leaf of shape value.shape + leaf.shape
            n = len(shape)
            return jax.tree_util.tree_map(
                lambda leaf: _block(lambda ix: found[(ix[:n], (_entry(leaf, ix[n:]),))], shape + leaf[1]),
                _offsets(z), is_leaf=_is_offset)
        rows = [jnp.stack([found[(o, (k,))] for k in range(d)]) if jnp.ndim(z) else found[(o, (0,))]
                for o in np.ndindex(*shape)]
        return jnp.stack(rows).reshape(shape + jnp.shape(z)) if shape else rows[0]

    def directional(self, args: Tuple[Any, ...], tangent: Any, of: Optional[str]) -> jax.Array:
        """``jax.jvp``'s tangent of ``fun`` along ``args[argnum]`` in the direction ``tangent``
        (``z``'s structure): one step along that direction, which the plan takes as the sum of
        the entries' steps where those are computed anyway, else as one tangent."""
        shape, found = self._chains(args, [(None,)], of, None, tangent)
        if self._tree(args) is not None:
            raise NotScalar()
        return jnp.stack([found[(o, (None,))] for o in np.ndindex(*shape)]).reshape(shape)

    def diagonal(self, args: Tuple[Any, ...], of: Optional[str], wrts: Tuple[Optional[str], Optional[str]],
                 indices: Sequence[int]) -> jax.Array:
        """The sum of the second derivatives of ``fun``'s scalar value along the entries
        ``indices`` of ``args[argnum]`` (a Laplacian), one chain of two steps named ``wrts`` each."""
        shape, found = self._chains(args, [(k, k) for k in indices], of, wrts)
        if shape or self._tree(args) is not None:
            raise NotScalar()
        return functools.reduce(lambda a, b: a + b, [found[((), (k, k))] for k in indices])

    def hessian(self, args: Tuple[Any, ...], of: Optional[str], wrt: Optional[str]) -> Any:
        """``jax.hessian(fun, argnum)(*args)`` (shape ``value.shape + z.shape * 2``; pytrees:
        JAX's nesting) by one chain per entry on and above the diagonal."""
        z = args[self.argnum]
        d = len(_entries(z))
        upper = [(j, k) for j in range(d) for k in range(j, d)]
        shape, found = self._chains(args, upper, of, wrt)
        if self._tree(args) is not None:
            raise NotScalar()

        def matrix(o):
            if not is_pytree(z) and not jnp.ndim(z):
                return found[(o, (0, 0))]
            return jnp.stack([jnp.stack([found[(o, (min(j, k), max(j, k)))] for k in range(d)]) for j in range(d)])

        if is_pytree(z):  # z's structure twice, each leaf of shape value.shape + leaf1.shape + leaf2.shape
            n, offsets = len(shape), _offsets(z)

            def pair(a, b):
                def get(ix):
                    j, k = _entry(a, ix[n:n + len(a[1])]), _entry(b, ix[n + len(a[1]):])
                    return found[(ix[:n], (min(j, k), max(j, k)))]
                return _block(get, shape + a[1] + b[1])

            return jax.tree_util.tree_map(
                lambda a: jax.tree_util.tree_map(lambda b: pair(a, b), offsets, is_leaf=_is_offset),
                offsets, is_leaf=_is_offset)
        rows = [matrix(o) for o in np.ndindex(*shape)]
        return jnp.stack(rows).reshape(shape + jnp.shape(z) * 2) if shape else rows[0]

