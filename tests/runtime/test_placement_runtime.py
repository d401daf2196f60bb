"""The local runtime under a placement on a fake 8-device CPU host (the CPU demo, short, 3 steps):
each run completes, loses and repeats no prompt, records its layout in the summary and config.json,
and every array lies on its role's devices (learner state on the learner's, each server's weights
and KV on its own group, disjoint when disaggregated), before the run and after its weight pulls."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "placement_worker.py")


def _run(tmp_path, learner_devices, tp, colocate) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, WORKER, str(learner_devices), str(tp), "true" if colocate else "false", str(tmp_path / "r")]
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def _check_run(out, learner, servers):
    s = out["summary"]
    assert s["steps"] == 3 and s["consumed_prompts"] == 3 * 8
    assert s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["reward_first"] is not None and 0.0 <= s["reward_last"] <= 1.0
    assert s["placement"]["learner"] == out["recorded"]["learner"] == learner
    assert s["placement"]["servers"] == out["recorded"]["servers"] == servers
    for when in ("before", "after"):
        roles = out["roles"][when]
        assert roles["learner"] == learner, when
        assert [r["params"] for r in roles["servers"]] == servers, when
        assert [r["state"] for r in roles["servers"]] == servers, when


@pytest.mark.slow
def test_disaggregated_tp2(tmp_path):
    out = _run(tmp_path, 4, 2, False)
    _check_run(out, [0, 1, 2, 3], [[4, 5], [6, 7]])


@pytest.mark.slow
def test_disaggregated_tp1_derives_four_servers(tmp_path):
    out = _run(tmp_path, 4, 1, False)
    _check_run(out, [0, 1, 2, 3], [[4], [5], [6], [7]])


@pytest.mark.slow
def test_colocated_on_all_eight(tmp_path):
    out = _run(tmp_path, "all", 2, True)
    _check_run(out, list(range(8)), [[0, 1], [2, 3]])
