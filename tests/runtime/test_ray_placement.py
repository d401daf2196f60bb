"""Under Ray a rollout actor of placement.rollout_tp=2 builds its engine over two devices: on this
CPU-only cluster, two forced host devices (XLA_FLAGS in its runtime_env); the run completes."""

import pytest

from laminar_jax.config import finalize, repo_config


@pytest.mark.slow
def test_ray_rollout_actor_runs_tp2_over_its_two_devices(tmp_path):
    import ray

    from laminar_jax.runtime.ray_runtime import RayRun

    c = repo_config("demo", "short")
    c.runtime.update(kind="ray", num_servers=1, total_steps=2, run_dir=str(tmp_path / "run"), progress=False,
                     timeline=False)
    c.placement.rollout_tp = 2
    c.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    seen = {}
    run = RayRun(finalize(c), c.runtime.run_dir)
    run.on_step_hooks.append(lambda v: v == 1 and seen.update(
        ready=ray.get(run.fleet.actors[0].ready.remote(), timeout=60)))
    s = run.run()
    assert s["steps"] == 2 and s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert len(seen["ready"]["devices"]) == 2, seen
