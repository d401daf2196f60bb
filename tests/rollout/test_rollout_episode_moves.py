"""Moving multi-turn episodes between servers: a waiting episode (its environment running) and one
mid-turn both continue output-identically, keeping their turn count, policy mask and budgets."""

import numpy as np
import pytest

from laminar_jax.rollout import RolloutSection, RolloutServer, make_engine
from laminar_jax.rollout.records import Request, SequenceState, TurnSpec
from laminar_jax.rollout.sampling import SamplingParams
from tests.rollout.rollout_helpers import tiny_model

SECTION = RolloutSection(num_slots=3, page_size=8, num_pages=40, max_prompt_len=48, max_total_len=96,
                         max_new_tokens=24, prefill_buckets=(16, 48), temperature=1.0, stop_token_ids=())
PROMPT = [1, 17, 33, 4, 60, 61, 62, 63, 64, 70]
OBS1, OBS2 = [5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24]
TURN = TurnSpec(max_new_tokens=14, max_response_tokens=80)


def _server():
    engine, params = make_engine(tiny_model(0), SECTION)
    return RolloutServer(engine, params, 0)


def _req(uid, seed=7, max_new=6):
    return Request(uid=uid, prompt_ids=PROMPT, prompt_uid=uid.split("/")[0], seed=seed, turn=TURN,
                   sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=()))


def _until_turn(server, uid, max_steps=300):
    for _ in range(max_steps):
        server.step()
        turns = [t for t in server.take_turns() if t.uid == uid]
        if turns:
            return turns[0]
    raise AssertionError(f"no turn of {uid} ended after {max_steps} steps: {server.stats()}")


def _until_done(server, uid, max_steps=300):
    for _ in range(max_steps):
        for t in server.step():
            if t.uid == uid:
                return t
    raise AssertionError(f"{uid} did not finish")


def _slot_of(server, uid):
    return next(i for i, u in server.live_slots().items() if u == uid)


def _reference():
    s = _server()
    s.submit(_req("e/0"))
    t1 = _until_turn(s, "e/0")
    assert s.continue_episode("e/0", OBS1)
    t2 = _until_turn(s, "e/0")
    assert s.continue_episode("e/0", OBS2)
    t3 = _until_turn(s, "e/0")
    s.end_episode("e/0")
    return [t1, t2, t3], _until_done(s, "e/0")


def test_waiting_and_mid_turn_episodes_move_output_identically():
    (r1, r2, r3), ref = _reference()
    a, b = _server(), _server()
    b.submit(_req("busy/0", seed=3, max_new=4))  # b's slot 0 is taken: the episode lands elsewhere
    b.step()
    a.submit(_req("e/0"))
    t1 = _until_turn(a, "e/0")
    np.testing.assert_array_equal(t1.turn_ids, r1.turn_ids)

    # Waiting on its environment: moved (through the wire format) while the environment "runs".
    state = a.export_sequence(_slot_of(a, "e/0"))
    assert state.episode["waiting"] and state.episode["turn"] == 0
    assert a.engine.page_book.allocator.num_used == 0 and a.num_live == 0
    state = SequenceState.from_bytes(state.to_bytes())
    slot = b.import_sequence(state)
    assert slot != 0 and b.num_waiting() == 1
    assert b.continue_episode("e/0", OBS1)

    # Mid-turn: a couple of decode steps into turn 2, moved back.
    b.step()
    turns = [t for t in b.take_turns() if t.uid == "e/0"]
    assert not turns, "the turn ended before the mid-turn move"
    state = b.export_sequence(_slot_of(b, "e/0"))
    assert not state.episode["waiting"] and state.episode["turn"] == 1
    a.submit(_req("other/0", seed=5, max_new=4))
    a.step()
    a.import_sequence(state)
    t2 = _until_turn(a, "e/0")
    np.testing.assert_array_equal(t2.turn_ids, r2.turn_ids)
    assert (t2.turn, t2.room) == (r2.turn, r2.room)  # the trajectory budget moved with it
    assert a.continue_episode("e/0", OBS2)
    t3 = _until_turn(a, "e/0")
    np.testing.assert_array_equal(t3.turn_ids, r3.turn_ids)
    a.end_episode("e/0")
    moved = _until_done(a, "e/0")

    np.testing.assert_array_equal(moved.response_ids, ref.response_ids)
    np.testing.assert_array_equal(moved.policy_mask, ref.policy_mask)
    np.testing.assert_allclose(moved.behaviour_logprobs, ref.behaviour_logprobs, atol=1e-5)
    assert moved.extra["turns"] == 3 and moved.extra["moves"] == 2
    assert moved.version == ref.version


def test_an_episode_whose_turn_is_not_taken_does_not_move():
    s = _server()
    s.submit(_req("t/0"))
    for _ in range(300):
        s.step()
        if s.num_waiting():
            break
    with pytest.raises(KeyError, match="not yet taken"):
        s.export_sequence(_slot_of(s, "t/0"))
    assert s.take_turns() and s.export_sequence(_slot_of(s, "t/0")).episode["waiting"]


def test_a_moved_episode_with_a_bad_mask_is_refused():
    s = _server()
    s.submit(_req("m/0"))
    _until_turn(s, "m/0")
    state = s.export_sequence(_slot_of(s, "m/0"))
    bad = SequenceState.from_bytes(state.to_bytes())
    object.__setattr__(bad, "episode", dict(bad.episode, mask=bad.episode["mask"][:-1]))
    with pytest.raises(ValueError, match="policy mask"):
        _server().import_sequence(bad)
