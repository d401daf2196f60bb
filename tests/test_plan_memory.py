"""The memory plan (placement_memory.py): items per device, the shipped configs' verdicts, the budget
at runtime.gpu_memory_fraction, the start-time check and launch/plan.py memory."""

import math
import os
import re
import subprocess
import sys

import pytest

from laminar_jax.config import finalize, repo_config
from laminar_jax.configlib import ConfigError
from laminar_jax.learner.logprobs import chunk_positions
from laminar_jax.placement_memory import (GB, arch_of, check_devices, device_items, fit_errors, fits_summary,
                                          host_layout, kv_bytes, learner_rows_per_device, param_table, report,
                                          shard_elements)
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,variant,devices,verdict", [
    ("gpu_node", "", 8, {"h100": True, "h200": True, "tpu-v5e": False, "tpu-v5p": True}),
    ("gpu_pod", "", 8, {"h100": True, "h200": True, "tpu-v5e": False, "tpu-v5p": True}),
    ("gpu_single", "", 1, {"h100": True, "h200": True, "tpu-v5e": False, "tpu-v5p": True}),
    ("tpu_pod", "", 8, {"h100": True, "h200": True, "tpu-v5e": True, "tpu-v5p": True}),
])
def test_shipped_configs_verdict(name, variant, devices, verdict):
    assert fits_summary(finalize(repo_config(name, variant)), devices) == verdict


def test_parameter_shards_follow_the_mesh_rules():
    """FSDP over 4 splits every matrix by 4 and leaves the norms and biases whole."""
    arch = arch_of(finalize(repo_config("gpu_node")))
    table = param_table(arch)
    total = sum(n for n in shard_elements(table, (), {"data": 1, "fsdp": 1, "tensor": 1}))
    assert total == pytest.approx(arch.num_params(), rel=1e-4)  # num_params leaves out the q/k/v biases
    cfg = finalize(repo_config("gpu_node"))
    fsdp4 = sum(shard_elements(table, cfg.mesh.rules, {"data": 1, "fsdp": 4, "tensor": 1}))
    norms = sum(s[0] for s, _ in table if len(s) == 1)
    assert fsdp4 == pytest.approx((total - norms) / 4 + norms, rel=1e-3)


def test_items_of_a_learner_and_a_server_device():
    cfg = finalize(repo_config("gpu_node"))
    arch = arch_of(cfg)
    per = device_items(cfg, host_layout(cfg, 8), arch, activations=0)
    learner, server = per[0], per[4]
    assert learner["adam_moments"] == 2 * learner["master_params"]  # float32 master, float32 moments
    assert learner["gradients"] == learner["master_params"] * 2  # micro-batches: accumulated + current
    assert learner["compute_copy"] > learner["master_params"] // 2  # bfloat16 cast of the shard + gathered layers
    assert server["serving_weights"] == pytest.approx(arch.num_params() * 2, rel=1e-3)  # bf16 serving, TP 1
    assert server["kv_pool"] == kv_bytes(arch, cfg.rollout, "bfloat16")
    assert 0 < server["swap_staging"] <= arch.largest_weight() * 2  # one tensor, not a second version
    assert "master_params" not in server and "kv_pool" not in learner


@pytest.mark.parametrize("name", ["tpu_pod", "gpu_node"])
def test_gathered_gradients_are_one_layer_and_the_head_gradient_is_the_chunk_phase(name):
    """Under FSDP the backward holds one layer's gradient whole before its reduce-scatter (the
    embedding's lookup gradient is reduce-scattered to its shards: learner/mesh.py `_gathered`). The
    LM head's gradient is made whole in each log-prob chunk's backward, as a float32 product and its
    all-reduce in the compute dtype, when that chunk's logits are dead (the TPU compiler's buffer
    assignment for tpu_pod): the chunk phase holds the larger of the two, never their sum."""
    cfg = finalize(repo_config(name))
    arch = arch_of(cfg)
    learner = device_items(cfg, host_layout(cfg, 8), arch, activations=0)[0]
    table = arch.vocab_size * arch.hidden_size
    per_layer = sum(math.prod(s) for s, _ in param_table(arch) if arch.vocab_size not in s) // arch.num_layers
    assert learner["gathered_grads"] == per_layer * 2  # bfloat16 compute, tensor axis 1
    rows = learner_rows_per_device(cfg, 4)  # FSDP over 4 learner devices
    logits = 3 * rows * chunk_positions(cfg.learner.logits_chunk_tokens, rows, cfg.rollout.max_total_len) * \
        arch.vocab_size * 4
    assert learner["logprob_chunks"] == max(logits, (4 + 2) * table) > (4 + 2) * table // 2
    assert arch.tie_word_embeddings == (name == "tpu_pod")  # a tied and an untied head


def test_budget_is_the_allocator_fraction_and_the_verdict_keeps_a_margin():
    c = repo_config("gpu_node")
    r = report(finalize(c), "h100", 8)
    assert r["budget_gb"] == pytest.approx(72.0) and r["reserve_gb"] == pytest.approx(8.0)
    c.runtime.gpu_memory_fraction = 0.7  # 56 GB: the servers' 56.8 GB no longer fit
    r2 = report(finalize(c), "h100", 8, activations=0)
    assert not r2["fits"] and r2["worst_device"] == 4 and r2["largest"][0][0] == "kv_pool"


def test_a_device_over_budget_fails_naming_device_budget_items_and_key():
    cfg = finalize(repo_config("gpu_node"))
    per = device_items(cfg, host_layout(cfg, 8), arch_of(cfg), activations=0)
    limits = {d: (80 * 2**30 if d < 4 else 40 * 2**30) for d in range(8)}
    errors = fit_errors(per, limits)
    assert len(errors) == 4 and errors[0].startswith("device 4: needs")
    assert "of its 40.00 GiB budget" in errors[0] and "largest: kv_pool" in errors[0]
    assert "change rollout.num_pages" in errors[0]


class FakeDevice:
    """Stands in for a jax device: its platform and memory_stats (all check_devices reads)."""

    platform = "gpu"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit}


def test_start_check_raises_a_config_error_before_compiling():
    cfg = finalize(repo_config("gpu_node"))
    arch, layout = arch_of(cfg), host_layout(cfg, 8)
    check_devices(cfg, layout, [FakeDevice(None)] * 8, arch)  # CPU: nothing reported, nothing checked
    check_devices(cfg, layout, [FakeDevice(72 * 10**9)] * 8, arch)  # an H100 at 0.9: fits
    with pytest.raises(ConfigError, match=r"device 4: needs .* budget .*largest: kv_pool .*rollout.num_pages"):
        check_devices(cfg, layout, [FakeDevice(72 * 10**9)] * 4 + [FakeDevice(40 * 2**30)] * 4, arch)


def test_a_rollout_server_checks_its_own_devices():
    """A server alone on its devices (a Ray rollout actor): its share of one server against each
    device's budget, the error naming the server, the device, the budget, the largest items and the key."""
    from laminar_jax.placement_memory import check_server_devices, rollout_items

    cfg = finalize(repo_config("gpu_node"))
    arch = arch_of(cfg)
    need = sum(rollout_items(cfg, arch, 1).values())
    check_server_devices(cfg, [FakeDevice(None)], arch)  # CPU: nothing reported, nothing checked
    check_server_devices(cfg, [FakeDevice(need + 1)], arch, "rollout server s0")
    with pytest.raises(ConfigError, match=r"rollout server s0 does not fit .*\n  device 0: needs .* of its 40.00 GiB "
                                          r"budget .*largest: kv_pool .*change rollout.num_pages"):
        check_server_devices(cfg, [FakeDevice(40 * 2**30)], arch, "rollout server s0")


def test_rollout_host_fails_before_building_its_engine(monkeypatch):
    """RolloutHost (the Ray rollout actor's body) runs the check first: a device too small for the
    server fails with the plan's message, and no engine is built, no relay is asked for weights."""
    import laminar_jax.placement
    import laminar_jax.rollout
    from laminar_jax.runtime.rollout_host import RolloutHost

    monkeypatch.setattr(laminar_jax.placement, "bytes_limits", lambda devices: {0: 20 * 2**30})

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the memory check")

    monkeypatch.setattr(laminar_jax.rollout, "make_engine", no_engine)
    with pytest.raises(ConfigError, match=r"(?s)rollout server \S+ does not fit.*device 0: needs .* of its 20.00 GiB "
                                          r"budget.*largest: kv_pool"):
        RolloutHost(finalize(repo_config("gpu_node")), 0, 0, ["127.0.0.1:1"], None, buffer=None, keys=None)


def test_every_role_process_sets_the_allocator_fraction():
    from laminar_jax.gpu_allocator import allocator_env

    assert allocator_env(0.9) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.900", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    code = ("import os; from laminar_jax.config import finalize, repo_config; "
            "from laminar_jax.process_settings import apply_process_settings; c = repo_config('gpu_node'); "
            "c.runtime.gpu_memory_fraction = 0.8; apply_process_settings(finalize(c)); "
            "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'], os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=child_env(JAX_PLATFORMS="cpu"))
    assert p.stdout.split() == ["0.800", "true"], p.stderr


def test_cli_exit_status_says_the_verdict():
    env = child_env(JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "plan.py"), "memory",
                        f"--config={ROOT}/configs/gpu_pod.py", "--gpu", "tpu-v5e"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "DOES NOT FIT" in p.stdout and "16.0 GB budget" in p.stdout


@pytest.mark.slow
def test_deploy_table_is_the_planner_output():
    """docs/DEPLOY.md's table is `launch/plan.py memory --table` (the 32B plan makes this slow)."""
    from laminar_jax.placement_memory import shipped_table

    table = shipped_table()
    assert "DOES NOT FIT" not in table
    doc = open(os.path.join(ROOT, "docs", "DEPLOY.md")).read()
    got = re.search(r"<!-- plan.py memory --table -->\n(.*?)\n<!-- end -->", doc, re.S)
    assert got and got.group(1).strip() == table.strip()
