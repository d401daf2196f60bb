"""A real run whose newest checkpoint is damaged resumes from the one before, with the ledger of
that step (no prompt lost or trained twice), names the damaged step in its summary, and resumes
again afterwards."""

import glob
import os

import pytest

from laminar_jax.config import finalize, repo_config


def _run(run_dir: str, steps: int) -> dict:
    from laminar_jax.runtime.local import run_local

    c = repo_config("demo", "short")
    c.runtime.run_dir, c.runtime.total_steps, c.runtime.checkpoint_every = run_dir, steps, 1
    c.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test
    return run_local(finalize(c))


@pytest.mark.slow  # three short demo runs (the default tier covers the Checkpointer in test_learner_checkpoint.py)
def test_a_run_resumes_past_a_truncated_newest_checkpoint_every_time(tmp_path):
    run_dir = str(tmp_path / "run")
    first = _run(run_dir, 3)
    assert first["steps"] == 3 and first["damaged_checkpoints"] == []
    ckpt = os.path.join(run_dir, "checkpoints")
    data = glob.glob(os.path.join(ckpt, "3", "state", "ocdbt.process_*", "d", "*"))
    assert data
    for p in data:  # a kill mid-write of the array data: orbax raises a bare Exception for it
        os.truncate(p, os.path.getsize(p) // 2)

    second = _run(run_dir, 5)
    assert second["restore"]["step"] == 2
    [bad] = second["damaged_checkpoints"]
    assert bad["step"] == 3 and bad["moved_to"].startswith(os.path.join(ckpt, "damaged", "3-"))
    assert os.path.isdir(bad["moved_to"])
    # Step 3 trained again from step 2's ledger: every step consumed distinct prompts.
    assert second["steps"] == 5 and second["steps_this_run"] == 3 and second["redone_steps"] == 1
    assert second["lost_prompts"] == 0 and second["duplicated_prompts"] == 0
    assert second["consumed_prompts"] == 5 * 8

    third = _run(run_dir, 6)
    assert third["restore"] == {"step": 5, "skipped": []} and third["damaged_checkpoints"] == []
    assert third["steps"] == 6 and third["lost_prompts"] == 0 and third["duplicated_prompts"] == 0
    assert third["consumed_prompts"] == 6 * 8
