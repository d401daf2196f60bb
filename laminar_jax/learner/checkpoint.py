"""Orbax checkpoints of the TrainState plus caller-supplied JSON ("extra").

Layout per step: item 'state' = {leaf index: array} of the flattened TrainState (restored into
the live state's tree structure and shardings), item 'meta' = JSON {version, leaf_paths, extra}.
Flattening keeps orbax independent of nnx/optax container types; `leaf_paths` checks on restore
that the tree matches.

`restore_newest` walks the steps newest first: a checkpoint that does not restore (truncated or
corrupted files, e.g. a kill mid-save) is skipped and logged, and the newest one that restores
wins. A layout mismatch is never skipped (it means another model or optimizer, not damage).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class LayoutMismatch(ValueError):
    """The checkpoint's TrainState tree differs from the live learner's."""


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist but none restores; the message names each step and its error."""


class Restored(NamedTuple):
    step: int
    state: Any
    meta: dict
    skipped: tuple[tuple[int, str], ...]  # (step, error) of newer checkpoints that did not restore


def _leaf_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _leaf_dtypes(tree: Any) -> list[str]:
    return [str(getattr(x, "dtype", type(x).__name__)) for x in jax.tree.leaves(tree)]


def _check_dtypes(directory: str, step: int, saved: Optional[list], live: list[str], paths: list[str]) -> None:
    """A tensor may restore into a dtype that holds its values exactly (a bfloat16 state trained
    without master weights resumes as a float32 master); into any other (a float32 master into
    bfloat16 parameters) is another layout: say which tensor and both dtypes. Checkpoints written
    before dtypes were recorded are not checked (orbax casts them to the live dtype)."""
    if saved is None:
        return
    for path, a, b in zip(paths, saved, live):
        if a != b and str(jnp.promote_types(a, b)) != b:
            raise LayoutMismatch(f"checkpoint {directory} step {step}: {path} is {a}, the live learner's is {b} "
                                 f"(learner.master_weights and model.param_dtype set the state's dtypes)")


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
        meta = dict(meta, leaf_paths=_leaf_paths(state), leaf_dtypes=_leaf_dtypes(state))
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
            hint = ""
            if any(p.endswith("'kernel']") for p in meta.get("leaf_paths", [])):
                # Linear weights were stored [in, out] as 'kernel' before they took HF's [out, in] 'weight'.
                hint = ("; it stores Linear weights as 'kernel' [in, out], written before they became 'weight' "
                        "[out, in]: export it to HF with the version that wrote it, then start from that directory")
            raise LayoutMismatch(f"checkpoint {self.directory} step {step}: state layout differs from the live "
                                 f"learner ({len(meta.get('leaf_paths', []))} vs {len(paths)} leaves){hint}")
        _check_dtypes(self.directory, step, meta.get("leaf_dtypes"), _leaf_dtypes(like), paths)
        leaves, treedef = jax.tree.flatten(like)
        abstract = {f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for i, x in enumerate(leaves)}
        items = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        return jax.tree.unflatten(treedef, [items[f"{i:05d}"] for i in range(len(leaves))]), meta

    def all_steps(self) -> list[int]:
        self._mgr.wait_until_finished()
        return sorted(self._mgr.all_steps())

    def restore_newest(self, like: Any) -> Optional[Restored]:
        """The newest checkpoint that restores (None when there is none); damaged newer ones are
        skipped with a warning naming the step and the error."""
        skipped: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            try:
                state, meta = self.restore(step, like)
            except LayoutMismatch:
                raise
            except (ValueError, OSError, RuntimeError, KeyError, EOFError) as e:
                # what orbax/tensorstore raise for damaged files; programming errors (TypeError,
                # AttributeError) are not damage and propagate
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                log.warning("checkpoint %s step %d does not restore (%s); trying the previous one",
                            self.directory, step, err)
                skipped.append((step, err))
                continue
            if skipped:
                log.warning("checkpoint %s: resumed from step %d; newer step(s) %s did not restore",
                            self.directory, step, [s for s, _ in skipped])
            return Restored(step, state, meta, tuple(skipped))
        if skipped:
            raise NoUsableCheckpoint(f"checkpoint {self.directory}: no checkpoint restores: "
                                     + "; ".join(f"step {s}: {e}" for s, e in skipped))
        return None

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()
