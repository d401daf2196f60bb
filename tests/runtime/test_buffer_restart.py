"""A replacement buffer service started from a checkpoint's snapshot plus the prompts trained since
(what the Ray runtime does when the buffer actor dies): every prompt is trained once, none lost,
none twice, including samples the dead buffer had handed out and prompts drawn after the snapshot."""

import time

import pytest

from laminar_jax.config import finalize, repo_config
from laminar_jax.buffer.service import BufferService, mark_trained
from tests.runtime.test_ray_runtime import _traj, _wait


def _cfg(inflight):
    c = repo_config("demo", "short")
    c.runtime.max_inflight_batches = inflight
    return finalize(c)


def _generate(b, name="rollout-0", version=0, limit=None):
    """Take what work there is and finish it (all of it, or the first `limit` samples); returns the
    items taken and not finished."""
    items = b.take_work(0, name, version, 64)
    done = items if limit is None else items[:limit]
    for it in done:
        assert b.complete(name, _traj(it, version))
    return items[len(done):]


def _train(b, version):
    """Generate until one batch is ready, take it (as the learner), publish the next version."""
    cfg = b.cfg
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"no batch; buffer: {b.stats()}"
        _generate(b, version=version)
        out = b.get_batch(cfg.runtime.prompts_per_step, version, 0.2)
        if out is not None:
            break
    assert out["duplicates"] == 0
    b.set_learner_version(version + 1)
    return sorted({r["prompt_uid"] for r in out["rows"]})


def _source_order(cfg, n):
    from laminar_jax.data import build_prompt_source
    from laminar_jax.model import load_tokenizer

    src = build_prompt_source(cfg.data, load_tokenizer(cfg.model.tokenizer))
    return [next(src).uid for _ in range(n)]


@pytest.mark.parametrize("checkpoint", ["at_start", "after_a_step"])
def test_replacement_buffer_trains_every_prompt_once(checkpoint):
    """at_start: one batch in flight at most, so prompts trained after the checkpoint were drawn from
    the source after it too (the replacement's source must skip them)."""
    cfg = _cfg(1 if checkpoint == "at_start" else 3)
    a = BufferService(cfg, learner_version=0)
    try:
        _wait(lambda: a.stats()["queue"] > 0, 30, "the dispatcher to queue work")
        snap = a.snapshot() if checkpoint == "at_start" else None
        first = _train(a, 0)
        snap = snap or a.snapshot()  # the checkpoint
        since = _train(a, 1) + (first if checkpoint == "at_start" else [])  # trained after the checkpoint
        _wait(lambda: a.stats()["queue"] > 0, 30, "more work")
        in_flight = _generate(a, version=2, limit=3)  # handed out, some finished, then the buffer dies
        assert in_flight
    finally:
        a.close()
    b = BufferService(cfg, learner_version=2, restore=snap, trained=since)
    try:
        later = []
        for v in range(2, 6):
            later += _train(b, v)
        st = b.stats()
    finally:
        b.close()
    trained = ([] if checkpoint == "at_start" else first) + since + later
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    # Nothing lost: what was trained is a prefix of the source (FIFO), so every prompt the dead
    # buffer had dispatched but not seen trained was generated again and trained.
    assert sorted(trained) == sorted(_source_order(cfg, len(trained)))
    assert {it.prompt_uid for it in in_flight} <= set(trained)
    assert st["ledger"]["duplicated"] == 0 and st["lost_prompts"] == 0
    if checkpoint == "at_start":
        assert st["trained_skipped"] >= 1  # drawn after the snapshot and trained: skipped, not redone


def test_mark_trained_is_pure_and_counts_each_prompt_once():
    state = {"source": {}, "store": {}, "dispatched": 2, "ledger": {
        "entries": {"p/0@0": {"prompt": {"uid": "p/0@0"}, "state": "dispatched", "dispatches": 1},
                    "p/1@0": {"prompt": {"uid": "p/1@0"}, "state": "consumed", "dispatches": 1}},
        "counters": {"dispatched": 2, "consumed": 1}}}
    out = mark_trained(state, ["p/0@0", "p/1@0", "p/2@0"])
    assert state["ledger"]["entries"]["p/0@0"]["state"] == "dispatched"  # input untouched
    assert {u: e["state"] for u, e in out["ledger"]["entries"].items()} == {
        "p/0@0": "consumed", "p/1@0": "consumed", "p/2@0": "consumed"}
    assert out["ledger"]["counters"] == {"dispatched": 3, "consumed": 3}
