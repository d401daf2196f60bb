"""TurnSpec.release_slot: a waiting episode gives its slot to other requests (its KV pages stay) and
takes a free slot again on its observation; outputs are the same as with slots kept."""

import numpy as np

from laminar_jax.rollout import RolloutSection, RolloutServer, make_engine
from laminar_jax.rollout.records import Request, TurnSpec
from laminar_jax.rollout.sampling import SamplingParams
from tests.rollout.rollout_helpers import tiny_model

SECTION = RolloutSection(num_slots=2, page_size=8, num_pages=80, max_prompt_len=16, max_total_len=64,
                         max_new_tokens=8, prefill_buckets=(16,), temperature=0.0, stop_token_ids=())
EPISODES = 5
ENV_STEPS = 6  # server steps an "environment" takes to answer


def _run(release: bool):
    engine, params = make_engine(tiny_model(0), SECTION)
    server = RolloutServer(engine, params, 0)
    for i in range(EPISODES):
        server.submit(Request(uid=f"e{i}/0", prompt_ids=[1, 30 + i, 40, 41 + i], prompt_uid=f"e{i}", seed=i,
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=()),
                              turn=TurnSpec(max_new_tokens=4 + i % 3, release_slot=release)))
    answers, done, most_live, step = [], {}, 0, 0
    while len(done) < EPISODES:
        step += 1
        assert step < 2000, f"stuck: {server.stats()}"
        for t in server.step():
            done[t.uid] = t
        for turn in server.take_turns():
            answers.append((step + ENV_STEPS, turn))
        for due, turn in [a for a in answers if a[0] <= step]:
            answers.remove((due, turn))
            if turn.turn == 2:
                server.end_episode(turn.uid)
            else:
                server.continue_episode(turn.uid, [50 + turn.turn, 51, 52, 53, 54][:3 + turn.turn])
        st = server.stats()
        assert st.slots_used <= SECTION.num_slots
        most_live = max(most_live, server.num_live)
    assert server.engine.page_book.allocator.num_used == 0 and server.idle()
    return done, most_live


def test_released_slots_serve_other_episodes_and_outputs_match():
    kept, live_kept = _run(release=False)
    released, live_released = _run(release=True)
    assert live_kept <= SECTION.num_slots < live_released  # waiting episodes left their slots to others
    assert sorted(kept) == sorted(released)
    for uid, a in kept.items():
        b = released[uid]
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.policy_mask, b.policy_mask)
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)
        assert a.extra["turns"] == b.extra["turns"] == 3
