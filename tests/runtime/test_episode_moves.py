"""A multi-turn episode moved between rollout workers while its (slow) environment runs: the
destination's driver takes on the environment and its running step, and the trajectory comes out
token for token as in an unmoved run, with the same reward and turn count."""

import time

import numpy as np
import pytest

from laminar_jax.env import EnvPool
from laminar_jax.env.driver import EpisodeDriver
from laminar_jax.model.tokenizer import BuiltinTokenizer
from laminar_jax.rollout import RolloutSection, RolloutServer, make_engine
from laminar_jax.rollout.records import TurnSpec
from laminar_jax.runtime.rollout_worker import EpisodeFeed, RolloutWorker
from laminar_jax.types import WorkItem
from tests.rollout.rollout_helpers import tiny_model

SECTION = RolloutSection(num_slots=3, page_size=8, num_pages=60, max_prompt_len=16, max_total_len=96,
                         max_new_tokens=8, prefill_buckets=(16,), temperature=1.0, stop_token_ids=())
ENV = {"extra_info": {"env": "latency", "env_kwargs": {"turns": 3, "median_s": 0.4, "sigma": 0.0}}}


def _worker(name: str) -> RolloutWorker:
    engine, params = make_engine(tiny_model(0), SECTION)
    driver = EpisodeDriver(EnvPool(workers=4, timeout_s=20.0), BuiltinTokenizer())
    feed = EpisodeFeed(driver, lambda uid: dict(ENV), TurnSpec(max_new_tokens=8))
    # Only the move path is exercised: no weight client, buffer or mode policy.
    return RolloutWorker(0, name, RolloutServer(engine, params, 0), None, None, None, None,
                         pull_timeout_s=5.0, episodes=feed)


def _item(uid: str) -> WorkItem:
    return WorkItem(uid=uid, prompt_uid=uid.split("/")[0], sample_index=0, prompt_ids=(1, 40, 41, 42, 43),
                    seed=11)


def _step(w: RolloutWorker) -> list:
    with w.lock:
        return w.episodes.step(w.server, w.server.step())


def _run(workers, uid, move_at_wait: bool, deadline_s: float = 60.0):
    """Drive until `uid` finishes; with move_at_wait, move it to workers[1] as soon as it waits."""
    src, dst = workers
    src.episodes.start(_item(uid))
    owner, moved, t_end = src, False, time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        for w in workers:
            for traj in _step(w):
                if traj.uid == uid:
                    return traj, owner, moved
        if move_at_wait and not moved and src.server.num_waiting():
            st = src.episodes.driver.stats()
            assert st.waiting_now == 1  # the environment's step is running now
            state = src.export_sequence(uid, src.server.version)
            assert state is not None and state.episode["waiting"] and state.handoff is not None
            dst.import_sequence(state)
            owner, moved = dst, True
            assert not src.episodes.driver.owns(uid) and dst.episodes.driver.owns(uid)
        time.sleep(0.002)
    raise AssertionError(f"{uid} did not finish in {deadline_s} s")


@pytest.fixture(scope="module")
def workers():
    ws = [_worker("a"), _worker("b")]
    yield ws
    for w in ws:
        w.episodes.driver.pool.close()


def test_episode_moved_while_its_environment_runs_continues_identically(workers):
    ref, _, _ = _run(workers, "ref/0", move_at_wait=False)
    moved, owner, did_move = _run(workers, "ref/0", move_at_wait=True)
    assert did_move and owner is workers[1]
    np.testing.assert_array_equal(moved.response_ids, ref.response_ids)
    np.testing.assert_array_equal(moved.policy_mask, ref.policy_mask)
    np.testing.assert_allclose(moved.behaviour_logprobs, ref.behaviour_logprobs, atol=1e-5)
    assert moved.reward == ref.reward and moved.extra["turns"] == ref.extra["turns"] == 3
    assert moved.extra["moves"] == 1 and moved.extra["env_error"] is None
    assert workers[1].episodes.driver.stats().episodes_done >= 1


def test_portable_export_keeps_episodes_in_process(workers):
    src = workers[0]
    src.episodes.start(_item("keep/0"))
    t_end = time.monotonic() + 30
    while not src.server.num_waiting():
        assert time.monotonic() < t_end
        _step(src)
    assert src.export_sequence("keep/0", src.server.version, portable=True) is None
    state = src.export_sequence("keep/0", src.server.version)
    state_without_env = type(state).from_bytes(state.to_bytes())  # what crosses a process boundary
    with pytest.raises(ValueError, match="without its environment"):
        workers[1].import_sequence(state_without_env)
    src.import_sequence(state)  # back where it was, with its environment
    while True:
        assert time.monotonic() < t_end
        if any(t.uid == "keep/0" for t in _step(src)):
            break


def test_env_config_chooses_whether_waiting_episodes_keep_their_slots():
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.runtime.rollout_worker import episode_feed

    c = repo_config("agentic_demo", "short")
    assert episode_feed(finalize(c), BuiltinTokenizer(), dict).turn.release_slot is False
    c.env.release_slot_while_waiting = True
    feed = episode_feed(finalize(c), BuiltinTokenizer(), dict)
    assert feed.turn.release_slot is True
    feed.driver.pool.close()
