"""Entry points: plan.py's help, and the sim bench's worker processes dying with the bench."""

import os
import signal
import subprocess
import sys
import time

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_plan_help_lists_valid_values():
    out = subprocess.run([sys.executable, "launch/plan.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for value in ("qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "h800", "h100", "a100", "math", "agentic",
                  "laminar_unbounded", "--max-mean-staleness"):
        assert value in text, value
    # The example config the help cites exists.
    assert "laminar_jax/sim/example_config.py" in text
    assert os.path.exists(os.path.join(ROOT, "laminar_jax", "sim", "example_config.py"))


def test_plan_rejects_unknown_model_naming_it():
    out = subprocess.run([sys.executable, "launch/plan.py", "--model", "gpt-5", "--gpus", "16"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--model" in out.stderr and "qwen2.5-7b" in out.stderr


def _children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(x) for x in f.read().split()}
    except FileNotFoundError:
        return set()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_bench_workers_die_when_the_bench_is_killed(tmp_path):
    bench = subprocess.Popen([sys.executable, "launch/bench.py", "sim", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and bench.poll() is None:
            workers |= _children(bench.pid)
            time.sleep(0.2)
        assert len(workers) == 2, f"the bench did not start its 2 workers (children: {workers})"
        bench.send_signal(signal.SIGKILL)  # no cleanup code runs in the bench itself
        bench.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), "sim bench workers outlived the bench"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
