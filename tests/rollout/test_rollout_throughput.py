"""Throughput features must not change outputs: live-page attention buckets, multi-step decode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rollout.attention import (
    DecodeMeta,
    gather_gqa,
    live_page_list,
    live_pages,
)
from tests.rollout.rollout_helpers import SECTION, make_server, request, run_until


def _paged_batch(seed=0, b=5, n=6, page=4, pool=40, hkv=2, g=2, d=8):
    """Random pool, page tables (distinct pages per slot) and positions; one inactive slot."""
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, n * page, size=b).astype(np.int32)
    table = np.zeros((b, n), np.int32)
    free = list(rng.permutation(np.arange(1, pool)))
    for i in range(b):
        used = positions[i] // page + 1
        table[i, :used] = [free.pop() for _ in range(used)]
    active = np.ones(b, bool)
    active[2] = False
    meta = DecodeMeta(jnp.asarray(table), jnp.asarray(positions), jnp.asarray(active), page)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v = f(b, 1, hkv * g, d), f(b, 1, hkv, d), f(b, 1, hkv, d)
    cache = (f(pool, page, hkv, d), f(pool, page, hkv, d))
    live_count = int(sum(positions[i] // page + 1 for i in range(b) if active[i]))
    return q, k, v, cache, meta, live_count


def test_live_pages_is_bit_identical_for_every_bucket_and_matches_the_reference():
    q, k, v, cache, meta, live = _paged_batch()
    b, n = meta.page_table.shape
    outs = []
    for bucket in (live, live + 3, 32, b * n):
        m = meta._replace(live=live_page_list(meta, bucket))
        assert int(m.live.count) == live
        out, (kp, _) = live_pages(q, k, v, cache, meta=m)
        outs.append(np.asarray(out))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # the bucket only adds exact zeros
    ref, (kr, _) = gather_gqa(q, k, v, cache, meta=meta)
    act = np.asarray(meta.active)
    np.testing.assert_allclose(outs[0][act], np.asarray(ref)[act], atol=2e-6)
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(kr))  # same token writes
    # A too-small bucket is detected (the engine reports it as StepOutput.overflow).
    assert int(live_page_list(meta, live - 1).count) > live - 1


def test_live_pages_output_does_not_depend_on_physical_pages_or_company():
    q, k, v, cache, meta, _ = _paged_batch(seed=1)
    base = np.asarray(live_pages(q, k, v, cache, meta=meta._replace(live=live_page_list(meta, 64)))[0])
    # Move slot 0 to other physical pages (copy its KV), and kill every other slot.
    table = np.asarray(meta.page_table).copy()
    used = int(meta.positions[0]) // meta.page_size + 1
    new = np.arange(30, 30 + used)
    kc, vc = (np.asarray(c).copy() for c in cache)
    kc[new], vc[new] = kc[table[0, :used]], vc[table[0, :used]]
    table[0, :used] = new
    alone = meta._replace(page_table=jnp.asarray(table), active=jnp.asarray(np.arange(len(table)) == 0))
    out = live_pages(q, k, v, (jnp.asarray(kc), jnp.asarray(vc)), meta=alone._replace(live=live_page_list(alone, 16)))[0]
    np.testing.assert_array_equal(np.asarray(out)[0], base[0])


def _mixed_requests():
    return ([request(i, max_new=3 + 5 * i, prompt_len=2 + 2 * i, top_k=20 if i % 2 else 0) for i in range(6)]
            + [request(9, max_new=17, temperature=0.0)])


@pytest.mark.parametrize("steps", [2, 3])
def test_multi_step_decode_equals_single_step_token_for_token(steps):
    """k decode steps per call (a lax.scan): same tokens, log-probs and finish reasons as k = 1,
    including slots that finish in the middle of a call (max_new not a multiple of k, stop ids)."""
    reqs = _mixed_requests()
    one = make_server()
    for r in reqs:
        one.submit(r)
    ref = run_until(one, len(reqs))
    stop = int(ref[reqs[3].uid].response_ids[6])
    reqs.append(dataclasses.replace(reqs[3], uid="stop/0",
                                    sampling=dataclasses.replace(reqs[3].sampling, stop_token_ids=(stop,))))
    one.submit(reqs[-1])
    ref.update(run_until(one, 1))
    multi = make_server(dataclasses.replace(SECTION, decode_steps_per_call=steps))
    for r in reqs:
        multi.submit(r)
    got = run_until(multi, len(reqs))
    assert got["stop/0"].finish_reason == "eos"
    for r in reqs:
        np.testing.assert_array_equal(got[r.uid].response_ids, ref[r.uid].response_ids)
        np.testing.assert_array_equal(got[r.uid].behaviour_logprobs, ref[r.uid].behaviour_logprobs)
        assert got[r.uid].finish_reason == ref[r.uid].finish_reason
    s = multi.stats()
    assert s.slots_used == 0 and s.kv_pages_used == 0 and s.completed == len(reqs)


def test_engine_live_bucket_covers_the_live_pages_and_a_wrong_bound_is_caught():
    server = make_server()
    engine = server.engine
    engine.warmup(server._params)  # compiles every variant; leaves no slot or page taken
    assert not engine.slot_pages and engine.allocator.num_used == 0
    for i in range(4):
        server.submit(request(i, max_new=20, prompt_len=9))
    for _ in range(5):
        server.step()
    state = jax.device_get(server._state)
    # The next call (k = 1) attends positions <= lengths: pages 0 .. lengths // page of each active slot.
    live = sum(int(state.lengths[s]) // engine.page_size + 1 for s in range(engine.num_slots) if state.active[s])
    reserved = sum(len(p) for p in engine.slot_pages.values())
    assert live <= engine.live_pages_bound() <= reserved and engine.live_bucket() >= live
    # Simulate broken bookkeeping with exact-size buckets: the device must refuse silently wrong output.
    engine.live_buckets = tuple(range(1, engine.num_slots * engine.pages_per_seq + 1))
    for slot in engine._cached_hi:
        engine._cached_hi[slot] = 0
    with pytest.raises(RuntimeError, match="live-page bucket"):
        for _ in range(3):
            server.step()
