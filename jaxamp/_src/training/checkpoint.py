"""Atomic checkpoints of a whole :class:`~jaxamp.TrainState` with orbax-checkpoint
(written to a temporary directory, renamed when complete: an interrupted save harms nothing).
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


def _name(path: Any) -> str:
    """orbax's dotted name of a key path (``params.Dense_0.kernel``, ``amp_state.derivative.2.scale``)."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


class Checkpointer:
    """Save and restore training states (any pytree of arrays) under ``directory/<step>``.

    Args:
      directory: where checkpoints live (created if missing). Must be a path, not a file.
      max_to_keep: how many of the newest checkpoints to keep (``None``: all).

    Example (a dict has no ``.step``: pass ``step=``; a :class:`~jaxamp.TrainState` needs none):
      >>> import tempfile, jax.numpy as jnp, jaxamp
      >>> state = {"train": {"w": jnp.arange(3.0)}, "monitor": jnp.int32(7)}
      >>> with tempfile.TemporaryDirectory() as d, jaxamp.Checkpointer(d) as ckpt:
      ...     ckpt.save(state, step=7)
      ...     restored = ckpt.restore({"train": {"w": jnp.zeros(3)}, "monitor": jnp.int32(0)})
      7
      >>> restored["train"]["w"], int(restored["monitor"])
      (Array([0., 1., 2.], dtype=float32), 7)
    """

    def __init__(self, directory: Union[str, os.PathLike], *, max_to_keep: Optional[int] = 3) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"Checkpointer: `directory`={directory!r} must be a path (a str or os.PathLike), e.g. "
                            "Checkpointer('runs/ckpt').")
        directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"Checkpointer: `directory`={directory!r} exists and is not a directory.")
        bad = isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        if max_to_keep is not None and bad:
            raise ValueError(f"Checkpointer: `max_to_keep`={max_to_keep!r} must be a positive integer or None.")
        self.directory = directory
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        # The item handler, so that a fresh manager reads the metadata.
        self._manager = ocp.CheckpointManager(directory, options=options, item_handlers=ocp.StandardCheckpointHandler())

    def save(self, state: Any, *, step: Optional[int] = None) -> int:
        """Write ``state`` (blocking until it is durable).

        Args:
          state: any pytree of arrays.
          step: the number it is filed under; default ``int(state.step)``.

        Returns:
          That step.
        """
        if step is None and not hasattr(state, "step"):
            raise TypeError(f"Checkpointer.save: `state` (a {type(state).__name__}) has no .step to file it under; "
                            "pass step=, e.g. save(state, step=1000).")
        step = state.step if step is None else step
        if isinstance(step, bool) or not (isinstance(step, int) or jnp.ndim(step) == 0) or int(step) < 0:
            raise ValueError(f"Checkpointer.save: `step`={step!r} must be an integer >= 0 (the number the "
                             "checkpoint is filed under).")
        step = int(step)
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()
        return step

    def latest_step(self) -> Optional[int]:
        """The newest saved step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> List[int]:
        """Every saved step, oldest first."""
        return list(self._manager.all_steps())

    def restore(self, like: Any, *, step: Optional[int] = None) -> Any:
        """Restore a checkpoint bit for bit into the structure of ``like``.

        Args:
          like: a state of the saved structure, shapes and dtypes (e.g. a freshly created one);
            a mismatch raises a ValueError naming the leaves that differ.
          step: which checkpoint; default the latest.

        Returns:
          The restored state, with ``like``'s containers (TrainState, Scalers, ...).
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"Checkpointer: no checkpoint in {self.directory!r} to restore.")
        elif step not in self.all_steps():
            raise FileNotFoundError(f"Checkpointer: `step`={step!r} has no checkpoint in {self.directory!r}; "
                                    f"available steps: {self.all_steps()}.")
        self._check_matches(step, like)
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
        restored = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        # Rebuild ``like``'s containers, with uncommitted arrays as a fresh state has (orbax's
        # committed ones would make a step jitted before the restore compile again).
        leaves = [jnp.asarray(x) for x in jax.device_get(jax.tree_util.tree_leaves(restored))]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)

    def _check_matches(self, step: int, like: Any) -> None:
        """Raise a ValueError naming every leaf where the checkpoint and ``like`` differ."""
        meta = self._manager.item_metadata(step)
        if meta is None:  # no metadata to compare with: orbax's own checks apply
            return
        leaves = jax.tree_util.tree_leaves(getattr(meta, "tree", meta), is_leaf=lambda x: hasattr(x, "shape"))
        saved = {m.name: (tuple(m.shape), np.dtype(m.dtype)) for m in leaves if hasattr(m, "name")}
        if not saved:
            return
        wanted = {_name(path): (tuple(np.shape(x)), np.dtype(getattr(x, "dtype", np.asarray(x).dtype)))
                  for path, x in jax.tree_util.tree_flatten_with_path(like)[0]}
        only = (("only in the checkpoint", saved.keys() - wanted), ("only in `like`", wanted.keys() - saved))
        problems = [f"{what}: {sorted(names)[:6]}{' ...' if len(names) > 6 else ''}" for what, names in only if names]
        differ = [f"{n} (checkpoint {saved[n][1]}{list(saved[n][0])}, like {wanted[n][1]}{list(wanted[n][0])})"
                  for n in sorted(saved.keys() & wanted.keys()) if saved[n] != wanted[n]]
        if differ:
            problems.append(f"different shape or dtype: {differ[:6]}")
        if problems:
            raise ValueError(f"Checkpointer.restore: the checkpoint at step {step} in {self.directory!r} does not "
                             f"match `like`: {'; '.join(problems)}. Pass as `like` a state built as the saved one "
                             "(same model, optimizer, amp and engines); a checkpoint written before a change of "
                             "TrainState's layout (CHANGELOG.md) does not restore: start a new directory.")

    def close(self) -> None:
        """Release orbax's resources (also on leaving a ``with`` block)."""
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
