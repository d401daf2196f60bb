"""extend() gives the next turn every KV page it writes: with num_cached + m + max_new one past a
page boundary, the turn's last sampled token is conditioned on its own page (not the null page),
so its log-prob matches the whole context prefilled fresh."""

import numpy as np

from laminar_jax.rollout import RolloutSection, RolloutServer, make_engine
from laminar_jax.rollout.records import Request, TurnSpec
from laminar_jax.rollout.sampling import SamplingParams
from tests.rollout.rollout_helpers import tiny_model

SECTION = RolloutSection(num_slots=2, page_size=8, num_pages=40, max_prompt_len=32, max_total_len=64,
                         max_new_tokens=8, prefill_buckets=(16, 32), temperature=0.0, stop_token_ids=())


def _greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=())


def _until(server, what, max_steps=300):
    for _ in range(max_steps):
        out = server.step()
        got = what(server, out)
        if got:
            return got
    raise AssertionError("timed out")


def test_turn_ending_one_past_a_page_boundary_reads_its_own_kv():
    prompt, obs = [1, 32, 40, 43], [50, 51, 52]
    s = RolloutServer(*make_engine(tiny_model(0), SECTION), 0)
    s.submit(Request(uid="e/0", prompt_ids=prompt, seed=2, sampling=_greedy(5), turn=TurnSpec(max_new_tokens=6)))
    (t1,) = _until(s, lambda srv, out: srv.take_turns())
    num_cached = len(prompt) + 5 - 1
    assert (num_cached + len(obs) + 6) % SECTION.page_size == 1  # the case extend used to miss by a page
    s.continue_episode("e/0", obs)
    (t2,) = _until(s, lambda srv, out: srv.take_turns())
    s.end_episode("e/0")
    (traj,) = _until(s, lambda srv, out: out)

    fresh = RolloutServer(*make_engine(tiny_model(0), SECTION), 0)
    fresh.submit(Request(uid="f/0", prompt_ids=prompt + list(t1.turn_ids) + obs, seed=2, sampling=_greedy(6)))
    (ref,) = _until(fresh, lambda srv, out: out)
    np.testing.assert_array_equal(t2.turn_ids, ref.response_ids)
    np.testing.assert_allclose(traj.behaviour_logprobs[5:], ref.behaviour_logprobs, atol=1e-5)
