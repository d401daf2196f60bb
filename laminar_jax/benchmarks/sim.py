"""Simulated reproduction of the Laminar set-up: Qwen2.5-7B/32B/72B on 64-1024 H800s, math workload.

  python launch/bench.py sim [--quick] [--workers 2] [--doc]

Every mode runs at its best placement from the planner (laminar_jax.sim.planner): the highest
throughput whose staleness stays within sim.max_mean_staleness / sim.max_p99_staleness
(laminar_unbounded is exempt and labelled). Each (model, GPUs, mode) search runs in a worker
subprocess that answers with one JSON line; workers die with the bench (PR_SET_PDEATHSIG on Linux,
and each worker also exits when its parent is gone). Prints the table, writes docs/SIMULATION.md's
table section (full run, or --doc), renders a timeline PNG, and prints the JSON result as the last line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from laminar_jax.benchmarks.machine import emit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "SIMULATION.md")
BEGIN, END = "<!-- sim-table:begin -->", "<!-- sim-table:end -->"
BASELINES = ("sync", "one_step", "stream", "partial_rollout")
MODES = "sync,one_step,stream,partial_rollout,laminar,laminar_norepack,laminar_unbounded,inflight,inflight_reprefill"
PR_SET_PDEATHSIG = 1


def _grid(args) -> tuple[list[str], list[int], dict]:
    if args.quick:
        return ["qwen2.5-7b"], [64, 256], dict(points=3, refine=1, search_tp=False, duration=args.duration)
    models = args.models.split(",")
    gpus = [int(g) for g in args.gpus.split(",")]
    return models, gpus, dict(points=3, refine=1, search_tp=True, duration=args.duration)


def _task(spec: dict) -> dict:
    """One planner search (runs inside a worker subprocess)."""
    from laminar_jax.sim import SimSection
    from laminar_jax.sim.planner import search_mode

    base = SimSection(model=spec["model"], gpus=spec["gpus"], gpu=spec["gpu"], workload="math",
                      duration_s=spec["duration"], warmup_s=min(300.0, spec["duration"] / 4), min_steps=3,
                      calibration=spec.get("calibration"))
    t0 = time.process_time()
    row = search_mode(base, spec["mode"], points=spec["points"], refine=spec["refine"],
                      search_tp=spec["search_tp"])
    r = row.result
    return {"model": spec["model"], "gpus": spec["gpus"], "mode": spec["mode"], "tokens_per_s": r.tokens_per_s,
            "learner_gpus": r.learner_gpus, "rollout_tp": r.rollout_tp, "colocate": row.best.colocate,
            "inflight": row.best.inflight, "target": row.label,
            "rollout_idle": r.rollout_idle, "learner_idle": r.learner_idle, "gpu_idle": r.gpu_idle,
            "kv_util": r.kv_util, "mean_staleness": r.mean_staleness, "p99_staleness": r.p99_staleness,
            "staleness_hist": r.staleness_hist,
            "pull_latency_s": r.pull_latency_mean_s, "moves": r.moves, "sims": len(row.tried),
            "cpu_s": time.process_time() - t0}


def _die_with_parent() -> None:
    """In the worker, before exec: the kernel sends SIGKILL when the bench process dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the worker's own parent watch (_watch_parent) still applies


def _watch_parent(parent: int, period_s: float = 1.0) -> None:
    """Worker side: exit as soon as the process that started us is gone (reparented)."""
    def loop():
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(3)

    threading.Thread(target=loop, daemon=True, name="sim-parent-watch").start()


def _spawn(log) -> subprocess.Popen:
    """A worker process serving planner searches: one JSON spec per stdin line, one JSON line back."""
    return subprocess.Popen([sys.executable, "-m", "laminar_jax.benchmarks.sim", "--serve",
                             "--parent", str(os.getpid())], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=_die_with_parent)


def _serve() -> None:
    """Worker side of _run_tasks: answer each spec line with its result (or the error) as JSON."""
    import traceback

    for line in sys.stdin:
        try:
            res = _task(json.loads(line))
        except Exception:  # reported to the bench, which stops
            res = {"error": traceback.format_exc()}
        print(json.dumps(res), flush=True)


def _feed(proc: subprocess.Popen, tasks: "queue.Queue[dict]", out: list, errors: list) -> None:
    """Bench side, one thread per worker: hand it the next spec whenever it answers."""
    while not errors:
        try:
            spec = tasks.get_nowait()
        except queue.Empty:
            return
        try:
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, ValueError, OSError) as e:
            errors.append(f"task {spec}: worker pipe failed ({e})")
            return
        res = json.loads(line) if line.strip() else {"error": f"worker exited (code {proc.poll()})"}
        if "error" in res:
            errors.append(f"task {spec} failed:\n{res['error'][-3000:]}")
            return
        out.append(res)
        print(f"  {res['model']:12s} {res['gpus']:5d} {res['mode']:17s} {res['tokens_per_s']:12.0f} tok/s "
              f"staleness {res['mean_staleness']:.2f} ({res['sims']} sims, {res['cpu_s']:.0f} cpu s)", flush=True)


def _run_tasks(specs: list[dict], workers: int, timeout_s: float = 3600.0) -> list[dict]:
    """Run specs on `workers` long-lived worker processes (each imports the simulator once). Any
    failure, timeout or interruption kills the workers; they also die with this process."""
    tasks: queue.Queue[dict] = queue.Queue()
    for spec in specs:
        tasks.put(spec)
    out: list[dict] = []
    errors: list[str] = []
    with tempfile.TemporaryFile("w+") as log:
        procs = [_spawn(log) for _ in range(max(1, min(workers, len(specs))))]
        try:
            threads = [threading.Thread(target=_feed, args=(p, tasks, out, errors), daemon=True) for p in procs]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in threads):
                errors.append(f"sim bench: tasks did not finish within {timeout_s:.0f} s")
            if errors:
                log.seek(0)
                raise RuntimeError("sim bench: " + errors[0] + "\nworker stderr (tail):\n" + log.read()[-2000:])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
    return out


def _speedups(rows: list[dict]) -> None:
    for r in rows:
        same = [x for x in rows if x["model"] == r["model"] and x["gpus"] == r["gpus"]]
        sync = next((x["tokens_per_s"] for x in same if x["mode"] == "sync"), float("nan"))
        best_base = max((x["tokens_per_s"] for x in same if x["mode"] in BASELINES), default=float("nan"))
        r["speedup_vs_sync"] = r["tokens_per_s"] / sync if sync > 0 else float("nan")
        r["speedup_vs_best_baseline"] = r["tokens_per_s"] / best_base if best_base > 0 else float("nan")


def format_rows(rows: list[dict]) -> str:
    head = ("| model | GPUs | mode | learner GPUs | TP | inflight | tokens/s | vs sync | vs best baseline | "
            "mean staleness | p99 staleness | staleness target | rollout idle | learner idle | KV util |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        split = "coloc" if r["colocate"] else str(r["learner_gpus"])
        infl = "-" if r.get("inflight") is None else str(r["inflight"])
        lines.append(f"| {r['model']} | {r['gpus']} | {r['mode']} | {split} | {r['rollout_tp']} | {infl} | "
                     f"{r['tokens_per_s']:,.0f} | {r['speedup_vs_sync']:.2f} | {r['speedup_vs_best_baseline']:.2f} | "
                     f"{r['mean_staleness']:.2f} | {r['p99_staleness']:.0f} | {r['target']} | "
                     f"{r['rollout_idle']:.2f} | {r['learner_idle']:.2f} | {r['kv_util']:.2f} |")
    return "\n".join(lines)


def _write_doc(table: str, meta: str) -> None:
    block = f"{BEGIN}\n{meta}\n\n{table}\n{END}"
    text = open(DOC).read() if os.path.exists(DOC) else f"# Simulation\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text += "\n" + block + "\n"
    with open(DOC, "w") as f:
        f.write(text)


def _hour_at_1024(rows: list[dict], calibration) -> dict:
    """Wall and CPU time of one simulated hour of laminar (7B) on 1024 GPUs at its planned split."""
    from laminar_jax.sim import SimSection, simulate

    best = next((r for r in rows if r["model"] == "qwen2.5-7b" and r["gpus"] == 1024 and r["mode"] == "laminar"),
                None)
    lg = best["learner_gpus"] if best else 512
    inflight = best["inflight"] if best and best.get("inflight") else SimSection.max_inflight_batches
    cfg = SimSection(model="qwen2.5-7b", gpus=1024, gpu="h800", mode="laminar", learner_gpus=lg,
                     rollout_tp=best["rollout_tp"] if best else None, max_inflight_batches=inflight,
                     duration_s=3600.0, warmup_s=600.0, calibration=calibration)
    w0, c0 = time.perf_counter(), time.process_time()
    res = simulate(cfg)
    return {"hour_1024_wall_s": time.perf_counter() - w0, "hour_1024_cpu_s": time.process_time() - c0,
            "hour_1024_tokens_per_s": res.tokens_per_s, "hour_1024_learner_gpus": lg,
            "hour_1024_loadavg": os.getloadavg()[0]}


def _timeline(out_dir: str, calibration) -> str:
    from laminar_jax.sim import SimSection, simulate

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "timeline_laminar_7b_64.png")
    cfg = SimSection(model="qwen2.5-7b", gpus=64, gpu="h800", mode="laminar", learner_gpus=32, duration_s=1200.0,
                     warmup_s=300.0, timeline_servers=16, calibration=calibration)
    simulate(cfg, timeline_path=path)
    return path


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="7B on 64 and 256 GPUs, coarse search (< 2 min)")
    ap.add_argument("--models", default="qwen2.5-7b,qwen2.5-32b,qwen2.5-72b")
    ap.add_argument("--gpus", default="64,256,1024")
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--duration", type=float, default=900.0, help="simulated seconds per candidate (at least)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "sim_bench"))
    ap.add_argument("--doc", action="store_true", help="write docs/SIMULATION.md even with --quick")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:  # worker subprocess
        if args.parent:
            _watch_parent(args.parent)
        _serve()
        return {}
    # SIGTERM unwinds like Ctrl-C, so _run_tasks' cleanup kills the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    models, gpus, opts = _grid(args)
    modes = args.modes.split(",")
    specs = [dict(model=m, gpus=g, gpu="h800", mode=mode, calibration=args.calibration, **opts)
             for m in models for g in gpus for mode in modes]
    # Biggest first so the two workers finish together.
    specs.sort(key=lambda s: -s["gpus"])
    rows = _run_tasks(specs, args.workers)
    order = {(m, g, mode): i for i, (m, g, mode) in enumerate((m, g, mode) for m in models for g in gpus
                                                               for mode in modes)}
    rows.sort(key=lambda r: order[(r["model"], r["gpus"], r["mode"])])
    _speedups(rows)
    table = format_rows(rows)
    result = {"bench": "sim", "quick": args.quick, "workload": "math", "gpu": "h800", "rows": rows}
    if not args.quick:
        result.update(_hour_at_1024(rows, args.calibration))
    result["timeline_png"] = _timeline(args.out, args.calibration)
    result["sim_wall_s"] = time.perf_counter() - t0
    result["loadavg_start"], result["loadavg_end"] = load0, os.getloadavg()[0]
    result["worker_cpu_s"] = sum(r["cpu_s"] for r in rows)  # load-independent cost of the searches
    print(table)
    print(f"bench sim: {result['sim_wall_s']:.0f} s wall ({result['worker_cpu_s']:.0f} s of search CPU in the "
          f"workers), load average {load0:.2f} at start, {result['loadavg_end']:.2f} at end", flush=True)
    if not args.quick or args.doc:
        meta = (f"Generated by `python launch/bench.py sim{' --quick' if args.quick else ''}` in "
                f"{result['sim_wall_s']:.0f} s wall on this 2-core machine (load average {load0:.1f} at start, "
                f"{result['loadavg_end']:.1f} at end; H800 presets, math workload, "
                f"default cost parameters{' + ' + args.calibration if args.calibration else ''}).")
        if "hour_1024_wall_s" in result:
            meta += (f" One simulated hour of laminar 7B on 1024 GPUs took {result['hour_1024_wall_s']:.1f} s wall "
                     f"({result['hour_1024_cpu_s']:.1f} s CPU, load average {result['hour_1024_loadavg']:.1f}).")
        _write_doc(table, meta)
    return emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
