"""Simulated reproduction of the Laminar set-up: Qwen2.5-7B/32B/72B on 64-1024 H800s, math workload.

  python launch/bench.py sim [--quick] [--workers 2] [--doc]

Every mode runs at its best placement from the planner (laminar_jax.sim.planner). Each
(model, GPUs, mode) search runs in a worker subprocess that answers with one JSON line. Prints the
table, writes docs/SIMULATION.md's table section (full run, or --doc), renders a timeline PNG, and
prints the JSON result as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "SIMULATION.md")
BEGIN, END = "<!-- sim-table:begin -->", "<!-- sim-table:end -->"
BASELINES = ("sync", "one_step", "stream", "partial_rollout")


def _grid(args) -> tuple[list[str], list[int], dict]:
    if args.quick:
        return ["qwen2.5-7b"], [64, 256], dict(points=3, refine=1, search_tp=False, duration=900.0)
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
            "rollout_idle": r.rollout_idle, "learner_idle": r.learner_idle, "gpu_idle": r.gpu_idle,
            "kv_util": r.kv_util, "mean_staleness": r.mean_staleness, "staleness_hist": r.staleness_hist,
            "pull_latency_s": r.pull_latency_mean_s, "moves": r.moves, "sims": len(row.tried),
            "cpu_s": time.process_time() - t0}


def _run_tasks(specs: list[dict], workers: int) -> list[dict]:
    """Run specs in `workers` subprocesses (JSON in via argv, one JSON line out)."""
    pending, running, out = list(specs), [], []
    while pending or running:
        while pending and len(running) < workers:
            spec = pending.pop(0)
            p = subprocess.Popen([sys.executable, "-m", "laminar_jax.benchmarks.sim", "--task", json.dumps(spec)],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            running.append((spec, p))
        spec, p = running.pop(0)
        try:
            stdout, stderr = p.communicate(timeout=3600)
        except subprocess.TimeoutExpired:
            p.kill()
            raise RuntimeError(f"sim bench: task {spec} did not finish within 3600 s")
        if p.returncode != 0:
            raise RuntimeError(f"sim bench: task {spec} failed:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
        print(f"  {out[-1]['model']:12s} {out[-1]['gpus']:5d} {out[-1]['mode']:16s} "
              f"{out[-1]['tokens_per_s']:12.0f} tok/s ({out[-1]['sims']} sims, {out[-1]['cpu_s']:.0f} cpu s)",
              flush=True)
    return out


def _speedups(rows: list[dict]) -> None:
    for r in rows:
        same = [x for x in rows if x["model"] == r["model"] and x["gpus"] == r["gpus"]]
        sync = next((x["tokens_per_s"] for x in same if x["mode"] == "sync"), float("nan"))
        best_base = max((x["tokens_per_s"] for x in same if x["mode"] in BASELINES), default=float("nan"))
        r["speedup_vs_sync"] = r["tokens_per_s"] / sync if sync > 0 else float("nan")
        r["speedup_vs_best_baseline"] = r["tokens_per_s"] / best_base if best_base > 0 else float("nan")


def format_rows(rows: list[dict]) -> str:
    head = ("| model | GPUs | mode | learner GPUs | TP | tokens/s | vs sync | vs best baseline | rollout idle "
            "| learner idle | KV util | mean staleness |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        split = "coloc" if r["colocate"] else str(r["learner_gpus"])
        lines.append(f"| {r['model']} | {r['gpus']} | {r['mode']} | {split} | {r['rollout_tp']} | "
                     f"{r['tokens_per_s']:,.0f} | {r['speedup_vs_sync']:.2f} | {r['speedup_vs_best_baseline']:.2f} | "
                     f"{r['rollout_idle']:.2f} | {r['learner_idle']:.2f} | {r['kv_util']:.2f} | "
                     f"{r['mean_staleness']:.1f} |")
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
    cfg = SimSection(model="qwen2.5-7b", gpus=1024, gpu="h800", mode="laminar", learner_gpus=lg,
                     duration_s=3600.0, warmup_s=600.0, calibration=calibration)
    w0, c0 = time.perf_counter(), time.process_time()
    res = simulate(cfg)
    return {"hour_1024_wall_s": time.perf_counter() - w0, "hour_1024_cpu_s": time.process_time() - c0,
            "hour_1024_tokens_per_s": res.tokens_per_s, "hour_1024_learner_gpus": lg}


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
    ap.add_argument("--modes", default="sync,one_step,stream,partial_rollout,laminar,laminar_norepack,laminar_bounded")
    ap.add_argument("--duration", type=float, default=1200.0, help="simulated seconds per candidate (at least)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "sim_bench"))
    ap.add_argument("--doc", action="store_true", help="write docs/SIMULATION.md even with --quick")
    ap.add_argument("--task", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.task:  # worker subprocess
        res = _task(json.loads(args.task))
        print(json.dumps(res))
        return res
    t0 = time.perf_counter()
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
    print(table)
    if not args.quick or args.doc:
        meta = (f"Generated by `python launch/bench.py sim{' --quick' if args.quick else ''}` in "
                f"{result['sim_wall_s']:.0f} s wall on this 2-core machine (H800 presets, math workload, "
                f"default cost parameters{' + ' + args.calibration if args.calibration else ''}).")
        if "hour_1024_wall_s" in result:
            meta += (f" One simulated hour of laminar 7B on 1024 GPUs took {result['hour_1024_wall_s']:.1f} s wall "
                     f"({result['hour_1024_cpu_s']:.1f} s CPU).")
        _write_doc(table, meta)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
