"""EpisodeDriver with a real server: multi-turn episodes end to end; raising, hanging and malformed
environments end their episode with reward 0, counted, while the others go on."""

import threading
import time

import numpy as np
import pytest

from laminar_jax.env import EnvPool, Environment, StepResult, register_env
from laminar_jax.env.driver import EpisodeDriver
from laminar_jax.model.tokenizer import BuiltinTokenizer
from laminar_jax.rollout import RolloutSection, RolloutServer, make_engine
from laminar_jax.rollout.records import Request, TurnSpec
from laminar_jax.rollout.sampling import SamplingParams
from tests.rollout.rollout_helpers import tiny_model

SECTION = RolloutSection(num_slots=4, page_size=8, num_pages=80, max_prompt_len=16, max_total_len=120,
                         max_new_tokens=8, prefill_buckets=(16,), temperature=1.0, stop_token_ids=())
RELEASE = threading.Event()


class FakeRaisingEnv(Environment):
    def step(self, action_text):
        raise RuntimeError("tool crashed")


class FakeHangingEnv(Environment):
    def step(self, action_text):
        RELEASE.wait(20)
        return StepResult(None, 1.0, True)


class FakeMalformedEnv(Environment):
    def step(self, action_text):
        return "not a step"


for _name, _cls in [("fake-raising", FakeRaisingEnv), ("fake-hanging", FakeHangingEnv),
                    ("fake-malformed", FakeMalformedEnv)]:
    register_env(_name, _cls)


def _run(envs: list, pool_timeout: float = 5.0):
    engine, params = make_engine(tiny_model(0), SECTION)
    server = RolloutServer(engine, params, 0)
    pool = EnvPool(workers=4, timeout_s=pool_timeout)
    driver = EpisodeDriver(pool, BuiltinTokenizer())
    try:
        for i, (name, kwargs) in enumerate(envs):
            req = Request(uid=f"q{i}/0", prompt_ids=[1, 40, 41, 42], prompt_uid=f"q{i}", seed=i,
                          sampling=SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=()),
                          turn=TurnSpec(max_new_tokens=4))
            driver.start(req, {"uid": req.uid, "extra_info": {"env": name, "env_kwargs": kwargs}})
        out = {}
        deadline = time.monotonic() + 60
        while len(out) < len(envs):
            assert time.monotonic() < deadline, f"episodes stuck: {driver.stats()}"
            driver.poll(server)
            for t in driver.finish(server.step()):
                out[t.uid] = t
            time.sleep(0.001)
        return out, driver.stats(), server
    finally:
        RELEASE.set()
        pool.close()


def test_latency_episodes_have_their_turns_masks_and_rewards():
    out, stats, server = _run([("latency", {"turns": 3, "median_s": 0.02, "sigma": 0.3, "observation": " ok "})] * 3)
    obs_len = len(BuiltinTokenizer().encode("tool:  ok \nassistant: "))
    for t in out.values():
        assert t.extra["turns"] == 3 and t.reward == 1.0 and t.extra["env_error"] is None
        assert t.policy_mask.tolist() == [1] * 4 + [0] * obs_len + [1] * 4 + [0] * obs_len + [1] * 4
        assert len(t.behaviour_logprobs) == 12
    assert stats.episodes_done == 3 and stats.turns_per_episode == 3 and stats.env_failures == 0
    assert stats.env_wait_slot_s >= 3 * 2 * 0.01 and server.idle()


def test_failing_environments_end_their_episode_with_reward_zero():
    global RELEASE
    RELEASE = threading.Event()
    envs = [("fake-raising", {}), ("fake-hanging", {}), ("fake-malformed", {}),
            ("latency", {"turns": 2, "median_s": 0.01}), ("no-such-env", {})]
    out, stats, server = _run(envs, pool_timeout=1.0)  # the hanging env's deadline; the others are far inside it
    assert len(out) == 5  # every episode comes out, none lost
    errors = {uid: t.extra["env_error"] for uid, t in out.items()}
    assert "RuntimeError: tool crashed" in errors["q0/0"]
    assert errors["q1/0"].startswith("timeout")
    assert "MalformedStepError" in errors["q2/0"]
    assert errors["q3/0"] is None and out["q3/0"].reward == 1.0
    assert "not registered" in errors["q4/0"]  # a failed reset: one turn, then the episode ends
    for uid in ("q0/0", "q1/0", "q2/0", "q4/0"):
        assert out[uid].reward == 0.0 and out[uid].extra["turns"] == 1
    assert stats.env_failures == 4 and server.idle()
