"""bench memory --device: a shipped config at real size on the accelerators; its dry run and its
per-device sums run on the CPU."""

import json
import os
import subprocess
import sys

from laminar_jax.benchmarks.memory_device import load, rows_of
from laminar_jax.placement import Layout
from laminar_jax.placement_memory import device_items
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dry_run_prints_the_plan_and_the_commands_and_runs_nothing():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "bench.py"), "memory", "--device", "--dry-run",
                        "--config", "gpu_single", "--run-steps", "3"],
                       capture_output=True, text=True, timeout=300, env=child_env(JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    cfg, arch, layout = load("gpu_single")
    planned = sum(device_items(cfg, layout, arch, pinned_host=True)[0].values())
    assert out["dry_run"] and out["layout"] == {"learner": [0], "servers": [[0]]}
    assert out["planned_bytes"] == {"0": planned} and planned > 30e9  # the real 0.5B size, not a scaled one
    assert out["commands"]["learner"][-5:] == ["learner", "--config", "gpu_single", "--steps", "2"]
    run = out["commands"]["run"]
    assert run[1].endswith(os.path.join("launch", "run.py")) and "--config.runtime.total_steps=3" in run
    assert run[2].endswith(os.path.join("configs", "gpu_single.py"))
    assert "runs" not in os.listdir(ROOT) or not any(n.startswith("bench_memory_device")
                                                     for n in os.listdir(os.path.join(ROOT, "runs")))


def test_an_unknown_config_is_named():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "bench.py"), "memory", "--device", "--dry-run",
                        "--config", "demo"], capture_output=True, text=True, timeout=300,
                       env=child_env(JAX_PLATFORMS="cpu"))
    assert p.returncode != 0 and "'demo' is not a shipped accelerator config" in p.stderr


def test_colocated_roles_add_up_and_each_device_counts_only_its_roles():
    cfg, arch, _ = load("gpu_single")
    layout = Layout((0,), ((0,), (1,)))
    got = {"learner": {"peaks": {"0": 30, "1": 1}}, "servers": {"peaks": {"0": 12, "1": 20}}}
    rows = rows_of(cfg, arch, layout, got)
    assert [(r["device"], r["role"], r["measured_bytes"]) for r in rows] == [(0, "learner+server0", 42),
                                                                           (1, "server1", 20)]
    rows = rows_of(cfg, arch, layout, {"learner": {"error": "boom"}, "servers": {"peaks": {"0": 5, "1": 6}}})
    assert rows[0]["learner_peak_bytes"] is None and rows[0]["measured_bytes"] == 5
