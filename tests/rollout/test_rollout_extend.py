"""extend(): a parked sequence continues over its cached context exactly as a fresh prefill of the
whole context would (greedy tokens equal, log-probs within 1e-5), for every attention backend."""

import jax
import numpy as np
import pytest

from laminar_jax.rollout import RolloutSection, kernels_gpu, make_engine
from laminar_jax.rollout.paged import SlotInit
from laminar_jax.rollout import extend as ext
from tests.rollout.rollout_helpers import tiny_model

PROMPT = [1, 17, 33, 4, 60, 61, 62, 63, 64, 70]
OBS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # crosses a page boundary (page_size 8)


def _section(backend: str, chunk: int) -> RolloutSection:
    return RolloutSection(num_slots=3, page_size=16 if backend == "cpu_kernel" else 8, num_pages=40, max_prompt_len=48, max_total_len=64,
                          max_new_tokens=8, prefill_buckets=(16, 48), temperature=0.0, attention_impl=backend,
                          decode_chunk=chunk)


def _init(engine, max_new: int) -> SlotInit:
    key = np.asarray(jax.random.key_data(jax.random.key(0)), np.uint32)
    return SlotInit(key, 0.0, 0, 1.0, max_new, np.zeros(0, np.int32))


def _decode(engine, params, state, slot: int, n: int):
    toks, lps = [], []
    while len(toks) < n:
        state, out = engine.generate(params, state)
        out = jax.device_get(out)
        for k in range(out.tokens.shape[0]):
            if out.emitted[k, slot] and len(toks) < n:
                toks.append(int(out.tokens[k, slot]))
                lps.append(float(out.logprobs[k, slot]))
    return state, toks, np.asarray(lps)


# The reference prefills turn 1's tokens in one dense pass where the engine decoded them one at a
# time: their KV differ by float rounding. live_pages stays within 1e-5; gather_dense's and the
# native kernel's different reduction orders within the parity tests' 1e-4.
@pytest.mark.parametrize("backend,chunk,atol", [("live_pages", 0, 1e-5), ("live_pages", 2, 1e-5),
                                                ("gather_dense", 0, 1e-4), ("cpu_kernel", 0, 1e-4),
                                                pytest.param("pallas_gpu_paged", 0, 1e-4, marks=pytest.mark.slow)])
def test_extend_equals_fresh_prefill_of_the_whole_context(backend, chunk, atol):
    # The GPU Pallas kernel in interpret mode, over the head-major pools the engine allocates for it.
    extra = {backend: kernels_gpu.make_decode(interpret=True)} if backend == "pallas_gpu_paged" else None
    engine, params = make_engine(tiny_model(0), _section(backend, chunk), attention_backends=extra)
    state = engine.init_decode_state()
    # A busy neighbour in slot 0, so the extended slot shares decode calls with another sequence.
    state = engine.prefill_insert(params, state, 0, [1, 2, 3, 4], _init(engine, 30))
    state = engine.prefill_insert(params, state, 1, PROMPT, _init(engine, 6))
    state, turn1, _ = _decode(engine, params, state, 1, 6)  # slot 1 finishes its turn at max_new
    ext.park(engine, 1)
    num_cached = len(PROMPT) - 1 + len(turn1)  # prompt[:-1] by prefill, then one fed per sampled token but the last
    state = ext.extend(engine, params, state, 1, OBS, num_cached, turn1[-1], len(turn1), max_new=6)
    state, turn2, lp2 = _decode(engine, params, state, 1, 6)

    fresh, params2 = make_engine(tiny_model(0), _section(backend, chunk), attention_backends=extra)
    s2 = fresh.prefill_insert(params2, fresh.init_decode_state(), 2, PROMPT + turn1 + OBS, _init(fresh, 6))
    _, ref, ref_lp = _decode(fresh, params2, s2, 2, 6)
    assert turn2 == ref
    np.testing.assert_allclose(lp2, ref_lp, atol=atol)


def test_extend_refuses_past_the_sequence_limit_and_unknown_slots():
    engine, params = make_engine(tiny_model(0), _section("live_pages", 0))
    state = engine.prefill_insert(params, engine.init_decode_state(), 0, PROMPT, _init(engine, 2))
    state, _, _ = _decode(engine, params, state, 0, 2)
    ext.park(engine, 0)
    with pytest.raises(ValueError, match="more than rollout.pages_per_seq"):
        ext.extend(engine, params, state, 0, list(range(3, 60)), len(PROMPT), 5, 2, max_new=8)
    with pytest.raises(ValueError, match="slot 1 holds no sequence"):
        ext.extend(engine, params, state, 1, OBS, 3, 5, 2, max_new=2)
