"""learner.lora with a learner over several processes (learner/group.py, runtime.learner_processes > 1).

A LearnerGroup of 2 Ray actor processes x 2 CPU devices (mesh fsdp=4: the base and the adapters span
both processes) gathers the frozen base to process 0 once and writes it to the run's base store,
where servers read it (weights/lora_base.py); its identity is the in-process learner's. Fed the
same batches, process 0 publishes the adapter versions an in-process LoRA learner on one device
publishes (float32; only the reduction order differs: atol 1e-6), and a server merging them into
the stored base gets that learner's policy. A new group started from other initial weights adopts
the stored base on resume (every process reads its shards from the store) and restores the same policy.
"""

import dataclasses

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from laminar_jax.config import finalize, repo_config
from laminar_jax.configlib import to_json
from tests.runtime.test_ray_learner import _batches


def _config():
    c = repo_config("demo", "short")
    c.runtime.kind = "ray"
    c.runtime.learner_processes = 2
    c.runtime.total_steps = 10
    c.learner.lr = 1e-3
    c.learner.adam_eps = 1e-4  # as test_ray_learner.py: Adam's eps against 1e-7 gradient noise
    c.learner.mini_batches = 1
    c.learner.ppo_epochs = 2
    c.learner.micro_batches = 2
    c.learner.seq_len_buckets = (16, 32)
    c.learner.lora.rank = 4
    c.learner.lora.alpha = 8.0
    c.mesh.fsdp = -1
    return finalize(c)


@pytest.mark.slow  # two learner-group starts under Ray and a reference learner: minutes on 2 busy cores
def test_a_two_process_lora_learner_writes_the_base_once_and_publishes_the_same_adapters(tmp_path):
    import jax
    from jax.sharding import Mesh

    from laminar_jax.learner.group import LearnerGroup
    from laminar_jax.learner.learner import Learner
    from laminar_jax.learner.publish import LocalPublisher, model_params
    from laminar_jax.model import build_model
    from laminar_jax.weights.lora_base import share_base
    from laminar_jax.model.lora_version import BASE_ID, SCALE
    from laminar_jax.relay import WeightStore
    from laminar_jax.weights.lora_base import base_store_url, merged_flat
    from laminar_jax.runtime.ray_runtime import connect

    cfg = _config()
    batches = _batches()
    ckpt, store_url = str(tmp_path / "ckpt"), str(tmp_path / "weights")
    assert connect(cfg.runtime)  # before this process starts jax's threads (Ray forks)
    opts = {"num_cpus": 1, "runtime_env": {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}}
    group = again = None
    try:
        model = build_model(cfg.model)
        init = model_params(model)
        mesh = Mesh(np.asarray(jax.devices()[:1], dtype=object).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
        pub = LocalPublisher()
        ref = Learner(dataclasses.replace(cfg.learner, total_steps=cfg.runtime.total_steps), model, mesh,
                      publish_dtype=cfg.rollout.dtype, publisher=pub)
        ref_base, ref_id = ref.lora.base(), ref.lora.base_id
        ref_metrics = [ref.step(b) for b in batches]
        ref.flush(60)
        ref_version, ref_published = pub.latest()
        ref_policy = ref.policy_params()
        ref.close()

        group = LearnerGroup(to_json(cfg), 2, ckpt, actor_options=opts, init_params=init,
                             coordinator_host="127.0.0.1", timeout_s=240)
        assert group.lora_enabled and group.info[0]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
        # The base: gathered to process 0 once, in the store servers read, the reference's bytes.
        assert group.lora_base(share_base, cfg.relay, store_url) == ref_id
        stored = WeightStore.from_config(cfg.relay, base_store_url(store_url)).read(0)
        assert set(stored) == set(ref_base)
        for k in ref_base:
            np.testing.assert_array_equal(stored[k], ref_base[k], err_msg=k)

        # The initial version as the weight plane publishes it at start: an adapter version too.
        group.publish_current()
        version, published = group.published()
        assert version == 0 and set(published) == set(ref_published)
        np.testing.assert_array_equal(published[BASE_ID], ref_published[BASE_ID])

        metrics = [group.step(b) for b in batches]
        for m, r in zip(metrics, ref_metrics):
            np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-4, atol=1e-6)
        version, published = group.published()
        assert version == ref_version == 3 and set(published) == set(ref_published)
        np.testing.assert_array_equal(published[BASE_ID], ref_published[BASE_ID])
        np.testing.assert_array_equal(published[SCALE], ref_published[SCALE])
        moved = 0.0
        for k in ref_published:
            if k not in (BASE_ID, SCALE):
                np.testing.assert_allclose(published[k], ref_published[k], rtol=0, atol=1e-6, err_msg=k)
                moved = max(moved, float(np.abs(ref_published[k]).max()) if k.endswith(".lora_b") else 0.0)
        assert moved > 1e-4  # B left zero: the versions carry trained adapters
        # A server's weights: the adapter version merged into the stored base = the reference's policy.
        served = merged_flat(cfg.relay, store_url, published)
        for k in ref_policy:
            np.testing.assert_allclose(served[k], ref_policy[k], rtol=0, atol=1e-5, err_msg=k)
        group.save(3, extra={"runtime": {}})
        group.flush(60)
        group.close()

        # Resume from other initial weights (a resumed run rebuilds another base): every process
        # adopts the stored base, and the policy is the first group's.
        other = {k: v + np.float32(0.01) for k, v in init.items()}
        again = LearnerGroup(to_json(cfg), 2, ckpt, actor_options=opts, init_params=other,
                             coordinator_host="127.0.0.1", timeout_s=240)
        again.restore_latest()
        assert again.lora_base(share_base, cfg.relay, store_url, adopt=True, write=True) == ref_id
        restored = again.policy_params()
        for k in ref_policy:
            np.testing.assert_allclose(restored[k], ref_policy[k], rtol=0, atol=1e-5, err_msg=k)
    finally:
        for g in (group, again):
            if g is not None:
                g.kill()
        ray.shutdown()


@pytest.mark.slow  # SFT, a learner group and a rollout actor under a local Ray cluster: minutes on 2 cores
def test_demo_lora_under_ray_with_two_learner_processes(tmp_path):
    """configs/demo.py:lora, short, under Ray with runtime.learner_processes=2: the group writes the
    base, the rollout actor reads it from the store (runtime/rollout_host.py) and merges every
    adapter version into it; every version is adapters only, nothing is lost."""
    from laminar_jax.runtime.ray_runtime import RayRun
    from tests.runtime.test_lora_demo import _check

    c = repo_config("demo", "lora")
    c.runtime.kind = "ray"
    c.runtime.learner_processes = 2
    c.runtime.num_servers = 1
    c.runtime.samples_per_prompt = 4
    c.runtime.total_steps = 3
    c.runtime.sft_warmup_steps = 20
    c.runtime.progress = False
    c.runtime.eval_every = 0
    c.runtime.eval_before_train = False
    c.runtime.wait_timeout_s = 240.0
    c.runtime.run_dir = str(tmp_path / "run")
    s = RayRun(finalize(c), c.runtime.run_dir).run()
    _check(s, c)
    assert s["ray"]["learner_processes"] == 2 and not s["failures"], s["failures"]
    assert not ray.is_initialized()
