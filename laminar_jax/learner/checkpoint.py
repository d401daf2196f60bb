"""Orbax checkpoints of the TrainState plus caller-supplied JSON ("extra").

Layout per step: item 'state' = {leaf index: array} of the flattened TrainState (restored into
the live state's tree structure and shardings), item 'meta' = JSON {version, leaf_paths, extra}.
Flattening keeps orbax independent of nnx/optax container types; `leaf_paths` checks on restore
that the tree matches.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


def _leaf_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class Checkpointer:
    """Thin wrapper over ocp.CheckpointManager (async saves; waits before restore and close)."""

    def __init__(self, directory: str, keep: int, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._mgr = ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))
        self.directory = directory

    def save(self, step: int, state: Any, meta: dict) -> None:
        leaves = jax.tree.leaves(state)
        items = {f"{i:05d}": x for i, x in enumerate(leaves)}
        meta = dict(meta, leaf_paths=_leaf_paths(state))
        self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(items),
                                                     meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self) -> Optional[int]:
        self._mgr.wait_until_finished()
        return self._mgr.latest_step()

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore into the structure/shardings of `like` (a live state); returns (state, meta)."""
        self._mgr.wait_until_finished()
        meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        paths = _leaf_paths(like)
        if meta.get("leaf_paths") != paths:
            raise ValueError(f"checkpoint {self.directory} step {step}: state layout differs from the live "
                             f"learner ({len(meta.get('leaf_paths', []))} vs {len(paths)} leaves)")
        leaves, treedef = jax.tree.flatten(like)
        abstract = {f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for i, x in enumerate(leaves)}
        items = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        return jax.tree.unflatten(treedef, [items[f"{i:05d}"] for i in range(len(leaves))]), meta

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()
