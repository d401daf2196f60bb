"""The local runtime end to end on the demo's short variant: every mode runs, nothing is lost or
repeated, and a SIGTERM-killed run resumes from its checkpoint without losing or repeating a prompt."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from laminar_jax.config import finalize, repo_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def demo(variant="short"):
    return repo_config("demo", variant)


@pytest.mark.parametrize("mode", ["laminar", "sync"])
def test_demo_short_runs_and_accounts_for_every_prompt(mode, tmp_path):
    from laminar_jax.runtime.local import run_local

    c = demo()
    c.runtime.mode = mode
    c.runtime.run_dir = str(tmp_path / mode)
    s = run_local(finalize(c))
    assert s["steps"] == c.runtime.total_steps and not s["stopped_early"]
    assert s["lost_prompts"] == 0 and s["duplicated_prompts"] == 0
    assert s["consumed_prompts"] == c.runtime.total_steps * c.runtime.prompts_per_step
    assert s["reward_first"] is not None and 0.0 <= s["reward_last"] <= 1.0
    # Generation-side measurements (repack on/off is compared on these in bench e2e).
    assert 0.0 < s["kv_util"] <= 1.0 and 0.0 < s["slot_util"] <= 1.0
    assert s["gen_tokens_per_s"] > 0 and 0.0 < s["latency_p50_s"] <= s["latency_p99_s"]
    assert 0.0 < s["learner_busy_frac"] < 1.0
    if mode == "sync":
        assert s["mean_staleness"] == 0.0  # sync is on-policy by construction
    # Servers swap only once drained: every trajectory's tokens are its one version's.
    assert s["mixed_version_frac"] == 0.0
    # Every server is in this process: versions go through the in-memory hand-off, no relay runs.
    assert s["weights"]["path"] == "handoff"
    assert s["weights"]["versions_handed_off"] >= 2  # the initial version and newer ones (some superseded)
    # Servers on the same device share one placed copy per version (else one per server and version).
    assert 1 <= s["weights"]["placements"] <= s["weights"]["versions_handed_off"]
    for f in ("config.json", "summary.json", "timeline.png"):
        assert os.path.exists(tmp_path / mode / f), f
    assert os.listdir(tmp_path / mode / "tb")


def _run_cmd(run_dir, steps):
    return [sys.executable, os.path.join(ROOT, "launch", "run.py"), f"--config={ROOT}/configs/demo.py:short",
            f"--config.runtime.run_dir={run_dir}", f"--config.runtime.total_steps={steps}",
            "--config.runtime.progress=true",
            "--config.learner.compile_ahead=none"]  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)


def test_sigterm_then_resume_loses_and_repeats_nothing(tmp_path):
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(_run_cmd(run_dir, 8), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    deadline = time.monotonic() + 300
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step    2"):
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(seen[-20:])
    out, _ = proc.communicate(timeout=240)
    first = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0, out
    assert first["stopped_early"] and 2 <= first["steps"] < 8

    # The resumed run computes on its own threads: one XLA CPU thread, no async dispatch.
    proc = subprocess.run(_run_cmd(run_dir, 8) + ["--config.runtime.cpu_threads=1",
                                                  "--config.runtime.cpu_async_dispatch=false"],
                          capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (first["xla_cpu_pool_threads"], first["cpu_async_dispatch"]) == (len(os.sched_getaffinity(0)), True)
    assert (second["xla_cpu_pool_threads"], second["cpu_async_dispatch"]) == (1, False)
    assert second["steps"] == 8 and second["steps_this_run"] == 8 - first["steps"]
    assert second["lost_prompts"] == 0 and second["duplicated_prompts"] == 0
    # Exactly-once: every step consumed 8 distinct prompts, across the kill.
    assert second["consumed_prompts"] == 8 * 8
