"""Checkpointer: a damaged newest checkpoint falls back to the newest one that restores, and is
moved aside so that every later resume and save works."""

import glob
import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.learner.checkpoint import DAMAGED_DIR, Checkpointer, LayoutMismatch, NoUsableCheckpoint


def _state(x: float) -> dict:
    w = np.random.default_rng(int(x)).standard_normal((256, 64)).astype(np.float32)  # not compressible
    return {"w": jnp.asarray(w), "b": jnp.arange(8, dtype=jnp.int32) + int(x)}


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


def _truncate_array_data(directory: str, step: int) -> None:
    # The per-process OCDBT data files: orbax raises a bare Exception for these.
    paths = glob.glob(os.path.join(directory, str(step), "state", "ocdbt.process_*", "d", "*"))
    assert paths
    for p in paths:
        os.truncate(p, os.path.getsize(p) // 2)


def _write_meta(directory: str, step: int, text: str) -> None:
    with open(os.path.join(directory, str(step), "meta", "metadata"), "w") as f:
        f.write(text)


def _empty_step_dir(directory: str, step: int) -> None:
    shutil.rmtree(os.path.join(directory, str(step)))
    os.makedirs(os.path.join(directory, str(step)))


DAMAGE = {
    "truncated-data-file": _truncate_array_data,
    "empty-metadata": lambda d, s: _write_meta(d, s, ""),
    "garbage-json-metadata": lambda d, s: _write_meta(d, s, '{"version": 2, "extra": [}'),
    "empty-step-directory": _empty_step_dir,
}


def _resume(d: str):
    ck = Checkpointer(d, keep=3, async_save=False)
    try:
        return ck.restore_newest(_state(0.0))
    finally:
        ck.close()


def _assert_step(got, step: int) -> None:
    assert got.step == step
    np.testing.assert_array_equal(np.asarray(got.state["w"]), np.asarray(_state(float(step))["w"]))
    assert got.meta["version"] == step and got.meta["extra"] == {"step": step}  # the ledger of that step


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_step_is_moved_aside_and_every_retry_resumes(damage, tmp_path, caplog):
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=3, async_save=False)
    for step in (1, 2):
        ck.save(step, _state(float(step)), {"version": step, "extra": {"step": step}})
    ck.close()
    DAMAGE[damage](d, 2)
    caplog.set_level(logging.WARNING, logger="laminar_jax.learner.checkpoint")

    got = _resume(d)
    _assert_step(got, 1)
    # Resuming again: step 1 again.
    again = _resume(d)
    _assert_step(again, 1)
    # The retrained step 2 saves (no StepAlreadyExistsError), and the next resume takes it.
    ck = Checkpointer(d, keep=3, async_save=False)
    ck.save(2, _state(2.0), {"version": 2, "extra": {"step": 2}})
    ck.close()
    _assert_step(_resume(d), 2)

    # The damaged step was moved aside, kept for inspection, and named in the log.
    [bad] = got.skipped
    assert again.skipped == ()  # nothing left to skip the second time
    assert bad.step == 2 and bad.error and os.path.dirname(bad.moved_to) == os.path.join(d, DAMAGED_DIR)
    assert os.path.basename(bad.moved_to).startswith("2-") and os.path.isdir(bad.moved_to)
    assert os.listdir(os.path.join(d, DAMAGED_DIR)) == [os.path.basename(bad.moved_to)]
    messages = [r.getMessage() for r in caplog.records]
    assert any("step 2 does not restore" in m for m in messages)
    assert any(f"step 2 moved aside to {bad.moved_to}" in m for m in messages)


def test_the_manager_that_restored_saves_the_moved_step_again(tmp_path):
    # The learner saves through the same Checkpointer it restored with: its step list must forget the moved step.
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=3, async_save=False)
    for step in (1, 2, 3):
        ck.save(step, _state(float(step)), {"version": step, "extra": {"step": step}})
    ck.close()
    _truncate_array_data(d, 3)
    _write_meta(d, 2, "")
    ck = Checkpointer(d, keep=3, async_save=False)
    got = ck.restore_newest(_state(0.0))
    _assert_step(got, 1)
    assert [b.step for b in got.skipped] == [3, 2] and ck.all_steps() == [1]
    for step in (2, 3):
        ck.save(step, _state(float(step)), {"version": step, "extra": {"step": step}})
    assert ck.all_steps() == [1, 2, 3]
    ck.close()
    _assert_step(_resume(d), 3)
    assert sorted(n.split("-")[0] for n in os.listdir(os.path.join(d, DAMAGED_DIR))) == ["2", "3"]


def test_a_step_that_cannot_be_moved_aside_is_an_error_saying_what_to_do(tmp_path):
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=3, async_save=False)
    for step in (1, 2):
        ck.save(step, _state(float(step)), {"version": step, "extra": {"step": step}})
    ck.close()
    _write_meta(d, 2, "")
    with open(os.path.join(d, DAMAGED_DIR), "w") as f:  # in the way of the damaged/ directory
        f.write("not a directory")
    with pytest.raises(NoUsableCheckpoint, match="step 2 does not restore .* could not be moved aside to "
                                                 ".*; move or delete it by hand, then resume"):
        _resume(d)
    assert os.path.isdir(os.path.join(d, "2"))


def test_no_restorable_checkpoint_raises_moves_nothing_and_a_layout_change_is_never_skipped(tmp_path):
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
    # Nothing restores: the cause may be the environment rather than the files, so nothing is moved.
    assert os.path.isdir(os.path.join(d, "1")) and not os.path.exists(os.path.join(d, DAMAGED_DIR))
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


def test_a_checkpoint_of_per_layer_parameters_names_the_stacked_layout(tmp_path):
    # Checkpoints written before the layers were stacked hold one leaf per layer and parameter.
    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=1, async_save=False)
    ck.save(1, {"layers": {0: {"w": jnp.ones((4,))}, 1: {"w": jnp.ones((4,))}}}, {"version": 1, "extra": {}})
    with pytest.raises(LayoutMismatch, match="each layer's parameters apart.*export it to HF"):
        ck.restore_newest({"layers": {"w": jnp.zeros((2, 4))}})
    ck.close()
