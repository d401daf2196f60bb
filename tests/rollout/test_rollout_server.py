"""RolloutServer: continuous batching, back-pressure, page exhaustion, versions, the thread wrapper."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from laminar_jax.rollout import OverlongPromptError, QueueFullError, Request
from tests.rollout.rollout_helpers import SECTION, make_server, params_of, request, run_until


def test_continuous_batching_output_is_independent_of_batch_company():
    """10 requests of different lengths over 4 slots == each request alone (key schedule + paging)."""
    server = make_server()
    reqs = [request(i, max_new=3 + 2 * i, prompt_len=2 + i, top_k=20 if i % 2 else 0) for i in range(10)]
    for r in reqs:
        server.submit(r)
    together = run_until(server, len(reqs))
    assert server.idle() or server.step() == []
    for r in reqs[::3]:
        alone = make_server()
        alone.submit(r)
        t = run_until(alone, 1)[r.uid]
        np.testing.assert_array_equal(t.response_ids, together[r.uid].response_ids)
        np.testing.assert_allclose(t.behaviour_logprobs, together[r.uid].behaviour_logprobs, atol=1e-6)
    for r in reqs:
        t = together[r.uid]
        assert len(t.response_ids) == r.sampling.max_new_tokens and t.finish_reason == "length"
        assert t.version == 0 and t.prompt_ids.tolist() == list(r.prompt_ids)
    s = server.stats()
    assert s.completed == 10 and s.slots_used == 0 and s.kv_pages_used == 0


def test_stats_without_waiting_answer_the_last_figures_while_a_step_holds_the_lock():
    server = make_server()
    server.submit(request(0, max_new=6))
    server.step()
    now = server.stats()
    assert now.slots_used == 1 and now.queue_length == 0
    server.submit(request(1, max_new=6))
    with server._lock:  # as a step does through its generate call's device wait (another thread below)
        got = []
        t = threading.Thread(target=lambda: got.append((server.stats(wait=False), time.monotonic())))
        t0 = time.monotonic()
        t.start()
        t.join(5.0)
        assert got and got[0][1] - t0 < 1.0
        assert got[0][0] == now  # the figures last taken: the second request is not counted yet
    assert server.stats(wait=False).queue_length == 1  # the lock is free: the figures now


def test_stop_token_ends_the_sequence_and_is_kept():
    server = make_server()
    probe = request(0, max_new=20)
    server.submit(probe)
    first = run_until(server, 1)[probe.uid].response_ids
    stop = int(first[4])
    cut = next(i for i, x in enumerate(first) if x == stop)
    server.submit(dataclasses.replace(probe, uid="stop/0",
                                      sampling=dataclasses.replace(probe.sampling, stop_token_ids=(stop,))))
    t = run_until(server, 1)["stop/0"]
    assert t.finish_reason == "eos" and t.response_ids.tolist() == first[:cut + 1].tolist()


def test_pages_running_out_means_queueing_not_deadlock():
    # 12 usable pages; each request reserves ceil((5 + 30 - 1) / 8) = 5 -> at most 2 live of 4 slots.
    section = dataclasses.replace(SECTION, num_pages=13, max_total_len=48)
    server = make_server(section)
    for i in range(7):
        server.submit(request(i, max_new=30))
    saw_waiting = False
    out = {}
    for _ in range(1000):
        out.update({t.uid: t for t in server.step()})
        s = server.stats()
        assert s.kv_pages_used <= 12 and s.slots_used <= 2
        saw_waiting |= s.queue_length > 0 and s.slots_used == 2
        if len(out) == 7:
            break
    assert len(out) == 7 and saw_waiting
    assert all(len(t.response_ids) == 30 for t in out.values())


def test_a_request_that_can_never_fit_is_rejected_and_the_default_cap_shrinks():
    server = make_server(dataclasses.replace(SECTION, max_total_len=20, num_pages=8, max_new_tokens=1000))
    with pytest.raises(ValueError, match=r"max_new_tokens=1000.*max_total_len=20 \(at most 14"):
        server.submit(request(0, max_new=1000, prompt_len=6))
    # Without per-request sampling, rollout.max_new_tokens is a cap: it shrinks to what fits.
    server.submit(dataclasses.replace(request(0, prompt_len=6), sampling=None))
    t = run_until(server, 1)["p0/0"]
    assert len(t.response_ids) == 14 and t.finish_reason == "length"


def test_overlong_prompt_is_rejected_and_counted_or_truncated():
    server = make_server()
    long = Request(uid="long/0", prompt_ids=list(range(3, 23)))  # 20 > max_prompt_len=16
    with pytest.raises(OverlongPromptError, match=r"'long/0'.*20 tokens > rollout.max_prompt_len=16"):
        server.submit(long)
    assert server.stats().rejected_overlong == 1
    trunc = make_server(dataclasses.replace(SECTION, overlong_prompt="truncate"))
    trunc.submit(long)
    t = run_until(trunc, 1)["long/0"]
    assert t.prompt_ids.tolist() == list(range(7, 23)) and trunc.stats().truncated_overlong == 1


def test_bounded_queue_back_pressure():
    server = make_server(dataclasses.replace(SECTION, queue_capacity=2))
    server.submit(request(0))
    server.submit(request(1))
    t0 = time.monotonic()
    with pytest.raises(QueueFullError, match="queue_capacity=2"):
        server.submit(request(2), timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    run_until(server, 2)


def test_static_batching_waits_for_the_whole_batch():
    server = make_server(dataclasses.replace(SECTION, batching="static"))
    lengths = [2, 20, 3, 4, 5, 6]
    for i, n in enumerate(lengths):
        server.submit(request(i, max_new=n))
    first_batch_done = []
    for _ in range(200):
        done = server.step()
        first_batch_done += [t.uid for t in done]
        if "p1/0" in first_batch_done:
            break
        # while the 20-token request of the first batch runs, nothing new is admitted
        assert server.stats().slots_used <= 4 and server.stats().queue_length == 2
    run_until(server, 2)


def test_version_swap_waits_for_old_sequences_and_stamps_versions():
    server = make_server(version=3)
    old = [request(i, max_new=6 + 4 * i) for i in range(3)]
    for r in old:
        server.submit(r)
    out = {}
    for _ in range(3):
        out.update({t.uid: t for t in server.step()})
    new_params = params_of(1)
    server.set_params(4, new_params)
    new = [request(10 + i, max_new=5) for i in range(3)]
    for r in new:
        server.submit(r)
    assert server.stats().pending_version == 4
    while server.version == 3:
        out.update({t.uid: t for t in server.step()})
        s = server.stats()
        if s.version == 3:  # nothing admitted while the old version drains
            assert set(s.live_per_version) <= {3} and s.queue_length == 3 and s.pending_version == 4
        else:  # swapped and admitted in the same step
            assert s.live_per_version == {4: 3} and s.pending_version is None
    out.update(run_until(server, len(old) + len(new) - len(out)))
    assert {out[r.uid].version for r in old} == {3} and {out[r.uid].version for r in new} == {4}
    # The new-version trajectories were really generated by the new weights.
    ref = make_server(seed=1, version=4)
    ref.submit(new[0])
    np.testing.assert_array_equal(run_until(ref, 1)[new[0].uid].response_ids, out[new[0].uid].response_ids)
    with pytest.raises(ValueError, match="must be > current version 4"):
        server.set_params(4, new_params)


def test_forced_swap_aborts_live_sequences_without_mixing_versions():
    server = make_server()
    server.submit(request(0, max_new=40))
    for _ in range(4):
        assert server.step() == []
    server.set_params(1, params_of(1), force=True)
    aborted = server.step()
    assert [t.finish_reason for t in aborted] == ["aborted"] and aborted[0].version == 0
    assert 0 < len(aborted[0].response_ids) < 40 and server.version == 1 and server.stats().aborted == 1


def test_a_server_loop_in_a_supervised_worker_delivers_and_surfaces_its_death():
    """The server has no thread of its own: its owner steps it, here in the project's one
    supervised-thread primitive, which keeps the loop's failure for check()."""
    import queue
    import threading
    import time

    from laminar_jax.threads import Worker, WorkerFailed

    server, out, stop = make_server(), queue.Queue(), threading.Event()

    def loop():
        while not stop.is_set():
            for t in server.step():
                out.put(t)
            time.sleep(0.001)

    worker = Worker("rollout-test", loop, stop).start()
    try:
        for i in range(3):
            server.submit(request(i, max_new=4))
        got = {out.get(timeout=60).uid for _ in range(3)}
        assert got == {"p0/0", "p1/0", "p2/0"}
        # Weights of the wrong shape kill the loop on the next generate: check() must re-raise it.
        bad = jax.tree.map(lambda x: x[..., :1], params_of(0))
        server.set_params(1, bad)
        server.submit(request(5, max_new=4))
        assert worker.join(60)
        with pytest.raises(WorkerFailed, match="died"):
            worker.check()
    finally:
        stop.set()
        worker.join(10)

def test_attention_backends_agree():
    """live_pages, gather_dense, pool_scan and cpu_kernel against gather_gqa (the model's gqa_attention) on one mixed batch."""
    reqs = [request(i, max_new=4 + 3 * i, prompt_len=2 + 2 * i, temperature=0.0) for i in range(6)]
    out = {}
    for impl in ("gather_gqa", "live_pages", "gather_dense", "pool_scan", "cpu_kernel"):
        pages = {"page_size": 16} if impl == "cpu_kernel" else {}  # the kernel takes pages of 16s
        server = make_server(dataclasses.replace(SECTION, attention_impl=impl, **pages))
        for r in reqs:
            server.submit(r)
        out[impl] = run_until(server, len(reqs))
    for impl in ("live_pages", "gather_dense", "pool_scan", "cpu_kernel"):
        for r in reqs:
            a, b = out[impl][r.uid], out["gather_gqa"][r.uid]
            np.testing.assert_array_equal(a.response_ids, b.response_ids)
            np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)
