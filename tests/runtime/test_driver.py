"""The Driver over the real buffer service, real rollout workers in a real ThreadFleet, and the real
health and repack loops, with a fake learner and fake servers (runtime_fakes.py): every prompt is
trained exactly once, and a crash in any role reaches the driver with its traceback, losing nothing."""

import json
import os
import time

import pytest

from laminar_jax.config import finalize, repo_config
from laminar_jax.buffer.service import BufferService
from laminar_jax.runtime.driver import Driver
from laminar_jax.runtime.fleet import ThreadFleet
from laminar_jax.monitor.sink import Monitor
from laminar_jax.runtime.rollout_worker import RolloutWorker
from laminar_jax.scheduler.modes import get_policy
from laminar_jax.threads import WorkerFailed
from tests.runtime.runtime_fakes import FakeLearner, FakeServer, FakeWeights


def _config(tmp_path, mode="laminar", steps=4, **runtime):
    c = repo_config("demo", "short")
    c.runtime.update(mode=mode, total_steps=steps, progress=False, timeline=False, num_servers=2,
                     run_dir=str(tmp_path / "run"), wait_timeout_s=60.0, **runtime)
    c.scheduler.heartbeat_timeout_s = 2.0
    c.data.reward_workers = 1
    return finalize(c)


def _driver(cfg, learner_fail=None, server_steps=2):
    buffer = BufferService(cfg, learner_version=0)
    weights = FakeWeights()
    checkpoints, trained = {}, []
    learner = FakeLearner(checkpoints, trained, fail_with=learner_fail)
    weights.attach(learner, initial=True)
    policy = get_policy(cfg.runtime.mode, cfg.scheduler.repack, cfg.scheduler.admit_lag)

    def make(i, generation, version, params):
        name = f"rollout-{i}" if generation == 0 else f"rollout-{i}.{generation}"
        buffer.register(i, name, version)
        return RolloutWorker(i, name, FakeServer(name, version, steps=server_steps), weights.client(name), buffer,
                             policy, lambda flat: flat, pull_timeout_s=5.0)

    fleet = ThreadFleet([make(i, 0, 0, None) for i in range(cfg.runtime.num_servers)], make,
                        cfg.scheduler.heartbeat_timeout_s)
    driver = Driver(cfg, cfg.runtime.run_dir, learner=learner, make_learner=lambda: FakeLearner(checkpoints, trained),
                    buffer=buffer, fleet=fleet, weights=weights, monitor=Monitor(cfg, cfg.runtime.run_dir, time.time()))
    return driver, trained


def _wait_for_failure(driver, server, timeout=20.0):
    """Hold the learner (in a step hook) until the health loop has recorded `server`'s failure."""
    deadline = time.monotonic() + timeout
    while not any(f.get("server") == server for f in driver.failures):
        assert time.monotonic() < deadline, f"{server}'s failure was not detected within {timeout}s"
        time.sleep(0.05)


def _exactly_once(s, cfg, trained):
    rt = cfg.runtime
    assert s["steps"] == rt.total_steps and s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["consumed_prompts"] == rt.total_steps * rt.prompts_per_step
    assert len(trained) == len(set(trained)) == rt.total_steps * rt.prompts_per_step * rt.samples_per_prompt


@pytest.mark.parametrize("mode", ["laminar", "sync"])
def test_driver_trains_every_prompt_exactly_once(mode, tmp_path):
    cfg = _config(tmp_path, mode)
    driver, trained = _driver(cfg)
    s = driver.run()
    _exactly_once(s, cfg, trained)
    assert s["failures"] == [] and s["gen_tokens_per_s"] > 0
    if mode == "sync":
        assert s["mean_staleness"] == 0.0
    # The summary's tokens/s is the run's trained tokens (kept as a running sum) over its RL wall time.
    with open(os.path.join(cfg.runtime.run_dir, "metrics.jsonl")) as f:
        tokens = sum(json.loads(line)["tokens"] for line in f)
    assert tokens > 0 and tokens / s["train_tokens_per_s"] == pytest.approx(s["rl_wall_s"], abs=0.006)  # 2 decimals


def test_the_next_batch_is_taken_while_a_step_computes_and_trained_even_past_the_budget(tmp_path):
    """The learner's host work for step N+1 overlaps step N: a batch the buffer already holds is taken
    and prepared (for version N+1: FakeLearner.dispatch checks it) while N computes. A batch so taken
    has its prompts consumed, so it is trained even when the wall budget ends the run first."""
    cfg = _config(tmp_path, steps=1000, max_wall_s=3.0, checkpoint_every=3)
    driver, trained = _driver(cfg)
    checkpoints = driver.learner.checkpoints
    prepared = []
    prepare = driver.learner.prepare
    driver.learner.prepare = lambda trajs, version: prepared.append(version) or prepare(trajs, version)
    driver.on_step_hooks.append(lambda v: time.sleep(0.2))  # the servers fill the buffer meanwhile
    s = driver.run()
    rt = cfg.runtime
    assert prepared and s["stopped_early"]
    assert s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["consumed_prompts"] == s["steps"] * rt.prompts_per_step  # nothing consumed and left untrained
    assert len(trained) == len(set(trained)) == s["steps"] * rt.prompts_per_step * rt.samples_per_prompt
    assert len(driver.monitor.steps) == s["steps"]  # every step reached the monitor, the last one too
    # No batch is taken ahead across a checkpoint: each one's buffer snapshot counts consumed exactly
    # the prompts its learner has trained, so a resume from it trains every other prompt.
    assert not [v for v in prepared if v % 3 == 0]
    assert len(checkpoints) >= 2
    for step, (version, extra) in checkpoints.items():
        consumed = sum(e["state"] == "consumed" for e in extra["runtime"]["ledger"]["entries"].values())
        assert consumed == version * rt.prompts_per_step, (step, version, consumed)


def test_a_crashed_server_is_replaced_and_its_work_regenerated(tmp_path):
    cfg = _config(tmp_path, steps=5)
    driver, trained = _driver(cfg, server_steps=20)  # long sequences: the server holds work when it dies

    def crash(v):
        if v == 1:
            driver.fleet.workers[0].server.crash_in_step = True
            _wait_for_failure(driver, "rollout-0")

    driver.on_step_hooks.append(crash)
    s = driver.run()
    _exactly_once(s, cfg, trained)
    [f] = [f for f in s["failures"] if f.get("server") == "rollout-0"]
    assert "crashed in step" in f["error"] and f["replacement"] == "rollout-0.1" and f["recovery_s"] is not None


def test_a_hung_server_is_declared_dead_by_heartbeat(tmp_path):
    cfg = _config(tmp_path, steps=4)
    driver, trained = _driver(cfg)

    def hang(v):
        if v == 1:
            w = driver.fleet.workers[1]
            original = w.server.step
            w.server.step = lambda: (w.killed.wait(30.0), original())[1]
            _wait_for_failure(driver, "rollout-1")

    driver.on_step_hooks.append(hang)
    s = driver.run()
    _exactly_once(s, cfg, trained)
    assert any("no heartbeat" in f["error"] for f in s["failures"] if f.get("server") == "rollout-1")


def test_a_dead_learner_restarts_from_its_checkpoint_and_replays(tmp_path):
    cfg = _config(tmp_path, steps=5, checkpoint_every=2)
    driver, trained = _driver(cfg)
    driver.on_step_hooks.append(lambda v: v == 3 and driver.inject_learner_crash())
    s = driver.run()
    _exactly_once(s, cfg, trained)
    [f] = [f for f in s["failures"] if "learner" in f]
    assert "injected learner crash" in f["learner"] and f["replayed_steps"] == 1  # step 3, after checkpoint 2


def test_a_learner_error_stops_the_run_and_every_thread(tmp_path):
    cfg = _config(tmp_path)
    driver, _ = _driver(cfg, learner_fail=ValueError("bad batch"))
    with pytest.raises(ValueError, match="bad batch"):
        driver.run()
    assert driver.sup.stop.is_set() and all(not w.alive for w in driver.sup.workers)
    assert all(not t.alive for t in driver.fleet._threads.values())


def test_a_dead_buffer_thread_reaches_the_driver_with_its_traceback(tmp_path):
    cfg = _config(tmp_path)
    driver, _ = _driver(cfg)
    pump = driver.buffer.dispatcher.pump

    def broken_pump(version):
        if version >= 1:
            raise RuntimeError("dispatcher broke")
        return pump(version)

    driver.buffer.dispatcher.pump = broken_pump
    with pytest.raises(WorkerFailed, match="(?s)buffer-dispatcher.*dispatcher broke.*broken_pump"):
        driver.run()

