"""Checkpointer: a damaged newest checkpoint falls back to the newest one that restores."""

import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.learner.checkpoint import Checkpointer, LayoutMismatch, NoUsableCheckpoint


def _state(x: float) -> dict:
    return {"w": jnp.full((256, 64), x, jnp.float32), "b": jnp.arange(8, dtype=jnp.int32) + int(x)}


def _truncate_step(directory: str, step: int) -> int:
    """Truncate every data file of ``step``'s state to half (a kill mid-write); returns how many."""
    n = 0
    for root, _, files in os.walk(os.path.join(directory, str(step), "state")):
        for f in files:
            path = os.path.join(root, f)
            size = os.path.getsize(path)
            if size > 64 and not f.endswith((".json", "_METADATA", "manifest.ocdbt")):
                with open(path, "r+b") as fh:
                    fh.truncate(size // 2)
                n += 1
    return n


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path, caplog):
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=3, async_save=False)
    for step, x in ((1, 1.0), (2, 2.0)):
        ck.save(step, _state(x), {"version": step, "extra": {"step": step}})
    ck.close()
    assert _truncate_step(d, 2) >= 1
    ck = Checkpointer(d, keep=3, async_save=False)
    caplog.set_level(logging.WARNING, logger="laminar_jax.learner.checkpoint")
    got = ck.restore_newest(_state(0.0))
    ck.close()
    assert got.step == 1 and [s for s, _ in got.skipped] == [2]
    np.testing.assert_array_equal(np.asarray(got.state["w"]), np.full((256, 64), 1.0, np.float32))
    assert got.meta["extra"] == {"step": 1}
    assert any("step 2 does not restore" in r.getMessage() for r in caplog.records)


def test_no_restorable_checkpoint_raises_and_a_layout_change_is_never_skipped(tmp_path):
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=3, async_save=False)
    ck.save(1, _state(1.0), {"version": 1, "extra": {}})
    ck.close()
    ck = Checkpointer(d, keep=3, async_save=False)
    with pytest.raises(LayoutMismatch):
        ck.restore_newest({"w": jnp.zeros((256, 64))})
    _truncate_step(d, 1)
    with pytest.raises(NoUsableCheckpoint, match="step 1"):
        ck.restore_newest(_state(0.0))
    ck.close()
    assert Checkpointer(str(tmp_path / "empty"), keep=1, async_save=False).restore_newest(_state(0.0)) is None


def test_a_checkpoint_of_in_out_kernels_names_the_weight_layout_change(tmp_path):
    # Checkpoints written before Linear weights became HF's [out, in] 'weight' stored [in, out]
    # 'kernel's; a square one would restore into the new shape transposed, so the paths refuse it.
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=1, async_save=False)
    ck.save(1, {"q_proj": {"kernel": jnp.ones((64, 64))}}, {"version": 1, "extra": {}})
    with pytest.raises(LayoutMismatch, match="'kernel' \\[in, out\\].*'weight' \\[out, in\\]"):
        ck.restore_newest({"q_proj": {"weight": jnp.zeros((64, 64))}})
    ck.close()
