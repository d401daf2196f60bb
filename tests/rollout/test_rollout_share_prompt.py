"""rollout.share_prompt_kv: a prompt a live slot holds is admitted by copying its KV pages, not by
prefilling it again, with the tokens and log-probs of prefilling it."""

import dataclasses

import jax
import numpy as np
import pytest

from laminar_jax.rollout import OutOfPages, Request, SamplingParams, SlotInit
from laminar_jax.rollout.paged import pages_needed
from laminar_jax.rollout.batch_admit import share_prompt
from tests.rollout.rollout_helpers import SECTION, layer_pools, make_server, run_until

OFF = dataclasses.replace(SECTION, share_prompt_kv=False)


def _groups(n_prompts=3, group=4):
    """GRPO-shaped requests: ``group`` samples per prompt (own seeds), lengths that make slots free
    at different steps, so later samples of a group find an earlier one still live or gone."""
    out = []
    for p in range(n_prompts):
        prompt = [1] + list(range(3 + 7 * p, 3 + 7 * p + 9 + 3 * (p % 3)))  # 10, 13, 16 tokens: 2 pages at page_size 8
        for j in range(group):
            out.append(Request(uid=f"g{p}/{j}", prompt_ids=prompt, prompt_uid=f"g{p}", sample_index=j,
                               seed=100 * p + j, sampling=SamplingParams(
                                   temperature=1.0, max_new_tokens=3 + 4 * ((p + j) % 4), stop_token_ids=())))
    return out


def _run(server, reqs):
    for r in reqs:
        server.submit(r)
    return run_until(server, len(reqs))


@pytest.mark.parametrize("steps", [1, 3])
def test_shared_prompts_give_the_prefilled_tokens_bit_for_bit(steps):
    reqs = _groups()
    on = make_server(dataclasses.replace(SECTION, decode_steps_per_call=steps))
    off = make_server(dataclasses.replace(OFF, decode_steps_per_call=steps))
    got, ref = _run(on, reqs), _run(off, reqs)
    for r in reqs:
        np.testing.assert_array_equal(got[r.uid].response_ids, ref[r.uid].response_ids)
        np.testing.assert_array_equal(got[r.uid].behaviour_logprobs, ref[r.uid].behaviour_logprobs)
        assert got[r.uid].finish_reason == ref[r.uid].finish_reason
    st, st_off = on.stats(), off.stats()
    assert st_off.prompts_shared == 0 and st_off.prompts_prefilled == len(reqs)
    assert st.prompts_shared >= 6 and st.prompts_prefilled + st.prompts_shared == len(reqs)
    assert st.kv_pages_used == 0 and not on._holders  # every holder left with its slot


def test_a_prompt_whose_holders_left_is_prefilled_again():
    """No holder outlives its slot: finished, exported (moved) and retired sequences lend nothing."""
    server = make_server()
    prompt = list(range(1, 12))
    req = lambda uid, n: Request(uid=uid, prompt_ids=prompt, seed=len(uid) + n,  # noqa: E731
                                 sampling=SamplingParams(max_new_tokens=n, stop_token_ids=()))
    server.submit(req("a", 20))
    server.step()
    seq = server.export_sequence(next(iter(server.live_slots())))  # the only holder moves out
    assert not server._holders
    server.submit(req("b", 2))
    run_until(server, 1)
    assert (server.stats().prompts_prefilled, server.stats().prompts_shared) == (2, 0)
    server.submit(req("c", 2))
    run_until(server, 1)
    assert server.stats().prompts_prefilled == 3  # "b" had finished: nothing to copy from
    server.import_sequence(seq)  # an imported sequence lends nothing either (its KV came from elsewhere)
    server.submit(req("d", 2))
    out = run_until(server, 2)
    assert set(out) == {"a", "d"} and server.stats().prompts_prefilled == 4


def test_share_prompt_writes_the_prefill_state_and_checks_its_arguments():
    one, two = (make_server(dataclasses.replace(SECTION, num_slots=8)) for _ in range(2))
    params, eng = one._params, one.engine
    inits = [SlotInit(np.arange(2, dtype=np.uint32) + 5 * i, 0.7, 5, 0.9, 9, np.array([3], np.int32)) for i in range(4)]
    long, short = np.arange(3, 14, dtype=np.int32), np.arange(20, 25, dtype=np.int32)  # KV in 2 pages and 1
    a = eng.prefill_insert(params, eng.init_decode_state(), 0, long, inits[0])
    a = eng.prefill_insert(params, a, 1, short, inits[1])
    a = share_prompt(eng, a, [0, 1, 0], [3, 2, 5], [long, short, long], inits[2:] + inits[:1])  # padded to 4 rows
    b = two.engine.init_decode_state()
    for slot, prompt, init in zip((0, 1, 3, 2, 5), (long, short, long, short, long), inits + inits[:1]):
        b = two.engine.prefill_insert(params, b, slot, prompt, init)
    book, two_book = eng.page_book, two.engine.page_book
    assert book.slot_pages == two_book.slot_pages and book.cached_hi == two_book.cached_hi
    a, b = jax.device_get(a), jax.device_get(b)
    for f in a._fields:
        if f not in ("k_pages", "v_pages"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
            continue
        for slot, n in ((3, len(long)), (2, len(short)), (5, len(long))):  # the prompt's positions; the rest is unwritten
            pages = book.slot_pages[slot][:pages_needed(n - 1, eng.page_size)]
            layers = eng.model_cfg.num_layers
            for x, y in zip(layer_pools(getattr(a, f), layers), layer_pools(getattr(b, f), layers)):
                x, y = (np.asarray(z)[pages].reshape(-1, *z.shape[2:])[:n - 1] for z in (x, y))
                np.testing.assert_array_equal(x, y)
    state = eng.init_decode_state()
    with pytest.raises(ValueError, match="distinct and free"):
        share_prompt(eng, state, [2], [0], [long], inits[:1])
    with pytest.raises(ValueError, match="source slot 4 holds no sequence"):
        share_prompt(eng, state, [4], [6], [long], inits[:1])
    book.allocator.allocate(book.allocator.num_free - 3)  # room for one sequence, not two: nothing changes
    with pytest.raises(OutOfPages):
        share_prompt(eng, state, [0, 0], [6, 7], [long, long], inits[:2])
    assert 6 not in book.slot_pages and 7 not in book.slot_pages and book.allocator.num_free == 3


def test_episodes_neither_share_nor_lend():
    from laminar_jax.rollout.records import TurnSpec

    server = make_server()
    prompt = list(range(1, 12))
    for i in range(3):
        server.submit(Request(uid=f"e{i}", prompt_ids=prompt, seed=i, turn=TurnSpec(max_new_tokens=4),
                              sampling=SamplingParams(max_new_tokens=8, stop_token_ids=())))
    server.step()
    assert server.stats().prompts_prefilled == 3 and not server._holders


def test_the_switch_is_a_config_key():
    from laminar_jax.config import Config

    assert SECTION.share_prompt_kv and not OFF.share_prompt_kv
    assert "share_prompt_kv" in {f.name for f in dataclasses.fields(Config().rollout)}


def test_warmup_compiles_every_share_batch_the_server_meets():
    from tests.compile_events import count_compiles

    server = make_server(dataclasses.replace(SECTION, num_slots=8, num_pages=80))
    server.warmup()
    with count_compiles() as compiles:
        out = _run(server, _groups(n_prompts=4, group=8))  # 7 and fewer copies per admission pass
    assert len(out) == 32 and server.stats().prompts_shared >= 20
    assert not compiles, f"{len(compiles)} programs compiled after warmup"
