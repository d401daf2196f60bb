"""Determinism, the zero-skew sanity check, the planner and calibration."""

import json

import pytest

from laminar_jax.configlib import ConfigError
from laminar_jax.sim import SimSection, finalize_sim, simulate
from laminar_jax.sim.calibrate import fit, load_calibration, save_calibration
from laminar_jax.sim.cost import CostModel, CostParams
from laminar_jax.sim.hardware import gpu_spec, model_shape
from laminar_jax.sim.planner import learner_grid, search_mode

SMALL = dict(model="qwen2.5-0.5b", gpus=64, learner_gpus=48, duration_s=700.0, warmup_s=150.0)
MODES = [("sync", True), ("one_step", True), ("stream", True), ("partial_rollout", True),
         ("laminar", False), ("laminar", True)]


def test_deterministic_per_seed():
    small = dict(SMALL, duration_s=600.0)
    a = simulate(SimSection(mode="laminar", **small)).to_dict()
    b = simulate(SimSection(mode="laminar", **small)).to_dict()
    c = simulate(SimSection(mode="laminar", seed=1, **small)).to_dict()
    assert a == b
    assert a["tokens_per_s"] != c["tokens_per_s"]


def _throughputs(workload, modes=MODES):
    # A cheap learner (mfu 1, no step overhead) and equal batches (256 prompts = the slots) so that
    # without skew no mode has anything to gain from overlap or draining.
    params = CostParams(learner_mfu=1.0, learner_step_overhead_s=0.0)
    return {f"{m}{'' if rp else '_norepack'}": simulate(SimSection(mode=m, repack=rp, workload=workload,
                                                                   prompts_per_step=256, **SMALL), params).tokens_per_s
            for m, rp in modes}


def test_zero_skew_all_modes_agree_within_12_percent():
    tps = _throughputs("uniform")
    assert min(tps.values()) > 0.88 * max(tps.values()), tps
    skew = _throughputs("math", [("sync", True), ("laminar", True)])
    assert max(skew.values()) > 1.5 * min(skew.values()), skew  # while skew separates them


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="sim.colocate"):
        finalize_sim({"mode": "laminar", "colocate": True})
    with pytest.raises(ConfigError, match="sim.learner_gpus"):
        finalize_sim({"gpus": 16, "learner_gpus": 16})
    with pytest.raises(ConfigError, match="sim.nope"):
        finalize_sim({"nope": 1})


def test_planner_grid_and_search():
    assert learner_grid(64, 8, 8, 1, 3) == [8, 32, 56]
    assert learner_grid(64, 8, 8, 1, 10) == [8, 16, 24, 32, 40, 48, 56]
    base = SimSection(model="qwen2.5-0.5b", gpus=32, duration_s=600.0, warmup_s=100.0)
    row = search_mode(base, "laminar", points=3, refine=1, search_tp=False)
    assert row.result.tokens_per_s == max(t for _, t in row.tried) > 0
    assert len(row.tried) >= 3
    assert row.best.learner_gpus == row.result.learner_gpus


def test_calibration_fit_recovers_known_parameters(tmp_path):
    truth = CostParams(mem_efficiency=0.6, flops_efficiency=0.6, decode_overhead_s=0.007)
    cm = CostModel(model_shape("qwen2.5-7b"), gpu_spec("h100"), truth, 1)
    rows = [{"batch": b, "context": c, "decode_step_s": float(cm.decode_step_s(b, b * c))}
            for b in (1, 8, 32, 64) for c in (512, 4096)]
    eng = tmp_path / "engine.jsonl"
    eng.write_text("table line\n" + json.dumps({"bench": "engine", "rows": rows}) + "\n")
    lrn = tmp_path / "learner.jsonl"
    lrn.write_text(json.dumps({"bench": "learner", "mfu": 0.41}) + "\n")
    cal = fit([str(eng), str(lrn)], "qwen2.5-7b", "h100")
    assert cal["params"]["mem_efficiency"] == pytest.approx(0.6, rel=1e-6)
    assert cal["params"]["decode_overhead_s"] == pytest.approx(0.007, rel=1e-6)
    assert cal["params"]["learner_mfu"] == pytest.approx(0.41)
    path = save_calibration(cal, str(tmp_path / "cal.json"))
    p = load_calibration(path)
    assert p.learner_mfu == pytest.approx(0.41) and p.relay_efficiency == CostParams().relay_efficiency
    fast = simulate(SimSection(mode="laminar", calibration=path, **SMALL))
    slow = simulate(SimSection(mode="laminar", **SMALL))
    assert fast.tokens_per_s != slow.tokens_per_s
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"params": {"warp_factor": 9}}))
    with pytest.raises(ValueError, match="warp_factor"):
        load_calibration(str(bad))


def test_plan_entry_point_with_config_file(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "tiny_sim.py"
    cfg.write_text("from laminar_jax.sim.config import default_sim_config\n\n"
                   "def get_config():\n    cd = default_sim_config()\n    cd.model = 'qwen2.5-0.5b'\n"
                   "    cd.gpus = 32\n    cd.duration_s = 400.0\n    cd.warmup_s = 100.0\n    return cd\n")
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "launch/plan.py", f"--config={cfg}", "--mode", "laminar", "--points", "2",
                          "--no-tp-search"], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "qwen2.5-0.5b on 32 x h800" in out.stdout and "laminar" in out.stdout.splitlines()[-1]
