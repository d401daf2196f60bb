"""Environment benchmark: what a trivial python tool call costs, sandboxed against unsandboxed.

    python launch/bench.py env --sandbox [--calls 200] [--quick]

One PythonEnv per mode (env.sandbox 'bwrap' with its per-call cgroup where one can be made, 'bwrap'
with rlimits only, and 'none'), each stepping the same tool call, `print(1 + 1)`, one call at a
time; the modes alternate call by call so that all see the same machine load. Each call is a fresh sandbox (laminar_jax/env/sandbox.py). Prints the load average,
one row per mode (calls per second, p50 / p99 latency), then one JSON line last. Goal: sandboxed
p50 <= 50 ms on the project's CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from laminar_jax.benchmarks.machine import emit
from laminar_jax.env.cgroup import sandbox_limits

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call>'
MODES = (("sandboxed", "bwrap"), ("rlimits_only", "bwrap"), ("unsandboxed", "none"))
GOAL_P50_MS = 50.0
WARMUP = 3


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure(calls: int) -> dict:
    """{row name: figures} for `calls` timed tool calls per mode (a mode that cannot run: its reason)."""
    from laminar_jax.env import make_env
    from laminar_jax.env.bwrap import SandboxUnavailable

    envs, rows = {}, {}
    for name, mode in MODES:
        try:
            envs[name] = make_env("python", sandbox=mode, max_turns=1 << 30)  # one endless episode
            if name == "rlimits_only":
                envs[name].limits = envs[name].limits._replace(cgroup=False)
            envs[name].reset({"ground_truth": 2})
        except SandboxUnavailable as e:
            rows[name] = {"sandbox": mode, "unavailable": str(e)}
    times: dict[str, list[float]] = {name: [] for name in envs}
    try:
        for i in range(WARMUP + calls):
            for name, env in envs.items():
                t0 = time.perf_counter()
                obs = env.step(CALL).observation
                dt = time.perf_counter() - t0
                if obs != "2":
                    raise RuntimeError(f"{name}: the tool call returned {obs!r}, expected '2'")
                if i >= WARMUP:
                    times[name].append(dt)
    finally:
        for env in envs.values():
            env.close()
    for name, ts in times.items():
        rows[name] = {"sandbox": dict(MODES)[name], "calls": len(ts), "calls_per_s": round(len(ts) / sum(ts), 2),
                      "p50_ms": round(statistics.median(ts) * 1e3, 2), "p99_ms": round(_percentile(ts, 0.99) * 1e3, 2)}
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py env", description=__doc__.splitlines()[0])
    ap.add_argument("--sandbox", action="store_true", help="time a trivial python tool call, sandboxed vs not")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per mode")
    ap.add_argument("--quick", action="store_true", help="20 calls per mode")
    args = ap.parse_args(argv)
    if not args.sandbox:
        ap.error("nothing to measure: pass --sandbox")
    calls = 20 if args.quick else args.calls
    if calls < 1:
        ap.error(f"--calls must be >= 1, got {calls}")
    load0 = [round(x, 2) for x in os.getloadavg()]
    print(f"{calls} calls per mode, alternating; load {load0}", flush=True)
    rows = measure(calls)
    print(f"{'mode':<12} {'sandbox':<8} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8}  limits")
    limits = {"sandboxed": sandbox_limits(), "rlimits_only": "rlimits: cgroup off", "unsandboxed": "rlimits"}
    for name, r in rows.items():
        r["limits"] = limits[name]
        if "unavailable" in r:
            print(f"{name:<12} {r['sandbox']:<8} unavailable: {r['unavailable']}")
        else:
            print(f"{name:<12} {r['sandbox']:<8} {r['calls_per_s']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}"
                  f"  {r['limits']}")
    sb, un = rows.get("sandboxed", {}), rows.get("unsandboxed", {})
    overhead = round(sb["p50_ms"] - un["p50_ms"], 2) if "p50_ms" in sb and "p50_ms" in un else None
    result = {"bench": "env", "what": "sandbox", "calls": calls, "rows": rows, "p50_overhead_ms": overhead,
              "goal_p50_ms": GOAL_P50_MS, "goal_met": sb.get("p50_ms", float("inf")) <= GOAL_P50_MS,
              "load_avg": [load0, [round(x, 2) for x in os.getloadavg()]]}
    return emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
