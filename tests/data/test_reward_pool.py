"""RewardPool: real worker processes; failures score 0.0, are counted, and the pool recovers."""

import os
import signal
import time

import pytest

from laminar_jax.data import RewardPool

HERE = os.path.dirname(os.path.abspath(__file__))
PROBES = "data_reward_probes:registry"


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(num_workers=2, timeout_s=1.5, registry_spec=PROBES, pythonpath=[HERE])
    yield p
    p.close()


def _wait_for(cond, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def test_scores_many_concurrently(pool):
    futs = [pool.submit("echo", str(i / 100), None) for i in range(60)]
    futs.append(pool.submit("synthetic_skew", "ab1ab0", "ab1ab0"))
    futs.append(pool.submit("openai/gsm8k", "so \\boxed{12}", "12"))
    results = [f.result(timeout=60) for f in futs]
    assert [r.reward for r in results[:60]] == [i / 100 for i in range(60)]
    assert results[60].reward == 1.0 and results[61].reward == 1.0
    assert all(r.ok and r.error is None and r.latency_s >= 0 for r in results)


def test_a_fresh_workers_first_math_reward_is_warm():
    # math_verify's import costs ~0.8 s (more on a loaded host): the worker pays it before it
    # reports ready, so even the first reward fits a deadline far below that cost.
    with RewardPool(num_workers=1, timeout_s=0.3, registry_spec=PROBES, pythonpath=[HERE]) as p:
        r = p.score("openai/gsm8k", "so \\boxed{12}", "12")
        assert (r.reward, r.ok, r.error) == (1.0, True, None)


def test_exception_and_nan_score_zero_and_are_counted(pool):
    before = pool.stats()
    r = pool.score("raise", "x", None)
    assert (r.reward, r.ok) == (0.0, False) and "scorer exploded" in r.error
    r = pool.score("nan", "x", None)
    assert (r.reward, r.ok) == (0.0, False) and "not finite" in r.error
    r = pool.score("no_such_source_with_a_bad_math_answer", "x", "1")  # default math scorer: wrong -> 0
    assert r.ok and r.reward == 0.0
    after = pool.stats()
    assert after["errors"] - before["errors"] == 2 and after["restarts"] == before["restarts"]
    assert pool.score("echo", "0.75", None).reward == 0.75


def test_timeout_scores_zero_replaces_the_worker_and_pool_keeps_scoring(pool):
    before = pool.stats()
    pids = set(pool.worker_pids())
    hung = pool.submit("hang", "x", None, {"sleep_s": 3600})
    quick = [pool.submit("echo", "0.5", None) for _ in range(10)]  # the other worker keeps going
    r = hung.result(timeout=30)
    assert (r.reward, r.ok) == (0.0, False) and "timed out" in r.error and r.latency_s >= 1.5
    assert all(f.result(timeout=30).reward == 0.5 for f in quick)
    after = pool.stats()
    assert after["timeouts"] - before["timeouts"] == 1 and after["restarts"] - before["restarts"] == 1
    assert len(set(pool.worker_pids()) - pids) == 1
    assert [pool.score("echo", "0.25", None).reward for _ in range(4)] == [0.25] * 4


def test_crash_mid_call_and_killed_idle_worker_are_replaced(pool):
    before = pool.stats()
    r = pool.score("crash", "x", None)
    assert (r.reward, r.ok) == (0.0, False) and "exited" in r.error
    victim = pool.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)  # an idle worker killed from outside
    _wait_for(lambda: victim not in pool.worker_pids(), f"worker {victim} to be replaced")
    results = [pool.submit("pid", "x", None) for _ in range(8)]
    used = {int(f.result(timeout=30).reward) for f in results}
    assert victim not in used and used <= set(pool.worker_pids())
    after = pool.stats()
    assert after["crashes"] - before["crashes"] == 1 and after["restarts"] - before["restarts"] == 2


def test_unserialisable_request_is_counted_not_raised(pool):
    r = pool.submit("echo", "1", object()).result(timeout=5)
    assert (r.reward, r.ok) == (0.0, False) and "JSON" in r.error
    assert pool.stats()["bad_requests"] >= 1


def test_bad_registry_is_reported_by_check():
    p = RewardPool(num_workers=1, timeout_s=1.0, registry_spec="data_reward_probes:missing", pythonpath=[HERE])
    try:
        fut = p.submit("echo", "1", None)
        r = fut.result(timeout=30)
        assert not r.ok and "cannot load reward registry" in r.error
        with pytest.raises(RuntimeError, match="data_reward_probes:missing"):
            p.submit("echo", "1", None)
    finally:
        p.close()


def test_thread_mode_times_out_and_runs_math_verify():
    with RewardPool(num_workers=2, timeout_s=1.0, registry_spec=PROBES, mode="thread") as p:
        assert p.score("math", "$\\boxed{2}$", "2").reward == 1.0  # no signal error off the main thread
        r = p.score("hang", "x", None, {"sleep_s": 2.5})
        assert not r.ok and "timed out" in r.error
        assert p.score("echo", "0.5", None).reward == 0.5
        s = p.stats()
        assert s["timeouts"] == 1 and s["ok"] == 2


def test_close_resolves_pending_and_refuses_new_work():
    p = RewardPool(num_workers=1, timeout_s=30, registry_spec=PROBES, pythonpath=[HERE])
    hung = p.submit("hang", "x", None, {"sleep_s": 60})
    queued = p.submit("echo", "1", None)
    p.close(wait_s=0.2)
    assert not hung.result(timeout=5).ok and queued.result(timeout=5).error == "reward pool closed"
    with pytest.raises(RuntimeError):
        p.submit("echo", "1", None)


def test_rewards_outside_float32_range_are_counted_failures(pool):
    import json
    import math

    before = pool.failures
    for text in ("1e300", "-1e39", "inf"):
        r = pool.score("huge", text, None)
        assert (r.reward, r.ok) == (0.0, False) and "float32" in r.error, r
        json.dumps({"reward": r.reward}, allow_nan=False)  # a summary stays valid JSON
    assert pool.failures - before == 3
    r = pool.score("huge", "3e38", None)  # the float32 maximum is still a reward
    assert r.ok and math.isclose(r.reward, 3e38)


_POOL_OWNER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from laminar_jax.data import RewardPool
pool = RewardPool(num_workers=2, timeout_s=600, registry_spec="data_reward_probes:registry", pythonpath=[sys.argv[1]])
deadline = time.monotonic() + 60
while not all(w.ready for w in pool._workers) and time.monotonic() < deadline:
    time.sleep(0.05)
pool.submit("gil_hog", "x", None)  # one worker stuck in C code holding its GIL
time.sleep(0.5)
print(" ".join(str(p) for p in pool.worker_pids()), flush=True)
time.sleep(600)
"""


def test_workers_die_with_a_killed_parent_even_while_a_scorer_holds_the_gil():
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    owner = subprocess.Popen([sys.executable, "-c", _POOL_OWNER, HERE], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        owner.kill()
        owner.wait(10)
    _wait_for(lambda: not any(_alive(p) for p in pids), "reward workers to exit after their parent's SIGKILL",
              timeout_s=5.0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_dead_dispatcher_fails_pending_rewards_and_check_carries_its_traceback():
    from laminar_jax.threads import WorkerFailed

    with RewardPool(num_workers=1, timeout_s=1.0, registry_spec=PROBES, mode="thread") as p:
        healthy_tick = p._tick

        def broken_tick(now):
            # Break only once a task is queued: the dispatcher also ticks on its own wait timeout,
            # and breaking before submit() would make submit() raise instead of resolving the task.
            if p._pending:
                raise RuntimeError("dispatcher broke")
            return healthy_tick(now)

        p._tick = broken_tick
        fut = p.submit("ok", "x", None)
        with p._cond:
            p._cond.notify_all()
        res = fut.result(timeout=10)  # resolved, never left waiting
        assert not res.ok and "dispatcher died" in res.error
        assert p._thread.join(10)  # the dispatcher's thread ended with the failure
        with pytest.raises(WorkerFailed, match="(?s)reward-pool.*dispatcher broke.*broken_tick"):
            p.check()
