"""bench accel: its dry run (the plan), its summary of children's results, and (slow) the tiny run end to end."""

import json
import os
import subprocess
import sys

import pytest

from laminar_jax.benchmarks import accel
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = ["decode_0.5b", "decode_1.5b", "engine_long_tail", "learner_publish", "learner_no_publish", "learner_plan"]


def test_dry_run_prints_the_plan(capsys):
    out = accel.main(["--dry-run"])
    assert [p["name"] for p in out["plan"]] == NAMES
    plan = {p["name"]: p for p in out["plan"]}
    assert "qwen2.5-0.5b" in plan["decode_0.5b"]["args"] and "qwen2.5-1.5b" in plan["decode_1.5b"]["args"]
    assert plan["decode_1.5b"]["args"][plan["decode_1.5b"]["args"].index("--rows") + 1] == "64"
    learner = plan["learner_publish"]["args"]
    assert learner[learner.index("--seq") + 1] == "2048" and "bfloat16" in learner
    assert "--no-publish" in plan["learner_no_publish"]["args"] and "--no-publish" not in learner
    assert plan["learner_plan"]["cpu_only"]
    # Every child has a cap (a hung child cannot eat the device lease); the expected run is under 8 min.
    assert sum(p["timeout_s"] for p in out["plan"]) <= 660
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1])["dry_run"] is True
    assert accel.main(["--dry-run", "--tiny"])["plan"][0]["args"][1] == "tiny"


def test_only_rejects_unknown_names():
    with pytest.raises(SystemExit, match="unknown"):
        accel.main(["--dry-run", "--only", "decode_7b"])


def test_summary_flattens_children_and_checks_goals():
    subs = {"decode_1.5b": {"result": {"decode_step_s_b64": 0.004, "decode_roofline_frac": 0.55}, "compile_s": 12.0},
            "learner_publish": {"result": {"mfu": 0.3, "step_s": 2.0}, "compile_s": 40.0, "peak_mem_gb": 60.0},
            "learner_no_publish": {"result": {"mfu": 0.35, "step_s": 1.7}},
            "learner_plan": {"result": {"plan_gb": 50.0}},
            "engine_long_tail": {"error": "timed out after 150 s", "tail": ""}}
    s = accel.summarize(subs)
    assert s["decode_step_ms_1.5b"] == pytest.approx(4.0) and s["decode_compile_s_1.5b"] == 12.0
    assert s["decode_step_ms_0.5b"] is None and s["engine_tokens_per_s"] is None
    assert s["learner_peak_over_plan"] == pytest.approx(1.2)
    assert s["goals"] == {"decode_roofline_frac_1.5b>=0.5": True, "learner_mfu>=0.4": False}
    assert s["failed"] == {"engine_long_tail": "timed out after 150 s"}


@pytest.mark.slow  # ~60 s on an idle 2-core CPU (six child processes, each importing jax and compiling)
def test_tiny_runs_every_sub_measurement():
    res = subprocess.run([sys.executable, "launch/bench.py", "accel", "--tiny"], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["failed"] == {}, out["failed"]
    assert set(out["subs"]) == set(NAMES)
    assert out["decode_step_ms_0.5b"] > 0 and out["engine_tokens_per_s"] > 0
    assert out["learner_step_s_no_publish"] > 0 and out["learner_plan_gb"] > 0
    assert all(out["subs"][n]["compile_s"] > 0 for n in NAMES)
