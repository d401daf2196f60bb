"""CPU-time accounting (monitor/profile.py) on real threads: phases in the threads doing them, XLA
threads' CPU split over the device phases active at each tick, the rows summing to process CPU."""

import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.monitor import profile


def _python_busy(seconds: float) -> None:
    t = time.thread_time()
    x = 0
    while time.thread_time() - t < seconds:
        x += 1


def test_phase_is_a_noop_without_a_profiler():
    assert profile.active() is None
    with profile.phase("decode"):
        pass
    assert profile.active() is None


def test_only_one_profiler_at_a_time():
    p = profile.Profiler().start()
    try:
        with pytest.raises(RuntimeError, match="already active"):
            profile.Profiler().start()
    finally:
        p.stop()
    assert profile.active() is None


def _in_fresh_interpreter(case: str) -> None:
    """Run this module's function `case` in a fresh interpreter: the profiler accounts for every
    thread of the process, and a thread an earlier test left behind (a server or publisher still
    in a device phase) would take a share of XLA's CPU (seen once in a full-suite run)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"from tests.runtime.test_profile import {case}; {case}()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_rows_account_for_process_cpu_and_phases_for_their_threads():
    _in_fresh_interpreter("_rows_case")


def _rows_case():
    f = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((512, 512), np.float32))
    jax.block_until_ready(f(a))  # compiled before the window
    p = profile.Profiler(tick_s=0.01).start()
    try:
        def dispatcher():
            with profile.phase("dispatch"):
                _python_busy(0.3)

        t = threading.Thread(target=dispatcher, name="fake-dispatch-thread")
        t.start()
        with profile.phase("learner.host"):
            _python_busy(0.1)
            t_end = time.perf_counter() + 0.6
            while time.perf_counter() < t_end:
                with profile.phase("decode"):  # nested: charged exclusively
                    jax.block_until_ready(f(a))
        t.join()
    finally:
        p.stop()
    rep = p.report(trained_tokens=1000)
    phases = rep["phases"]
    assert phases["dispatch"]["cpu_s"] == pytest.approx(0.3, abs=0.05)
    assert phases["learner.host"]["cpu_s"] >= 0.09
    assert phases["decode"]["calls"] >= 1 and phases["learner.host"]["calls"] == 1
    rows = {r["row"]: r for r in rep["rows"]}
    # The dispatch phase runs Python only: its CPU is there, none of XLA's.
    assert rows["dispatch and buffer"]["python_s"] == pytest.approx(0.3, abs=0.05)
    assert rows["dispatch and buffer"]["xla_s"] == 0.0
    # Every row together is the process's CPU in the window (the residual row makes it exact).
    total = sum(r["cpu_s"] for r in rep["rows"])
    assert total == pytest.approx(rep["process_cpu_s"] + rep["children_cpu_s"], abs=0.02)
    assert rows["unaccounted (exited threads, clock ticks)"]["cpu_s"] == pytest.approx(0.0, abs=0.1)
    # XLA's threads ran the matmuls while decode was the only device phase active: no other phase
    # gets any of their CPU (what lands after the last call, e.g. pool threads spinning, is 'no phase').
    assert rows["decode and prefill"]["xla_s"] > 0
    assert all(r["xla_s"] == 0 for name, r in rows.items() if name not in ("decode and prefill", "xla: no phase active"))
    # Decode ran alone: the report gives its solo ticks and rate (what concurrent ticks are split by).
    assert rep["xla_solo"]["decode"]["ticks"] >= 1 and rep["xla_solo"]["decode"]["xla_ms_per_tick"] > 0
    assert rep["cpu_ms_per_1k_trained_tokens"] == pytest.approx(1e3 * (rep["process_cpu_s"] + rep["children_cpu_s"]),
                                                                rel=0.02, abs=2)
    assert 0.0 <= rep["gil_wait_s"] <= phases["dispatch"]["wall_s"]


def test_split_native_weights_concurrent_phases_by_their_solo_rates():
    """Pure logic: ticks where the learner ran alone show it loads XLA's threads 4x as much per
    instance as a decode step does alone, so a tick with both gives the learner 4/5 (2 decode
    instances: 4/6), not the equal split's 1/2 (1/3)."""
    ticks = {
        (("learner.train", 1),): (0.40, 10),  # 40 ms of XLA CPU per tick alone
        (("decode", 1),): (0.10, 10),  # 10 ms
        (("decode", 1), ("learner.train", 1)): (0.50, 10),
        (("decode", 2), ("learner.train", 1)): (0.60, 10),
        (): (0.07, 3),
    }
    out = profile.split_native(ticks)
    assert out["learner.train"] == pytest.approx(0.40 + 0.50 * 4 / 5 + 0.60 * 4 / 6)
    assert out["decode"] == pytest.approx(0.10 + 0.50 * 1 / 5 + 0.60 * 2 / 6)
    assert out["xla: no phase active"] == pytest.approx(0.07)
    assert sum(out.values()) == pytest.approx(sum(v for v, _ in ticks.values()))


def test_split_native_without_solo_ticks_falls_back_to_known_rates_then_equal_shares():
    # publish.host_copy never ran alone: it gets the mean of the known rates (here decode's).
    out = profile.split_native({(("decode", 1),): (0.2, 10), (("decode", 1), ("publish.host_copy", 1)): (0.2, 5)})
    assert out["publish.host_copy"] == pytest.approx(0.1) and out["decode"] == pytest.approx(0.3)
    # Nothing ever ran alone: equal shares per instance.
    out = profile.split_native({(("decode", 2), ("learner.train", 1)): (0.3, 4)})
    assert out["decode"] == pytest.approx(0.2) and out["learner.train"] == pytest.approx(0.1)
    # A phase alone with no XLA CPU at all keeps its zero rate; a tick of it with an unknown phase
    # still splits by instances rather than dividing by zero.
    out = profile.split_native({(("pull", 1),): (0.0, 5), (("pull", 1), ("decode", 1)): (0.4, 2)})
    assert out["pull"] == 0.0 and out["decode"] == pytest.approx(0.4)


def test_thread_names_and_the_xla_split_come_from_the_same_ticks(monkeypatch):
    """Pure logic on fake /proc clocks. A Python thread that has left threading's registry (the
    sampler, joined by stop()) keeps its Python name rather than becoming XLA's; a native thread
    that names itself after it started (tensorstore's) has its CPU split under the name of each
    tick; so the report's XLA total is exactly what the ticks split (CI failed on a 0.04 s gap)."""
    clocks = {}
    monkeypatch.setattr(profile, "_thread_clocks", lambda: dict(clocks))
    p = profile.Profiler()
    py_tid = 900001  # no real thread has it, so threading's registry never names it
    p._threads = {py_tid: ("thread:profile-sampler", 1.0), 900002: ("native:tf_XLAEigen", 5.0)}
    p._active = {"decode": 1}
    clocks.update({py_tid: ("python", 1.3), 900002: ("tf_XLAEigen", 5.2), 900003: ("python", 0.1)})
    p._tick()
    clocks.update({900002: ("tf_XLAEigen", 5.5), 900003: ("ts_pool_worker", 0.4)})
    p._tick()
    by = p.thread_cpu()
    assert by["thread:profile-sampler"] == pytest.approx(0.3)
    assert by["native:tf_XLAEigen"] == pytest.approx(0.5)
    assert by["native:python"] == pytest.approx(0.1) and by["native:ts_pool_worker"] == pytest.approx(0.3)
    (native, ticks), = p._ticks.values()
    assert ticks == 2 and native == pytest.approx(0.5 + 0.1)
    # A reused tid (its clock went back) is a new thread: all its CPU is in the window.
    clocks[900002] = ("tf_XLAEigen", 0.2)
    p._tick()
    assert p.thread_cpu()["native:tf_XLAEigen"] == pytest.approx(0.7)


def test_tensorstore_io_threads_are_charged_to_the_store_row_not_to_device_phases():
    _in_fresh_interpreter("_io_case")


def _io_case():
    """tensorstore's I/O threads (ts_pool_worker) are native but not XLA's: their CPU goes to the
    store-write row by name, not split onto the decode phase active while they write. (A separate
    case from _rows_case: tensorstore's short-lived threads leave a few tens of ms unaccounted.)"""
    import tempfile

    import tensorstore as ts

    f = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((512, 512), np.float32))
    jax.block_until_ready(f(a))
    big = np.random.default_rng(1).standard_normal((4 << 20,), np.float32)  # 16 MB
    with tempfile.TemporaryDirectory() as d:
        p = profile.Profiler(tick_s=0.01).start()
        try:
            def writer():
                for i in range(4):
                    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{d}/a{i}"}}
                    ts.open(spec, create=True, dtype=ts.float32, shape=big.shape).result().write(big).result()

            w = threading.Thread(target=writer, name="fake-store-thread")
            w.start()
            while w.is_alive():
                with profile.phase("decode"):
                    jax.block_until_ready(f(a))
            w.join()
            time.sleep(0.1)  # samples after the writes: the I/O threads' last CPU is seen
        finally:
            p.stop()
    rep = p.report(trained_tokens=1000)
    rows = {r["row"]: r for r in rep["rows"]}
    assert rep["io_threads_cpu_s"] > 0
    assert rows["publish (host copy, store write, relay)"]["io_s"] == pytest.approx(rep["io_threads_cpu_s"], abs=0.011)
    assert rows["publish (host copy, store write, relay)"]["xla_s"] == 0.0
    assert sum(r["xla_s"] for r in rows.values()) == pytest.approx(rep["xla_threads_cpu_s"], abs=0.05)
    assert rows["decode and prefill"]["io_s"] == 0.0 and rows["decode and prefill"]["xla_s"] > 0


def test_instrumented_learner_passes_wait_inside_their_phase():
    class FakeLearner:
        def __init__(self):
            self._prepare = jax.jit(lambda x: x * 2)
            self._train_step = jax.jit(lambda x: x + 1)
            self._updates = jax.jit(lambda x: x - 3)

    lr = FakeLearner()
    profile.instrument_learner(lr)
    p = profile.Profiler().start()
    try:
        assert int(lr._train_step(lr._updates(lr._prepare(jnp.int32(3))))) == 4
    finally:
        p.stop()
    ph = p.report(trained_tokens=1)["phases"]
    # A step's updates (one program, with the mini-batches' row gathers) and a whole-batch update
    # are both the learner's train phase.
    assert ph["learner.logprob"]["calls"] == 1 and ph["learner.train"]["calls"] == 2
    assert any("learner.train" in keys for row, keys in profile.ROWS if row.startswith("learner fwd/bwd"))


@pytest.mark.slow
def test_local_run_with_profile_accounts_for_its_cpu(tmp_path):
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.runtime.local import run_local

    c = repo_config("demo", "short")
    c.runtime.profile = True
    c.runtime.timeline = False
    c.runtime.run_dir = str(tmp_path / "run")
    s = run_local(finalize(c))
    p = s["profile"]
    assert profile.active() is None  # the run removed its profiler
    rows = {r["row"]: r for r in p["rows"]}
    assert rows["decode and prefill"]["cpu_s"] > 0 and rows["learner fwd/bwd + optimizer"]["cpu_s"] > 0
    # A step's mini-batch updates are one program (a scan over their rows): one train call a step.
    assert c.learner.mini_batches > 1 and p["phases"]["learner.train"]["calls"] == c.runtime.total_steps
    assert sum(r["cpu_s"] for r in p["rows"]) == pytest.approx(p["process_cpu_s"] + p["children_cpu_s"], abs=0.05)
    assert p["trained_tokens"] > 0 and p["cpu_ms_per_1k_trained_tokens"] > 0


def test_profile_needs_the_local_runtime():
    from laminar_jax.config import ConfigError, finalize, repo_config

    c = repo_config("demo", "short")
    c.runtime.kind, c.runtime.profile = "ray", True
    with pytest.raises(ConfigError, match="runtime.profile"):
        finalize(c)
