"""A reward worker process: JSON lines in on stdin, JSON lines out on a private copy of stdout.

Started by RewardPool as ``python -m laminar_jax.data.reward_worker <module:function>``. Each
request ``{"id", "data_source", "response", "ground_truth", "extra_info"}`` gets one reply
``{"id", "ok", "reward", "error"}``. Scoring runs in this process's main thread, so scorers with
signal-based timeouts (math_verify) work. Exits on stdin EOF or when its parent dies.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time


def _exit_with_parent(parent_pid: int) -> None:
    # A hung scorer never reads stdin again, so EOF alone would not end an orphaned worker.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _score(registry, req: dict) -> dict:
    try:
        reward = registry.score(req["data_source"], req["response"], req["ground_truth"], req.get("extra_info"))
        if not math.isfinite(reward):
            raise ValueError(f"reward is not finite: {reward}")
        return {"id": req["id"], "ok": True, "reward": reward, "error": None}
    except Exception as e:  # the scorer's bug must not kill the worker; the pool counts it
        return {"id": req["id"], "ok": False, "reward": 0.0, "error": f"{type(e).__name__}: {e}"[:2000]}


def main(argv: list[str]) -> int:
    # Keep the protocol channel private: anything a scorer prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    from laminar_jax.data.rewards import load_registry

    try:
        registry = load_registry(argv[0])
    except Exception as e:
        out.write(json.dumps({"fatal": f"cannot load reward registry {argv[0]!r}: {type(e).__name__}: {e}"}) + "\n")
        return 2
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(_score(registry, json.loads(line))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
