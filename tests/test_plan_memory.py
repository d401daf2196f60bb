"""launch/plan.py memory: the planner's verdict for every shipped GPU config, and the budget it names."""

import os
import subprocess
import sys

import pytest

from laminar_jax.config import finalize, repo_config
from laminar_jax.placement_memory import GB, arch_of, device_bytes, fits_summary, host_layout, kv_bytes, report
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,variant,devices,verdict", [
    ("gpu_node", "", 8, {"h100": True, "h200": True, "tpu-v5e": False}),
    # The 32B variant (~23 s on 2 cores: the largest model the planner sizes) is in the slow tier.
    pytest.param("gpu_node", "32b", 8, {"h100": False, "h200": True, "tpu-v5e": False}, marks=pytest.mark.slow),
    ("gpu_pod", "", 8, {"h100": True, "h200": True, "tpu-v5e": False}),
    ("gpu_single", "", 1, {"h100": True, "h200": True, "tpu-v5e": False}),
])
def test_shipped_configs_verdict(name, variant, devices, verdict):
    assert fits_summary(finalize(repo_config(name, variant)), devices) == verdict


def test_the_old_pod_kv_pool_did_not_fit_an_h100():
    """256 x 72 pages of 64 tokens of Qwen2.5-7B KV (67.6 GB) + 30.5 GB of float32 weights per rollout GPU."""
    c = repo_config("gpu_pod")
    c.rollout.num_slots, c.rollout.num_pages = 256, 256 * 72 + 1
    cfg = finalize(c)
    assert kv_bytes(arch_of(cfg), cfg.rollout, cfg.model.dtype) / GB == pytest.approx(67.6, abs=0.1)
    r = report(cfg, "h100", 8, activations=0)
    assert not r["fits"] and r["worst_device"] == 8 and r["worst_gb"] == pytest.approx(98.1, abs=0.1)


def test_colocated_roles_add_up_and_tp_splits_the_server_share():
    c = repo_config("gpu_node", "32b")
    cfg = finalize(c)
    arch = arch_of(cfg)
    per = device_bytes(cfg, host_layout(cfg, 8), arch, activations=0)
    assert per[4] == per[5] == per[7] and per[4].learner_state == 0 and per[0].rollout_kv == 0
    assert per[4].rollout_weights == arch.num_params() * 2 // 2  # bf16 weights split over TP 2
    assert per[4].rollout_kv == kv_bytes(arch, cfg.rollout, cfg.model.dtype) // 2
    c.placement.colocate, c.placement.learner_devices, c.runtime.num_servers = True, None, 4
    cfg = finalize(c)
    colo = device_bytes(cfg, host_layout(cfg, 8), arch, activations=0)
    assert colo[0].rollout_weights == per[4].rollout_weights and colo[0].rollout_kv == per[4].rollout_kv
    assert colo[0].learner_state * 2 == per[0].learner_state  # over 8 devices instead of 4
    assert colo[0].total == colo[0].learner_state + colo[0].rollout_weights + colo[0].rollout_kv


def test_cli_exit_status_says_the_verdict():
    env = child_env(JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "plan.py"), "memory",
                        f"--config={ROOT}/configs/gpu_pod.py", "--gpu", "tpu-v5e"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "DOES NOT FIT" in p.stdout and "of 16 GB" in p.stdout
