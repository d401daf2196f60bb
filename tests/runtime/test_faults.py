"""Fault isolation in the local runtime: a crashed or hung rollout server, a dead relay and a dead
learner each cost a recovery, never a lost or repeated prompt, and the run always completes."""

import json
import time

from laminar_jax.benchmarks import faults
from laminar_jax.config import finalize
from laminar_jax.runtime.local import LocalRun


def test_chaos_schedule_completes_without_loss(tmp_path):
    t0 = time.monotonic()
    result = faults.main(["--quick", "--out", str(tmp_path),
                          "--set", "learner.compile_ahead=none"])  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    assert result["completed"] and result["killed"] == ["rollout", "relay", "learner"]
    assert result["lost_prompts"] == 0 and result["duplicated_prompts"] == 0
    assert result["consumed_prompts"] == result["expected_prompts"]
    assert result["recovery_s"]["rollout"] is not None and result["recovery_s"]["learner"] is not None
    assert result["recovery_s"]["relay"] is not None  # servers moved on to newer versions via the store
    assert result["overrides"] == {"learner.compile_ahead": "none"}
    with open(tmp_path / "run" / "config.json", encoding="utf-8") as f:
        assert json.load(f)["learner"]["compile_ahead"] == "none"  # --set reached the run's config
    assert time.monotonic() - t0 < 300


def test_hung_server_is_declared_dead_by_heartbeat_and_replaced(tmp_path):
    c = faults.chaos_config(8, str(tmp_path / "run"))
    c.scheduler.heartbeat_timeout_s = 1.5
    c.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    run = LocalRun(finalize(c), c.runtime.run_dir)
    worker = run.fleet.workers[1]
    original = worker.server.step
    state = {"hung": False}

    def hang_until_declared_dead():
        if not state["hung"]:
            state["hung"] = True
            deadline = time.monotonic() + 30.0  # silent for longer than the heartbeat timeout
            while not worker.killed.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
        return original()

    def after_step(v):
        if v == 1:
            worker.server.step = hang_until_declared_dead
        if v == 2:  # the learner may outrun the heartbeat on the healthy server: let detection land
            deadline = time.monotonic() + 30.0
            while not any(f.get("server") == "rollout-1" for f in run.failures) and time.monotonic() < deadline:
                time.sleep(0.05)

    run.on_step_hooks.append(after_step)
    s = run.run()
    assert s["steps"] == 8 and s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    hung = [f for f in s["failures"] if f.get("server") == "rollout-1"]
    assert hung and "no heartbeat" in hung[0]["error"] and hung[0]["recovery_s"] is not None
    assert s["consumed_prompts"] == 8 * c.runtime.prompts_per_step
