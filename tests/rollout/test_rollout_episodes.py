"""Multi-turn episodes on the server: a turn ends and waits with its pages, continue_episode resumes
it over the cached context, the trajectory carries the policy mask, weights never change mid-episode."""

import numpy as np
import pytest

from laminar_jax.rollout import RolloutSection, RolloutServer, make_engine
from laminar_jax.rollout.records import Request, TurnSpec
from laminar_jax.rollout.sampling import SamplingParams
from tests.rollout.rollout_helpers import params_of, tiny_model

SECTION = RolloutSection(num_slots=3, page_size=8, num_pages=40, max_prompt_len=48, max_total_len=64,
                         max_new_tokens=24, prefill_buckets=(16, 48), temperature=1.0, stop_token_ids=())
PROMPT = [1, 17, 33, 4, 60, 61, 62, 63, 64, 70]
OBS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


def _server(section=SECTION):
    engine, params = make_engine(tiny_model(0), section)
    return RolloutServer(engine, params, 0)


def _req(uid, prompt, max_new, turn=None, seed=7):
    return Request(uid=uid, prompt_ids=prompt, prompt_uid=uid.split("/")[0], seed=seed, turn=turn,
                   sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=()))


def _until_turn(server, max_steps=200):
    for _ in range(max_steps):
        out = server.step()
        assert not out, f"unexpected finished trajectories {[t.uid for t in out]}"
        turns = server.take_turns()
        if turns:
            return turns
    raise AssertionError(f"no turn ended after {max_steps} steps: {server.stats()}")


def _until_done(server, max_steps=200):
    for _ in range(max_steps):
        out = server.step()
        if out:
            return out
    raise AssertionError("nothing finished")


def test_episode_continues_like_a_fresh_prompt_and_carries_its_mask():
    server = _server()
    server.submit(_req("e/0", PROMPT, 5, TurnSpec(max_new_tokens=6)))
    (t1,) = _until_turn(server)
    assert (t1.uid, t1.turn, t1.finish_reason, len(t1.turn_ids)) == ("e/0", 0, "length", 5)
    assert server.num_waiting() == 1 and server.stats().slots_used == 1  # the slot stays while it waits
    assert server.continue_episode("e/0", OBS)
    (t2,) = _until_turn(server)
    assert t2.turn == 1 and len(t2.turn_ids) == 6 and t2.response_tokens == 5 + len(OBS) + 6
    server.end_episode("e/0")
    (traj,) = _until_done(server)
    assert traj.extra["turns"] == 2
    np.testing.assert_array_equal(traj.policy_mask, [1] * 5 + [0] * len(OBS) + [1] * 6)
    np.testing.assert_array_equal(traj.response_ids, list(t1.turn_ids) + OBS + list(t2.turn_ids))
    assert len(traj.behaviour_logprobs) == 11
    assert server.engine.page_book.allocator.num_used == 0 and server.idle()

    # Greedy reference: the whole context prefilled fresh on another server.
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=())
    a, b = _server(), _server()
    a.submit(Request(uid="g/0", prompt_ids=PROMPT, seed=1, sampling=greedy, turn=TurnSpec(max_new_tokens=6)))
    (g1,) = _until_turn(a)
    a.continue_episode("g/0", OBS)
    (g2,) = _until_turn(a)
    a.end_episode("g/0")
    (ga,) = _until_done(a)
    ctx = PROMPT + list(g1.turn_ids) + OBS
    b.submit(Request(uid="f/0", prompt_ids=ctx, seed=1,
                     sampling=SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=())))
    (fb,) = _until_done(b)
    np.testing.assert_array_equal(g2.turn_ids, fb.response_ids)
    np.testing.assert_allclose(ga.behaviour_logprobs[5:], fb.behaviour_logprobs, atol=1e-5)


def test_stop_sequence_ends_the_turn_on_the_host():
    probe = _server()
    probe.submit(_req("p/0", PROMPT, 8, TurnSpec(max_new_tokens=8)))
    (full,) = _until_turn(probe)
    toks = list(full.turn_ids)
    seq = tuple(toks[2:4])
    end = next(i + 2 for i in range(len(toks) - 1) if tuple(toks[i:i + 2]) == seq)
    server = _server()
    server.submit(_req("p/0", PROMPT, 8, TurnSpec(max_new_tokens=8, stop_sequences=(seq,))))
    (t,) = _until_turn(server)
    assert t.finish_reason == "stop" and list(t.turn_ids) == toks[:end]
    assert server.continue_episode("p/0", OBS)  # the overshoot decoded past the stop is dropped
    (t2,) = _until_turn(server)
    server.end_episode("p/0")
    (traj,) = _until_done(server)
    assert len(traj.response_ids) == end + len(OBS) + len(t2.turn_ids)
    assert traj.policy_mask.sum() == len(traj.behaviour_logprobs) == end + len(t2.turn_ids)


def test_weights_wait_for_a_waiting_episode():
    server = _server()
    server.submit(_req("w/0", PROMPT, 4, TurnSpec(max_new_tokens=4)))
    _until_turn(server)
    server.set_params(1, params_of(1))
    for _ in range(3):
        server.step()
    assert server.version == 0  # the episode is mid-flight: no swap
    server.continue_episode("w/0", OBS)
    _until_turn(server)
    server.end_episode("w/0")
    (traj,) = _until_done(server)
    assert traj.version == 0
    server.step()
    assert server.version == 1


def test_trajectory_budget_ends_the_episode_cleanly():
    server = _server()
    server.submit(_req("b/0", PROMPT, 5, TurnSpec(max_new_tokens=5, max_response_tokens=20)))
    (t1,) = _until_turn(server)
    assert t1.room == 15
    assert not server.continue_episode("b/0", list(range(3, 18)))  # 15 observation tokens leave no room
    (traj,) = _until_done(server)
    assert traj.finish_reason == "length" and traj.policy_mask.sum() == 5
    with pytest.raises(KeyError, match="no episode 'b/0' waits"):
        server.end_episode("b/0")
