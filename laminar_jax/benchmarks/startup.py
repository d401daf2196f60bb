"""Start-up benchmark: time spent compiling in a cold run vs a run that finds the persistent
compilation cache (runtime.compilation_cache_dir) filled by the first.

    python launch/bench.py startup [--config demo] [--set runtime.total_steps=10 ...] [--runs 2]
    python launch/bench.py startup --depths 4,28 [--repeats 3]   (compile time against depth: startup_depth.py)

Each run is a fresh process (as a user's would be) with its own empty-at-start cache directory
shared by the runs. Compile time is what JAX's own monitoring events report: tracing, lowering,
and backend compilation (which, on a cache hit, is the cache read). Before the runs it times a fresh
interpreter importing the runtime (`import_s`, median of 3): every process of a run (the CLI, each
Ray actor, each rollout or relay process) pays that before its first line of work. Prints one row
per run with the load average, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from laminar_jax.benchmarks.machine import emit
from laminar_jax.benchmarks.startup_depth import EVENTS
from laminar_jax.benchmarks.startup_depth import main as depth_main


def _child(config: str, sets: list[str], cache_dir: str) -> dict:
    """One run in this process: sum JAX's compile events while the configured runtime runs."""
    import jax.monitoring

    from laminar_jax.compile_cache import enable_compilation_cache
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.runtime import run

    totals = dict.fromkeys(EVENTS.values(), 0.0)
    hits = [0]

    def on_duration(event, duration, **_):
        if event in EVENTS:
            totals[EVENTS[event]] += duration

    def on_event(event, **_):
        hits[0] += event == "/jax/compilation_cache/cache_hits"

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    name, _, variant = config.partition(":")
    cd = repo_config(name, variant)
    for item in sets:
        key, _, value = item.partition("=")
        section, field = key.split(".")
        old = getattr(getattr(cd, section), field)
        setattr(getattr(cd, section), field, type(old)(json.loads(value)) if old is not None else json.loads(value))
    cd.runtime.compilation_cache_dir = cache_dir
    cd.runtime.progress = False
    cd.runtime.timeline = False
    cd.runtime.run_dir = tempfile.mkdtemp(prefix="laminar-startup-")
    cfg = finalize(cd)
    enable_compilation_cache(cfg.runtime.compilation_cache_dir)
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    shutil.rmtree(cfg.runtime.run_dir, ignore_errors=True)
    return {**totals, "compile_s": sum(totals.values()), "cache_hits": hits[0], "wall_s": wall}


IMPORT_REPEATS = 3  # fresh interpreters timed for import_s (its median)


def import_seconds(repeats: int = IMPORT_REPEATS) -> float:
    """Median wall seconds of a fresh interpreter importing what launch/run.py imports (the runtime)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import laminar_jax.runtime"], check=True, capture_output=True,
                       timeout=300)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py startup", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="demo", help="configs/<name>.py[:variant]")
    ap.add_argument("--set", action="append", default=[], help="section.key=JSON value (repeatable)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="demo:short instead of the full demo")
    ap.add_argument("--depths", default=None,
                    help="e.g. 4,28: compile time of the learner step and the engine at each depth of a tiny-width "
                         "model, cache off (benchmarks/startup_depth.py)")
    ap.add_argument("--repeats", type=int, default=3, help="with --depths: fresh processes per depth (medians)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.depths:
        return depth_main(tuple(int(x) for x in args.depths.split(",")), args.repeats)
    if args.child:
        print("STARTUP " + json.dumps(_child(args.config, args.set, args.child)), flush=True)
        return {}
    config = "demo:short" if args.quick and args.config == "demo" else args.config
    import ml_dtypes  # its version sets most of import_s (pyproject.toml says why it is pinned)

    import_s = import_seconds()
    print(f"a fresh process imports the runtime in {import_s:.2f} s (median of {IMPORT_REPEATS}; ml_dtypes "
          f"{ml_dtypes.__version__}), load {[round(x, 2) for x in os.getloadavg()]}", flush=True)
    cache = tempfile.mkdtemp(prefix="laminar-jax-cache-")
    rows = []
    try:
        for i in range(args.runs):
            cmd = [sys.executable, "-m", "laminar_jax.benchmarks.startup", "--config", config, "--child", cache]
            cmd += [f"--set={s}" for s in args.set]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            line = next((x for x in out.stdout.splitlines() if x.startswith("STARTUP ")), None)
            if out.returncode != 0 or line is None:
                raise RuntimeError(f"run {i} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
            row = {"run": i, "cache": "cold" if i == 0 else "warm", **json.loads(line[8:]),
                   "load_avg": [round(x, 2) for x in os.getloadavg()]}
            rows.append(row)
            print(f"run {i} ({row['cache']}): compile {row['compile_s']:.1f} s (trace {row['trace_s']:.1f}, "
                  f"lower {row['lower_s']:.1f}, backend {row['backend_s']:.1f}), {row['cache_hits']} cache hits, "
                  f"wall {row['wall_s']:.1f} s, load {row['load_avg']}", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result = {"bench": "startup", "config": config, "sets": args.set, "import_s": round(import_s, 3),
              "ml_dtypes": ml_dtypes.__version__, "runs": rows,
              "warm_over_cold_compile": rows[-1]["compile_s"] / max(rows[0]["compile_s"], 1e-9) if rows else None}
    return emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
