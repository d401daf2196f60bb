"""A reward worker process: JSON lines in on stdin, JSON lines out on a private copy of stdout.

Started by RewardPool as ``python -m laminar_jax.data.reward_worker <module:function>``. Each
request ``{"id", "data_source", "response", "ground_truth", "extra_info"}`` gets one reply
``{"id", "ok", "reward", "error"}``. Scoring runs in this process's main thread, so scorers with
signal-based timeouts (math_verify) work. Exits on stdin EOF or when its parent dies: the kernel
SIGKILLs it when the thread that started it exits (PR_SET_PDEATHSIG, which works even while a
scorer holds the GIL in C code), and a watchdog thread checks the parent pid as a second guard.

A reward must be a finite number within float32's range (the learner computes in float32; 1e300
would become inf there): anything else is a reward failure, scored 0.0.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import sys
import threading
import time

FLOAT32_MAX = 3.4028234663852886e38
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent goes; exit now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog thread remains
        pass
    if os.getppid() != parent_pid:
        os._exit(3)


def check_reward(reward: float) -> float:
    """``reward`` if finite and representable in float32, else ValueError naming it."""
    if not math.isfinite(reward) or abs(reward) > FLOAT32_MAX:
        raise ValueError(f"reward {reward!r} is not finite in float32 (|r| must be <= {FLOAT32_MAX:.4g})")
    return reward


def _exit_with_parent(parent_pid: int) -> None:
    # A hung scorer never reads stdin again, so EOF alone would not end an orphaned worker.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _score(registry, req: dict) -> dict:
    try:
        reward = check_reward(registry.score(req["data_source"], req["response"], req["ground_truth"],
                                             req.get("extra_info")))
        return {"id": req["id"], "ok": True, "reward": reward, "error": None}
    except Exception as e:  # the scorer's bug must not kill the worker; the pool counts it
        return {"id": req["id"], "ok": False, "reward": 0.0, "error": f"{type(e).__name__}: {e}"[:2000]}


def main(argv: list[str]) -> int:
    # Keep the protocol channel private: anything a scorer prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    parent = int(argv[1]) if len(argv) > 1 else os.getppid()
    die_with_parent(parent)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    from laminar_jax.data.rewards import load_registry

    try:
        registry = load_registry(argv[0])
    except Exception as e:
        out.write(json.dumps({"fatal": f"cannot load reward registry {argv[0]!r}: {type(e).__name__}: {e}"}) + "\n")
        return 2
    for error in registry.warm_up():  # before "ready": the pool's start deadline covers it, not a reward's
        print(f"reward worker {os.getpid()}: {error}", file=sys.stderr)
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(_score(registry, json.loads(line))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
