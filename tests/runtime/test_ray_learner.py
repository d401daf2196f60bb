"""The learner spread over several processes under Ray (learner/group.py).

1. A LearnerGroup of 2 Ray actor processes x 2 CPU devices (jax.distributed, gloo collectives;
   mesh fsdp=4, so every sharded parameter spans both processes) fed a fixed list of batches gives
   the same metrics, published weights and parameters as an in-process Learner on one device fed
   the same batches. Tolerance (float32; only the reduction order differs between the layouts):
   loss and grad norm rtol 1e-4; parameters after 3 steps x 2 AdamW updates atol 1e-6 (measured
   6e-8; the updates move weights by > 1e-3). adam_eps is 1e-4, as in test_learner_mesh.py: with
   1e-8, Adam turns 1e-7 gradient noise on ~0 gradients into updates of size lr. Then an orbax
   multi-process checkpoint restores into a new group bit for bit, and a killed process makes the
   next call raise LearnerGroupError naming it.
2. (slow) The demo's short variant under a local Ray cluster with runtime.learner_processes=2 (a
   learner process killed mid-run: the group restarts from its checkpoint and replays) completes
   with no lost or repeated prompt, then resumes from its checkpoint for 2 more steps.
"""

import dataclasses
import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from laminar_jax.config import finalize, repo_config
from laminar_jax.configlib import to_json

def demo(variant="short"):
    return repo_config("demo", variant)


def _batches(n_batches=3, n=16, seed=0):
    from laminar_jax.types import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for b in range(n_batches):
        trajs = []
        for i in range(n):
            r = rng.integers(3, 100, int(rng.integers(1, 12)))
            trajs.append(Trajectory(f"b{b}p{i // 4}/{i % 4}", f"b{b}p{i // 4}", i % 4, np.array([1, 5, 6, 7]), r,
                                    rng.normal(-4.8, 0.3, len(r)).astype(np.float32), b, reward=float(rng.random())))
        out.append(trajs)
    return out


def _config(tmp_path):
    c = demo()
    c.runtime.kind = "ray"
    c.runtime.learner_processes = 2
    c.runtime.total_steps = 10
    c.learner.lr = 1e-3
    c.learner.adam_eps = 1e-4
    # 2 updates per step: 2 PPO epochs over a shuffled batch, each in 2 accumulated micro-batches.
    # (mini_batches=1: with mini_batches > 1 the learner plane's working tree currently gives
    # different results on 1 and 4 devices even within one process; reported to the lead.)
    c.learner.mini_batches = 1
    c.learner.ppo_epochs = 2
    c.learner.micro_batches = 2
    c.learner.seq_len_buckets = (16, 32)
    c.mesh.fsdp = -1
    return finalize(c)


def test_learner_processes_config_is_validated():
    from laminar_jax.configlib import ConfigError

    c = demo()
    c.runtime.learner_processes = 2
    with pytest.raises(ConfigError, match="runtime.learner_processes=2.*kind='ray'"):
        finalize(c)  # the local runtime has a single learner process
    c.runtime.kind = "ray"
    assert finalize(c).runtime.learner_processes == 2
    c.runtime.learner_processes = 0
    with pytest.raises(ConfigError, match="runtime.learner_processes=0"):
        finalize(c)


def test_learner_group_of_two_processes_matches_in_process_learner(tmp_path):
    import jax
    from jax.sharding import Mesh

    from laminar_jax.learner.learner import Learner
    from laminar_jax.model import build_model
    from laminar_jax.learner.publish import model_params
    from laminar_jax.learner.group import LearnerGroup, LearnerGroupError
    from laminar_jax.runtime.ray_runtime import connect

    cfg = _config(tmp_path)
    batches = _batches()
    ckpt = str(tmp_path / "ckpt")
    assert connect(cfg.runtime)  # before this process starts jax's threads (Ray forks)

    opts = {"num_cpus": 1, "runtime_env": {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}}
    group = again = None
    try:
        # Reference: one process, one device.
        model = build_model(cfg.model)
        init = model_params(model)
        mesh = Mesh(np.asarray(jax.devices()[:1], dtype=object).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
        ref = Learner(dataclasses.replace(cfg.learner, total_steps=cfg.runtime.total_steps), model, mesh)
        ref_metrics = [ref.step(b) for b in batches]
        ref_params = ref.policy_params()
        ref.close()

        # init_params: the group starts from exactly the reference's initial weights (as after SFT).
        group = LearnerGroup(to_json(cfg), 2, ckpt, actor_options=opts, init_params=init,
                             coordinator_host="127.0.0.1", timeout_s=240)
        assert [i["devices"] for i in group.info] == [4, 4] and [i["local_devices"] for i in group.info] == [2, 2]
        assert group.info[0]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
        metrics = [group.step(b) for b in batches]
        assert group.version == 3
        for m, r in zip(metrics, ref_metrics):
            assert m["version"] == r["version"] and m["updates"] == r["updates"] == 2
            np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(m["grad_norm"], r["grad_norm"], rtol=1e-4)
        # Each version is gathered to process 0 alone: process 1 builds no host copy of it.
        model_bytes = sum(v.nbytes for v in ref_params.values())
        assert group.host_copy_bytes() == [model_bytes, 0]
        got = group.policy_params()
        version, published = group.published()  # what process 0 handed its publisher: the full copy
        assert version == 3 and set(got) == set(published) == set(ref_params)
        moved = worst = 0.0
        for k in ref_params:
            assert got[k].shape == ref_params[k].shape, k
            np.testing.assert_array_equal(published[k], got[k], err_msg=k)
            np.testing.assert_allclose(got[k], ref_params[k], rtol=0, atol=1e-6, err_msg=k)
            moved = max(moved, float(np.abs(ref_params[k] - init[k]).max()))
            worst = max(worst, float(np.abs(got[k] - ref_params[k]).max()))
        print(f"max |group - in-process| parameter difference after 3 steps: {worst:.3g}")
        assert moved > 1e-3  # the steps really changed the weights (lr 1e-3 x 6 updates)

        # Multi-process orbax checkpoint: a new group restores the same state, bit for bit.
        group.save(3, extra={"runtime": {"marker": 7}})
        group.flush(60)
        group.close()
        again = LearnerGroup(to_json(cfg), 2, ckpt, actor_options=opts, coordinator_host="127.0.0.1", timeout_s=240)
        assert again.restore_latest() == {"runtime": {"marker": 7}} and again.version == 3
        restored = again.policy_params()
        for k in got:
            np.testing.assert_array_equal(restored[k], got[k], err_msg=k)

        # A dead process: the next collective call fails at once, naming it, and the group is broken.
        again.kill_process(1)
        with pytest.raises(LearnerGroupError, match="learner-1"):
            again.step(batches[0])
        assert again.broken
    finally:
        for g in (group, again):
            if g is not None:
                g.kill()
        ray.shutdown()


@pytest.mark.slow  # ~2.5-3 min on 2 busy cores (SFT, 3 learner-group starts, 2 runs); -m slow
def test_demo_short_with_two_learner_processes_survives_a_killed_one_and_resumes(tmp_path):
    """The demo's short variant, learner over 2 Ray actor processes (SFT in the driver, the group
    starts from its weights); learner process 1 is killed after step 3: the group restarts from
    the step-2 checkpoint, replays step 3, trains step 4. No prompt lost or repeated. Then the run
    resumes from its checkpoint (a new group restores it) and trains 2 more steps."""
    from laminar_jax.runtime.ray_runtime import RayRun

    c = demo()
    c.runtime.kind = "ray"
    c.runtime.learner_processes = 2
    c.runtime.num_servers = 1
    c.runtime.checkpoint_every = 2
    c.runtime.run_dir = str(tmp_path / "run")
    c.runtime.wait_timeout_s = 240.0
    c.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    run = RayRun(finalize(c), c.runtime.run_dir)
    killed = []

    def kill_learner_process(version):
        if version == 3 and not killed:
            killed.append(version)
            run.learner.kill_process(1)

    run.on_step_hooks.append(kill_learner_process)
    s = run.run()
    rt = c.runtime
    assert s["steps"] == rt.total_steps and not s["stopped_early"]
    assert s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["consumed_prompts"] == rt.total_steps * rt.prompts_per_step
    assert s["ray"]["learner_processes"] == 2
    learner_fails = [f for f in s["failures"] if "learner" in f]
    assert killed == [3] and len(learner_fails) == 1, s["failures"]
    assert "LearnerGroupError" in learner_fails[0]["learner"] and learner_fails[0]["replayed_steps"] == 1
    assert not [f for f in s["failures"] if "server" in f], s["failures"]
    # Every version 0..4 was published once, by learner process 0 (the store keeps the newest).
    from laminar_jax.relay import WeightStore

    assert WeightStore(os.path.join(c.runtime.run_dir, "weights")).latest() == rt.total_steps
    assert s["ray"]["publisher_relay_failures"] == []
    assert max(int(n) for n in os.listdir(os.path.join(c.runtime.run_dir, "checkpoints")) if n.isdigit()) == 4
    assert not ray.is_initialized()

    # Resume: the group restores step 4 (version 4 is in the store: process 0 puts it on the
    # relays only) and goes on to step 6 without losing or repeating a prompt.
    c.runtime.total_steps = 6
    again = RayRun(finalize(c), c.runtime.run_dir)
    assert again.learner.version == 4
    s2 = again.run()
    assert s2["steps"] == 6 and s2["lost_prompts"] == 0 and s2["duplicated_prompts"] == 0
    assert s2["consumed_prompts"] == 6 * rt.prompts_per_step
    assert WeightStore(os.path.join(c.runtime.run_dir, "weights")).latest() == 6
    assert not ray.is_initialized()
