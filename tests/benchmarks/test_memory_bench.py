"""bench memory: the scaled config on fake CPU devices, measured per device against its plan."""

import json
import os
import subprocess
import sys

import pytest

from laminar_jax.benchmarks.memory import scaled_config, summarise
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_scaled_configs_keep_the_placement_and_mesh():
    cfg, arch, layout, n = scaled_config("gpu_node", "32b")
    assert n == 8 and cfg.placement.rollout_tp == 8 and cfg.placement.colocate and len(layout.learner) == 8
    assert arch.num_kv_heads % cfg.placement.rollout_tp == 0 and arch.num_layers == 2
    cfg, _, layout, n = scaled_config("gpu_pod", "")
    assert n == 9 and layout.servers == ((8,),)  # the learner host's 8 devices and one rollout actor's


def test_summary_line_ratios_and_copies():
    rows = [{"config": "a", "role": "learner", "device": 0, "planned_bytes": 10, "measured_bytes": 8,
             "unsharded_copies": 0},
            {"config": "b", "role": "server0", "device": 1, "planned_bytes": 10, "measured_bytes": 9,
             "unsharded_copies": 2}]
    s = summarise(rows)
    assert s["max_measured_over_planned"] == 0.9 and s["min_measured_over_planned"] == 0.8
    assert s["unsharded_copies"] == 2 and "unsharded_copies" not in s["rows"][0]


UNSHARDED = r"""
import json
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from laminar_jax.benchmarks.memory import scaled_config, unsharded

_, arch, _, _ = scaled_config("gpu_node", "32b")  # 128 x 128 weight matrices, a 1024 x 128 vocab table
devices = jax.devices()
tp = Mesh(np.asarray(devices), ("tensor",))
table = jax.device_put(np.ones((1024, 128), np.float32), NamedSharding(tp, P("tensor", None)))
views = [s.data for s in table.addressable_shards]  # 8 single-device [128, 128] arrays over its buffers
out = {"views": unsharded(devices, arch, set(range(8)))}
whole = jax.device_put(np.ones((128, 128), np.float32), devices[3])
out["copy"] = unsharded(devices, arch, set(range(8)))
rep = jax.device_put(np.ones((128, 128), np.float32), NamedSharding(tp, P()))
out["replicated"] = unsharded(devices, arch, set(range(8)))
print(json.dumps(out))
"""


def test_unsharded_copies_counts_copies_not_shard_views():
    """A TP-split table's shards have a weight matrix's shape and are single-device arrays over the
    table's own buffers: no copy. A whole matrix put on one device, or replicated on 8, is."""
    p = subprocess.run([sys.executable, "-c", UNSHARDED], capture_output=True, text=True, timeout=300,
                       env=child_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"views": 0, "copy": 1, "replicated": 9}


@pytest.mark.slow
def test_bench_memory_gpu_single():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "bench.py"), "memory", "--config", "gpu_single"],
                       capture_output=True, text=True, timeout=900, env=child_env(JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["bench"] == "memory" and [r["device"] for r in out["rows"]] == [0]
    assert 0.7 <= out["min_measured_over_planned"] <= out["max_measured_over_planned"] <= 1.0


@pytest.mark.slow
def test_bench_memory_tpu_compiles_for_the_topology():
    """The TPU compiler's per-chip bytes of tpu_pod's learner update and decode step (4-layer copy)."""
    pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[tpu]')")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "bench.py"), "memory", "--tpu", "--quick"],
                       capture_output=True, text=True, timeout=1500, env=child_env(JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["bench"] == "memory_tpu" and "v5" in out["device_kind"].lower()
    assert [r["role"] for r in out["rows"]] == ["learner", "server0"]
    assert all(r["measured_bytes"] > 0 for r in out["rows"])
