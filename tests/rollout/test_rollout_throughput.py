"""Throughput features must not change outputs: live-page attention buckets, multi-step decode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rollout.attention import (
    DecodeMeta,
    as_stored,
    from_pool,
    from_stored,
    gather_gqa,
    live_page_list,
    live_pages,
    pool_shape,
    scatter_tokens,
    to_pool,
)
from laminar_jax.rollout import programs as programs_mod
from laminar_jax.rollout import batch_admit
from laminar_jax.rollout.batch_admit import prefill_insert_rows
from laminar_jax.rollout.warmup import warmup
from tests.rollout.rollout_helpers import SECTION, layer_pools, make_server, request, run_until


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
    cache = (f(pool, hkv, d, page), f(pool, hkv, page, d))  # the pools' layouts (rollout.attention)
    live_count = int(sum(positions[i] // page + 1 for i in range(b) if active[i]))
    return q, k, v, cache, meta, live_count


def _compiled(attend, q, k, v, cache, meta):
    """attend(q, k, v, cache, meta=meta) as one jitted program, as the engine runs it (op-by-op
    dispatch of this file's calls took ~14 s)."""
    def run(q, k, v, cache, table, positions, active, live):
        return attend(q, k, v, cache, meta=meta._replace(page_table=table, positions=positions, active=active,
                                                          live=live))
    return jax.jit(run)(q, k, v, cache, meta.page_table, meta.positions, meta.active, meta.live)


def _live_list(meta, num_entries):
    """live_page_list(meta, num_entries), jitted like _compiled."""
    def run(table, positions, active):
        return live_page_list(meta._replace(page_table=table, positions=positions, active=active), num_entries)
    return jax.jit(run)(meta.page_table, meta.positions, meta.active)


def test_live_pages_is_bit_identical_for_every_bucket_and_matches_the_reference():
    q, k, v, cache, meta, live = _paged_batch()
    b, n = meta.page_table.shape
    outs = []
    for bucket in (live, live + 3, 32, b * n):
        m = meta._replace(live=_live_list(meta, bucket))
        assert int(m.live.count) == live
        out, (kp, _) = _compiled(live_pages, q, k, v, cache, m)
        outs.append(np.asarray(out))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # the bucket only adds exact zeros
    ref, (kr, _) = _compiled(gather_gqa, q, k, v, cache, meta)
    act = np.asarray(meta.active)
    np.testing.assert_allclose(outs[0][act], np.asarray(ref)[act], atol=2e-6)
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(kr))  # same token writes
    # A too-small bucket is detected (the engine reports it as StepOutput.overflow).
    assert int(_live_list(meta, live - 1).count) > live - 1


@pytest.mark.parametrize("key", [True, False])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
def test_pool_layout_round_trips_and_token_writes_land_where_the_page_layout_puts_them(key, kv_dtype):
    rng = np.random.default_rng(3)
    pages = rng.standard_normal((7, 4, 2, 8)).astype(np.float32)  # [P, page, Hkv, D]
    pool = as_stored(to_pool(jnp.asarray(pages, kv_dtype), key=key), kv_dtype)
    assert pool.shape == pool_shape(7, 4, 2, 8, key=key)
    np.testing.assert_array_equal(np.asarray(from_pool(from_stored(pool, kv_dtype), key=key), np.float32),
                                  np.asarray(jnp.asarray(pages, kv_dtype), np.float32))
    # Tokens written at (page, offset) read back at pages[page, offset] through the inverse layout.
    page, off = jnp.asarray([[3, 3], [5, 0]]), jnp.asarray([[0, 2], [3, 1]])
    new = jnp.asarray(rng.standard_normal((2, 2, 2, 8)), kv_dtype)  # [..., Hkv, D]
    back = np.asarray(from_pool(from_stored(scatter_tokens(pool, page, off, new, kv_dtype, key=key), kv_dtype),
                                key=key), np.float32)
    want = np.array(jnp.asarray(pages, kv_dtype), np.float32)  # a writable copy
    want[np.asarray(page), np.asarray(off)] = np.asarray(new, np.float32)
    np.testing.assert_array_equal(back, want)


def test_live_pages_output_does_not_depend_on_physical_pages_or_company():
    q, k, v, cache, meta, _ = _paged_batch(seed=1)
    base = np.asarray(_compiled(live_pages, q, k, v, cache, meta._replace(live=_live_list(meta, 64)))[0])
    # Move slot 0 to other physical pages (copy its KV), and kill every other slot.
    table = np.asarray(meta.page_table).copy()
    used = int(meta.positions[0]) // meta.page_size + 1
    new = np.arange(30, 30 + used)
    kc, vc = (np.asarray(c).copy() for c in cache)
    kc[new], vc[new] = kc[table[0, :used]], vc[table[0, :used]]
    table[0, :used] = new
    alone = meta._replace(page_table=jnp.asarray(table), active=jnp.asarray(np.arange(len(table)) == 0))
    out = _compiled(live_pages, q, k, v, (jnp.asarray(kc), jnp.asarray(vc)),
                    alone._replace(live=_live_list(alone, 16)))[0]
    np.testing.assert_array_equal(np.asarray(out)[0], base[0])


def _mixed_requests():
    return ([request(i, max_new=3 + 5 * i, prompt_len=2 + 2 * i, top_k=20 if i % 2 else 0) for i in range(6)]
            + [request(9, max_new=17, temperature=0.0)])


@pytest.fixture
def in_step_draws(monkeypatch):
    """Multi-step calls draw their Gumbel noise inside each step (as calls too large for
    programs.CALL_NOISE_BYTES do) instead of up front; programs compiled either way are dropped."""
    programs_mod.programs.cache_clear()
    monkeypatch.setattr(programs_mod, "CALL_NOISE_BYTES", 0)
    yield
    programs_mod.programs.cache_clear()


@pytest.mark.parametrize("steps", [2, 3])
def test_multi_step_decode_equals_single_step_token_for_token(steps):
    """k decode steps per call (a lax.scan): same tokens, log-probs and finish reasons as k = 1,
    including slots that finish in the middle of a call (max_new not a multiple of k, stop ids).
    The call draws its sampling noise before its first step (programs.call_noise)."""
    _check_multi_step_equals_single_step(steps, up_front=True)


def test_multi_step_decode_drawing_in_each_step_equals_single_step(in_step_draws):
    _check_multi_step_equals_single_step(3, up_front=False)


def _check_multi_step_equals_single_step(steps, up_front):
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
    assert (programs_mod.call_noise(multi.engine.spec, multi._state) is not None) == up_front  # the path under test


def test_engine_live_bucket_covers_the_live_pages_and_a_wrong_bound_is_caught():
    server = make_server(dataclasses.replace(SECTION, attention_impl="live_pages"))  # the backend with buckets
    engine = server.engine
    warmup(engine, server._params)  # compiles every variant; leaves no slot or page taken
    book = engine.page_book
    assert not book.slot_pages and book.allocator.num_used == 0
    for i in range(4):
        server.submit(request(i, max_new=20, prompt_len=9))
    for _ in range(5):
        server.step()
    state = jax.device_get(server._state)
    # The next call (k = 1) attends positions <= lengths: pages 0 .. lengths // page of each active slot.
    live = sum(int(state.lengths[s]) // engine.page_size + 1 for s in range(engine.num_slots) if state.active[s])
    reserved = sum(len(p) for p in book.slot_pages.values())
    bound = engine.schedule.live_pages_bound(book.cached_hi, book.slot_pages)
    assert live <= bound <= reserved and book.live_bucket() >= live
    # Simulate broken bookkeeping with exact-size buckets: the device must refuse silently wrong output.
    engine.schedule = book.schedule = dataclasses.replace(
        engine.schedule, live_buckets=tuple(range(1, engine.num_slots * engine.pages_per_seq + 1)))
    for slot in book.cached_hi:
        book.cached_hi[slot] = 0
    with pytest.raises(RuntimeError, match="live-page bucket"):
        for _ in range(3):
            server.step()


def test_compacted_decode_is_independent_of_company_and_num_slots():
    """Batch compaction (decode_chunk): a sequence decodes identically alone, in a full server
    (several chunks, different row positions) and in a server of another size."""
    reqs = _mixed_requests()
    alone = {}
    for r in reqs[:3]:
        solo = make_server(dataclasses.replace(SECTION, decode_chunk=2, num_slots=2))
        solo.submit(r)
        alone.update(run_until(solo, 1))
    full = make_server(dataclasses.replace(SECTION, decode_chunk=2))  # 4 slots: 1-2 chunks as sequences come and go
    for r in reqs:
        full.submit(r)
    got = run_until(full, len(reqs))
    for r in reqs[:3]:
        np.testing.assert_array_equal(got[r.uid].response_ids, alone[r.uid].response_ids)
        np.testing.assert_array_equal(got[r.uid].behaviour_logprobs, alone[r.uid].behaviour_logprobs)
    # Greedy agrees with the uncompacted engine token for token (log-probs to float tolerance:
    # other row counts may use other matmul kernels, which is exactly why chunks have one shape).
    ref_server = make_server()
    for r in reqs:
        ref_server.submit(r)
    ref = run_until(ref_server, len(reqs))
    g = reqs[-1].uid
    np.testing.assert_array_equal(got[g].response_ids, ref[g].response_ids)
    np.testing.assert_allclose(got[g].behaviour_logprobs, ref[g].behaviour_logprobs, atol=1e-5)
    assert full.stats().kv_pages_used == 0 and full.stats().completed == len(reqs)


def _assert_matches_default_server(server, reqs):
    """Run reqs on ``server`` and on a default one: same tokens and finish reasons (sampled ones too:
    the draws are per-slot keys), log-probs to float tolerance (other product shapes)."""
    ref_server = make_server()
    for r in reqs:
        ref_server.submit(r)
        server.submit(r)
    ref, got = run_until(ref_server, len(reqs)), run_until(server, len(reqs))
    for r in reqs:
        np.testing.assert_array_equal(got[r.uid].response_ids, ref[r.uid].response_ids)
        np.testing.assert_allclose(got[r.uid].behaviour_logprobs, ref[r.uid].behaviour_logprobs, atol=1e-5)
        assert got[r.uid].finish_reason == ref[r.uid].finish_reason
    assert server.stats().kv_pages_used == 0 and server.stats().completed == len(reqs)


def test_row_buckets_run_few_live_slots_as_a_smaller_batch_with_the_same_tokens():
    """decode_row_buckets: calls with few live slots run a smaller batch (its own program), with
    the full-batch engine's tokens."""
    server = make_server(dataclasses.replace(SECTION, decode_row_buckets=(1, 2)))
    engine = server.engine
    seen = []
    real_rows = engine.page_book.rows

    def rows_spy():
        rows, n = real_rows()
        seen.append(len(rows))
        return rows, n
    engine.page_book.rows = rows_spy
    _assert_matches_default_server(server, _mixed_requests())
    assert {1, 2, engine.num_slots} <= set(seen)  # the tail ran 1- and 2-row batches, the start all slots


def test_row_buckets_are_validated_and_refused_with_repack():
    from laminar_jax.config import ConfigError, default_config, finalize

    for bad in ((2, 1), (0,), (4,), (2, 2)):
        with pytest.raises(ValueError, match="rollout.decode_row_buckets"):
            dataclasses.replace(SECTION, decode_row_buckets=bad).validate()
    cd = default_config()
    cd.rollout.decode_row_buckets = (2,)
    with pytest.raises(ConfigError, match="scheduler.repack"):
        finalize(cd)
    cd.scheduler.repack = False
    assert finalize(cd).rollout.decode_row_buckets == (2,)


def test_prefill_insert_equals_prefill_then_insert():
    from laminar_jax.rollout import SlotInit

    one, two = make_server(), make_server()  # fresh engines: same page allocation
    params = one._params
    init = SlotInit(np.arange(2, dtype=np.uint32), 0.7, 5, 0.9, 9, np.array([3], np.int32))
    prompt = np.arange(3, 14, dtype=np.int32)
    a = one.engine.insert(one.engine.prefill(params, *one.engine.schedule.pad_prompt(prompt)),
                          one.engine.init_decode_state(), 1, init)
    b = two.engine.prefill_insert(params, two.engine.init_decode_state(), 1, prompt, init)
    assert one.engine.page_book.slot_pages == two.engine.page_book.slot_pages
    a, b = jax.device_get(a), jax.device_get(b)
    for f in a._fields:
        if f in ("k_pages", "v_pages"):  # one program vs two: XLA may fuse the KV math differently (float rounding)
            for x, y in zip(getattr(a, f), getattr(b, f)):
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_prefill_insert_rows_equals_one_prompt_at_a_time_and_rolls_back_on_out_of_pages():
    from laminar_jax.rollout import OutOfPages, SlotInit

    rows4 = dataclasses.replace(SECTION, prefill_rows=4)
    one, two = make_server(), make_server(rows4)
    params = one._params
    assert two.engine.schedule.packed_widths == (16, 32, 48, 64)
    inits = [SlotInit(np.arange(2, dtype=np.uint32) + i, 0.7, 5, 0.9, 9, np.array([3], np.int32)) for i in range(3)]
    # 10 + 2 + 14 tokens packed into a width of 32 (attended in two windows of 16), across pages of 8;
    # the rest is padding (null page)
    prompts = [np.arange(3, 14), np.arange(5, 8), np.arange(20, 35)]
    a = one.engine.init_decode_state()
    for slot, p, init in zip((1, 3, 0), prompts, inits):
        a = one.engine.prefill_insert(params, a, slot, p, init)
    b = prefill_insert_rows(two.engine, params, two.engine.init_decode_state(), [1, 3, 0], prompts, inits)
    one_book, two_book = one.engine.page_book, two.engine.page_book
    assert one_book.slot_pages == two_book.slot_pages and one_book.cached_hi == two_book.cached_hi
    a, b = jax.device_get(a), jax.device_get(b)
    for f in a._fields:
        if f in ("k_pages", "v_pages"):  # other product shapes: float rounding; page 0 is the null page
            layers = one.engine.model_cfg.num_layers
            for x, y in zip(layer_pools(getattr(a, f), layers), layer_pools(getattr(b, f), layers)):
                np.testing.assert_allclose(np.asarray(x)[1:], np.asarray(y)[1:], rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    # A pool too small for all of them: OutOfPages, and the allocator and slots are as before.
    eng = make_server(rows4).engine
    eng.page_book.allocator.allocate(eng.page_book.allocator.num_free - 20)  # 20 pages left: two of the four rows fit
    free = eng.page_book.allocator.num_free
    big = [SlotInit(np.zeros(2, np.uint32), 1.0, 0, 1.0, 48, np.zeros(0, np.int32))] * 4
    with pytest.raises(OutOfPages):
        prefill_insert_rows(eng, params, eng.init_decode_state(), [0, 1, 2, 3], [np.arange(3, 19)] * 4, big)
    assert eng.page_book.allocator.num_free == free and not eng.page_book.slot_pages and not eng.page_book.cached_hi
    with pytest.raises(ValueError, match="distinct and free"):
        prefill_insert_rows(eng, params, eng.init_decode_state(), [0, 0], prompts[:2], inits[:2])
    with pytest.raises(ValueError, match="rollout.prefill_rows=1 at most"):  # more prompts than one call takes
        solo = make_server().engine
        prefill_insert_rows(solo, params, solo.init_decode_state(), [1, 3], prompts[:2], inits[:2])


def test_server_prefilling_admissions_together_gives_the_same_tokens(monkeypatch):
    """rollout.prefill_rows: admissions of one step share prefill calls, with the tokens of
    one-prompt prefill."""
    server = make_server(dataclasses.replace(SECTION, prefill_rows=3))
    calls = []

    def spy(engine, params, state, slots, prompts, inits):
        calls.append(len(slots))
        return prefill_insert_rows(engine, params, state, slots, prompts, inits)
    monkeypatch.setattr(batch_admit, "prefill_insert_rows", spy)
    _assert_matches_default_server(server, _mixed_requests())
    assert calls and calls[0] == 3  # the first step admits 4 prompts: one call of 3, then one alone
    with pytest.raises(ValueError, match="rollout.prefill_rows"):
        dataclasses.replace(SECTION, prefill_rows=0).validate()


def test_seed_keys_equal_jax_random_key():
    from laminar_jax.rollout import Request
    from laminar_jax.rollout.admission import key_data

    server = make_server()
    for seed in (0, 1, 7, 2**31 - 1, 2**31, -3, 2**40 + 5):
        got = key_data(Request(uid="u", prompt_ids=[1], seed=seed), server.section.seed)
        np.testing.assert_array_equal(got, np.asarray(jax.random.key_data(jax.random.key(seed))))


def test_packed_prefill_attends_each_prompt_alone_in_windows():
    """prefill_packed: in windows of the longest prompt, each token attends exactly its own prompt's
    tokens up to itself, as if the prompt were alone (dense attention over that prompt)."""
    from laminar_jax.model.attention import gqa_attention
    from laminar_jax.rollout.attention import prefill_packed

    rng = np.random.default_rng(3)
    lens, window, n = [5, 16, 1, 9, 16, 3, 7], 16, 64  # 57 tokens, then padding (a prompt of its own)
    segments = np.repeat(np.arange(len(lens) + 1), lens + [n - sum(lens)]).astype(np.int32)
    q, k, v = (jnp.asarray(rng.normal(size=(1, n, h, 8)), jnp.float32) for h in (4, 2, 2))
    out, (k_out, v_out) = prefill_packed(q, k, v, None, segments=jnp.asarray(segments), window=window)
    assert out.shape == q.shape and k_out is k and v_out is v
    whole, _ = prefill_packed(q, k, v, None, segments=jnp.asarray(segments), window=n)  # one window: the full mask
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole), rtol=1e-6, atol=1e-6)
    at = 0
    for m in lens:
        span = slice(at, at + m)
        alone = gqa_attention(q[:, span], k[:, span], v[:, span], jnp.tril(jnp.ones((1, m, m), bool)))
        np.testing.assert_allclose(np.asarray(out[:, span]), np.asarray(alone), rtol=1e-5, atol=1e-6)
        at += m


def test_packed_widths_are_powers_of_two_then_multiples_of_the_longest_prompt():
    from laminar_jax.rollout.schedule import packed_widths as _packed_widths

    assert _packed_widths(16, 32, 8) == (16, 32, 64, 96, 128, 160, 192, 224, 256)
    assert _packed_widths(16, 16, 4) == (16, 32, 48, 64)
    assert _packed_widths(8, 64, 2) == (8, 16, 32, 64, 128)
    assert _packed_widths(16, 32, 1) == ()  # one prompt per call: no packed prefill
