"""Orbax checkpoints of the TrainState plus caller-supplied JSON ("extra").

Layout per step: item 'state' = {leaf index: array} of the flattened TrainState (restored into
the live state's tree structure and shardings), item 'meta' = JSON {version, leaf_paths, extra}.
Flattening keeps orbax independent of nnx/optax container types; `leaf_paths` checks on restore
that the tree matches.

`restore_newest` walks the steps newest first: a checkpoint that does not restore (truncated or
corrupted files, an empty or garbled metadata file, a step directory emptied by hand; whatever
orbax raises) is logged, and the newest one that restores wins. The newer steps that did not
restore are then moved aside to `<directory>/damaged/<step>-<UTC time>` (outside orbax's step
scan, kept for inspection): the resumed run retrains those steps and saves them again without
colliding with the damaged copies. A layout mismatch is never skipped (it means another model or
optimizer, not damage), and when no step restores nothing is moved (the resume stops, naming each
step and its error: the cause may be the environment, e.g. memory, rather than the files).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)

DAMAGED_DIR = "damaged"  # under the checkpoint directory; not a step number, so orbax never lists it


class LayoutMismatch(ValueError):
    """The checkpoint's TrainState tree differs from the live learner's."""


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist but none restores; the message names each step and its error."""


class Damaged(NamedTuple):
    """A newer step that did not restore: its error, and where it was moved (None on processes > 0,
    which leave the move to process 0)."""
    step: int
    error: str
    moved_to: Optional[str]


class Restored(NamedTuple):
    step: int
    state: Any
    meta: dict
    skipped: tuple[Damaged, ...]  # newer checkpoints that did not restore, moved aside


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
            elif any("['layers'][0]" in p for p in meta.get("leaf_paths", [])):
                # Each layer's parameters were leaves of their own before the layers became one stack.
                hint = ("; it stores each layer's parameters apart, written before the layers were stacked "
                        "(model/transformer.py): export it to HF with the version that wrote it, then start from "
                        "that directory")
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
        """The newest checkpoint that restores (None when there is none); newer ones that do not
        restore are logged and moved aside to `damaged/` (see the module docstring)."""
        failed: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            try:
                state, meta = self.restore(step, like)
            except LayoutMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise anything, bare Exception included
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                log.warning("checkpoint %s step %d does not restore (%s); trying the previous one",
                            self.directory, step, err)
                failed.append((step, err))
                continue
            damaged = self._move_aside(failed) if failed else ()
            return Restored(step, state, meta, damaged)
        if failed:
            raise NoUsableCheckpoint(f"checkpoint {self.directory}: no checkpoint restores: "
                                     + "; ".join(f"step {s}: {e}" for s, e in failed))
        return None

    def _move_aside(self, failed: list[tuple[int, str]]) -> tuple[Damaged, ...]:
        """Move the steps in `failed` to damaged/<step>-<UTC time> (process 0; the others wait for
        it) and make the manager forget them, so that saving those steps again cannot collide."""
        root = epath.Path(self.directory)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        out = []
        for step, err in failed:
            dest = None
            if jax.process_index() == 0:
                dest = root / DAMAGED_DIR / f"{step}-{stamp}"
                n = 1
                while dest.exists():  # damaged twice within a second
                    dest, n = root / DAMAGED_DIR / f"{step}-{stamp}-{n}", n + 1
                try:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    (root / str(step)).rename(dest)
                except OSError as e:  # e.g. a store without directory renames: say what to do by hand
                    raise NoUsableCheckpoint(
                        f"checkpoint {self.directory} step {step} does not restore ({err}) and could not be moved "
                        f"aside to {dest} ({e}); move or delete it by hand, then resume") from e
                log.warning("checkpoint %s step %d moved aside to %s (it did not restore: %s)",
                            self.directory, step, dest, err)
                dest = str(dest)
            out.append(Damaged(step, err, dest))
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"laminar_checkpoint_move_aside_{failed[0][0]}")
        self._mgr.reload()
        return tuple(out)

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()
