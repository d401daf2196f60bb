"""Multi-turn episodes in every mode (local runtime) and on the Ray runtime (each rollout actor
drives its episodes with its own EnvPool): no prompt lost or repeated, every episode has its turns."""

import os

import pytest

from laminar_jax.config import finalize, repo_config


def _short(tmp_path, mode: str, kind: str = "local"):
    c = repo_config("agentic_demo", "short")
    c.runtime.mode = mode
    if mode == "stream":  # the mode's staleness bound has no default (config.py says so)
        c.buffer.max_staleness = 2
    c.runtime.kind = kind
    c.runtime.run_dir = str(tmp_path / f"run-{mode}-{kind}")
    return c


def _check(s, c):
    rt = c.runtime
    assert s["steps"] == rt.total_steps and not s["stopped_early"]
    assert s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["consumed_prompts"] == rt.total_steps * rt.prompts_per_step
    assert s["turns_per_trajectory"] == 3.0  # the latency env's 3 turns, read from the policy masks
    assert s["env_failures"] == 0 and s["env_episodes"] >= rt.total_steps * rt.prompts_per_step
    assert s["tool_call_curve"] and s["reward_first"] is not None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "one_step", "stream"])  # laminar: tests/env/test_agentic_run.py
def test_every_mode_runs_multi_turn_episodes(tmp_path, mode):
    from laminar_jax.runtime.local import run_local

    c = _short(tmp_path, mode)
    _check(run_local(finalize(c)), c)


@pytest.mark.slow
def test_ray_rollout_actors_drive_episodes(tmp_path):
    pytest.importorskip("ray")
    import ray

    from laminar_jax.runtime.ray_runtime import RayRun

    c = _short(tmp_path, "laminar", "ray")
    c.runtime.num_servers = 2
    c.runtime.wait_timeout_s = 240.0
    s = RayRun(finalize(c), c.runtime.run_dir).run()
    _check(s, c)
    assert s["env_episodes"] > 0 and 0.0 < s["env_latency_p50_s"]  # figures from the actors' drivers
    assert os.path.exists(os.path.join(c.runtime.run_dir, "timeline.png"))
    assert not ray.is_initialized()
