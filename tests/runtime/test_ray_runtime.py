"""The Ray runtime: the demo's short variant on a local Ray cluster (CPU, two rollout actors; a live
sequence moved between them, then one killed mid-run while it owns work) completes without losing
or repeating a prompt; the buffer actor's ownership logic (requeue on failure, late results
dropped, repack moves, admission)."""

import os
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from laminar_jax.config import finalize, repo_config

def demo(variant="short"):
    return repo_config("demo", variant)


def _wait(cond, timeout, what, seen=()):
    """`seen`: what the waiter last observed, for the failure message."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}; last seen: {list(seen)[-3:]}"
        time.sleep(0.05)


def test_demo_short_on_ray_survives_a_killed_rollout_actor(tmp_path):
    import threading

    from laminar_jax.runtime.ray_runtime import RayRun

    c = demo()
    c.runtime.kind = "ray"
    c.runtime.num_servers = 2
    c.runtime.run_dir = str(tmp_path / "run")
    c.runtime.wait_timeout_s = 240.0
    # A server must swap before it admits again: the two actors are at one version most of the time.
    c.scheduler.admit_lag = 0
    # Every batch is dispatched at the start (4 steps): both actors generate at version 0 for
    # seconds, the window in which the watcher below moves a sequence and kills an actor.
    c.runtime.max_inflight_batches = 5
    # One token per generate call, so a sequence stays live for many calls: at the demo's 8 the
    # version-0 tails were gone before the watcher saw two actors at one version with work to move
    # (CI, on a loaded machine: no move in the whole run).
    c.rollout.decode_steps_per_call = 1
    # 8 samples per prompt (the short demo's 4 gave the watcher no window in 1 of 3 runs once decode ran on
    # the native CPU kernels: every version-0 sequence was done before it saw two actors with work).
    c.runtime.samples_per_prompt = 8
    c.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    run = RayRun(finalize(c), c.runtime.run_dir)
    killed = {}
    moved, seen, errors = [], [], []
    done = threading.Event()

    def force_a_move():
        """One repack move between actors (export bytes -> import), whatever the planner thinks."""
        from laminar_jax.scheduler.repack import Move

        views = run.repacker.views()
        seen.append([(v.server_id, v.version, v.live, v.draining) for v in views])
        for a in views:
            for b in views:
                if a is not b and a.version == b.version and a.seq_pages and b.live < c.rollout.num_slots:
                    m = Move(seq_uid=a.seq_pages[0][0], src=a.server_id, dst=b.server_id)
                    if run.repacker.execute(m):
                        moved.append(m)
                        return

    def kill_one_that_owns_work():
        owned = run.buffer.stats()["owned"]
        name, n = max(owned.items(), key=lambda kv: kv[1], default=(None, 0))
        if n > 0:
            killed.update(name=name, owned=n)
            run.fleet.kill(int(name.split("-")[1].split(".")[0]))

    def watch():
        """While the actors generate (not from a step hook: holding the learner there once met
        actors that had finished every prompt already), move one sequence, then kill an actor
        that owns samples. Bounded; what it last saw goes into the failure message."""
        deadline = time.monotonic() + 240
        try:
            while not done.is_set() and not killed and time.monotonic() < deadline:
                force_a_move() if not moved else kill_one_that_owns_work()
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - reported by the assertion after the run
            errors.append(repr(e))

    watcher = threading.Thread(target=watch, name="test-watcher", daemon=True)
    start_fleet = run.fleet.start

    def start_then_watch():
        start_fleet()
        watcher.start()

    run.fleet.start = start_then_watch
    stop_fleet = run.fleet.stop

    def stop_watcher_then_fleet(*args, **kwargs):
        # The run stops its fleet before it shuts Ray down, however it ends: a Ray call from the
        # watcher after the shutdown would start a new local cluster in this process (it once took
        # the later tests down).
        done.set()
        if watcher.is_alive():
            watcher.join(timeout=10)
        return stop_fleet(*args, **kwargs)

    run.fleet.stop = stop_watcher_then_fleet

    def detection_lands(version):
        # With batches in flight the run could finish on other prompts before the health loop
        # looks: let the detection land (bounded) before the learner goes on. The last step also
        # waits for the watcher's kill itself (CI once saw it land after the run's last hook, and
        # the run ended on the other actor's samples with the death never detected).
        if version >= c.runtime.total_steps:
            _wait(lambda: killed or not watcher.is_alive(), 120, "the watcher to kill an actor", seen)
        if killed:
            name = killed["name"]
            _wait(lambda: any(f.get("server") == name for f in run.failures), 60, f"the health loop to detect {name}")

    run.on_step_hooks.append(detection_lands)
    try:
        s = run.run()
    finally:
        done.set()
        watcher.join(timeout=10)
    assert not errors and not watcher.is_alive(), errors
    assert moved and killed, f"no move or no kill while the actors generated; last seen: {seen[-3:]}"
    rt = c.runtime
    assert s["steps"] == rt.total_steps and not s["stopped_early"]
    assert s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["consumed_prompts"] == rt.total_steps * rt.prompts_per_step
    assert s["gen_tokens_per_s"] > 0 and 0.0 < s["latency_p50_s"] <= s["latency_p99_s"]  # from the buffer actor
    fails = [f for f in s["failures"] if f.get("server") == killed["name"]]
    assert len(fails) == 1 and "ActorDied" in fails[0]["error"], s["failures"]
    assert fails[0]["requeued"] >= 1 and killed["owned"] >= 1  # its unfinished samples were requeued
    assert not [f for f in s["failures"] if f.get("server") != killed["name"]], s["failures"]
    assert len(moved) == 1 and s["repack_moves"] >= 1  # a live sequence moved between actors
    # The same summary as the local runtime (plus a 'ray' section).
    for key in ("mode", "steps", "wall_s", "train_tokens_per_s", "reward_first", "reward_last", "mean_staleness",
                "lost_prompts", "duplicated_prompts", "consumed_prompts", "failures", "slot_util", "timeline_png"):
        assert key in s, key
    assert s["reward_first"] is not None and 0.0 <= s["reward_last"] <= 1.0
    assert s["ray"]["requeued_samples"] >= fails[0]["requeued"]
    assert os.listdir(os.path.join(c.runtime.run_dir, "checkpoints"))
    assert not ray.is_initialized()  # the run started the local cluster, so it shut it down


def test_run_dispatches_kind_ray(monkeypatch):
    from laminar_jax import runtime
    from laminar_jax.runtime import ray_runtime

    c = demo()
    c.runtime.kind = "ray"
    monkeypatch.setattr(ray_runtime, "run_ray", lambda cfg: {"ran": cfg.runtime.kind})
    assert runtime.run(finalize(c)) == {"ran": "ray"}


def _traj(item, version=0):
    from laminar_jax.types import Trajectory

    return Trajectory(uid=item.uid, prompt_uid=item.prompt_uid, sample_index=item.sample_index,
                      prompt_ids=np.asarray(item.prompt_ids, np.int32), response_ids=np.asarray([5, 6, 7], np.int32),
                      behaviour_logprobs=np.zeros(3, np.float32), version=version, finish_reason="length")


def test_buffer_actor_ownership_requeue_and_admission():
    """The buffer service's logic as a plain object (no cluster): exactly-once under failures."""
    from laminar_jax.buffer.service import BufferService

    c = demo()
    b = BufferService(finalize(c), learner_version=0)
    try:
        _wait(lambda: b.stats()["queue"] >= 6, 30, "the dispatcher to queue work")
        a = b.take_work(0, "rollout-0", 0, 3)
        other = b.take_work(1, "rollout-1", 0, 2)
        assert len(a) == 3 and len(other) == 2
        assert b.stats()["owned"] == {"rollout-0": 3, "rollout-1": 2}

        # rollout-0 dies: its 3 samples go back to the front of the queue; it gets no more work and
        # its late results are dropped.
        assert b.server_failed(0, "rollout-0") == 3
        assert b.take_work(0, "rollout-0", 0, 4) == []
        assert b.complete("rollout-0", _traj(a[0])) is False
        again = b.take_work(1, "rollout-1", 0, 3)
        assert [x.uid for x in again] == [x.uid for x in a]

        # A replacement takes index 0; a repack move hands ownership over with the sequence.
        b.register(0, "rollout-0.1", 0)
        uid = again[0].uid
        assert b.move(uid, "rollout-1", "rollout-0.1")
        assert not b.move(uid, "rollout-1", "rollout-0.1")  # rollout-1 no longer owns it
        assert b.complete("rollout-1", _traj(again[0])) is False
        assert b.complete("rollout-0.1", _traj(again[0])) is True
        assert b.complete("rollout-0.1", _traj(again[0])) is False  # exactly once
        _wait(lambda: "reward" in b.store.row(uid) and "version" in b.store.row(uid), 10, "the reward of " + uid)

        # A failed move that reached neither server is generated again.
        uid2 = again[1].uid
        assert b.requeue_uid(uid2, "rollout-1") and b.take_work(0, "rollout-0.1", 0, 1)[0].uid == uid2

        # Admission is re-checked here: a server more than admit_lag versions behind the newest
        # gets no work (laminar); one within the lag still does.
        lag = c.scheduler.admit_lag
        b.set_learner_version(lag + 1)
        assert b.take_work(1, "rollout-1", 0, 4) == []
        assert len(b.take_work(1, "rollout-1", 1, 1)) == 1
        assert b.stats()["lost_prompts"] == 0
    finally:
        b.close()


def test_ray_run_warms_up_so_the_first_step_compiles_nothing(tmp_path):
    """As the local runtime: the learner (here in the driver) and every actor's engine compile before
    the RL clock; the first learner step and the generation around it compile nothing."""
    from laminar_jax.runtime.ray_runtime import RayRun
    from tests.compile_events import count_compiles

    c = demo()
    c.runtime.update(kind="ray", num_servers=1, total_steps=2, run_dir=str(tmp_path / "run"), progress=False)
    marks = {}
    with count_compiles() as compiles:
        run = RayRun(finalize(c), c.runtime.run_dir)
        warm_up = run._warm_up
        run._warm_up = lambda: (warm_up(), marks.update(warm=len(compiles)))
        run.on_step_hooks.append(lambda v: v == 1 and marks.update(
            step1=len(compiles), actors=[s["compiles"] for s in run.fleet.snapshots().values()]))
        s = run.run()
    assert s["steps"] == 2 and marks["warm"] > 0
    assert marks["step1"] == marks["warm"], f"the first step compiled {marks['step1'] - marks['warm']} programs"
    assert marks["actors"] == [0], marks
