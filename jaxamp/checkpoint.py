"""Atomic checkpoints of a whole :class:`~jaxamp.TrainState` with orbax-checkpoint.

Orbax writes each checkpoint into a temporary directory and renames it into place only
once it is complete, so an interrupted save never replaces or corrupts an earlier one.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


class Checkpointer:
    """Save and restore training states under ``directory/<step>``.

    Args:
      directory: where checkpoints live (created if missing). Must be a path, not a file.
      max_to_keep: how many of the newest checkpoints to keep (``None``: all).
    """

    def __init__(self, directory: Union[str, os.PathLike], *, max_to_keep: Optional[int] = 3) -> None:
        directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"Checkpointer: `directory`={directory!r} exists and is not a directory.")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"Checkpointer: `max_to_keep`={max_to_keep!r} must be a positive integer or None.")
        self.directory = directory
        self._manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def save(self, state: Any, *, step: Optional[int] = None) -> int:
        """Write ``state`` (blocking until it is durable) and return the step it is filed under.

        ``step`` defaults to ``int(state.step)``.
        """
        step = int(state.step) if step is None else int(step)
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()
        return step

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def all_steps(self):
        return list(self._manager.all_steps())

    def restore(self, like: Any, *, step: Optional[int] = None) -> Any:
        """Restore the checkpoint at ``step`` (default: the latest) into the structure of ``like``
        (e.g. a freshly created state), bit for bit."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"Checkpointer: no checkpoint in {self.directory!r} to restore.")
        elif step not in self.all_steps():
            raise FileNotFoundError(
                f"Checkpointer: `step`={step!r} has no checkpoint in {self.directory!r}; "
                f"available steps: {self.all_steps()}."
            )
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
        restored = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        # Orbax hands back containers of its own choosing for some nodes; rebuild ``like``'s.
        # Its arrays come committed to a device, which would make a step jitted before the
        # restore compile again: hand back plain (uncommitted) arrays, as a fresh state has.
        leaves = [jnp.asarray(x) for x in jax.device_get(jax.tree_util.tree_leaves(restored))]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
