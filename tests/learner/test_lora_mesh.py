"""learner.lora on a mesh: adapters shard like their weights (A's input axis, B's output axis), the
frozen base keeps its FSDP/TP shardings and stays put, and the adapters after two steps match the
single-device run's (subprocesses with host devices), with adapter dropout too: its masks do not
depend on how the activations are split."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.subprocess_env import child_env

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_mesh_worker.py")


def _run(mesh: str, devices: int, dropout: float = 0.0) -> dict:
    env = child_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, WORKER, mesh, str(dropout)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_lora_on_fsdp4_tensor2_matches_single_device(dropout):
    one, mesh = _run("1,1,1", 1, dropout), _run("1,4,2", 8, dropout)
    assert mesh["devices"] == 8 and mesh["base_unchanged"] and one["base_unchanged"]
    specs = mesh["specs"]
    assert specs["layers.self_attn.q_proj.lora_a"] == "P(None, None, 'fsdp')"  # [L, r, in]: in = embed
    assert specs["layers.self_attn.q_proj.lora_b"] == "P(None, 'tensor', None)"  # [L, out, r]: out = heads
    assert specs["layers.self_attn.q_proj.weight"] == "P(None, 'tensor', 'fsdp')"
    for name, want in one["adapters"].items():
        np.testing.assert_allclose(np.asarray(mesh["adapters"][name]), np.asarray(want), rtol=0, atol=2e-3,
                                   err_msg=name)
