"""Rollout engine benchmark on a long-tail workload (p99 response length ~ 10x the median).

Side by side, same weights and requests:
  1. this engine, continuous batching;
  2. this engine, static batches (fill every slot, wait for the whole batch, repeat);
  3. HF transformers ``generate`` (torch CPU), static left-padded batches, each run to its longest request.
Response lengths are forced (stop ids off; each request stops at its own drawn max_new_tokens), so
every system produces exactly the same useful tokens. Greedy decoding everywhere.

It also times one decode step at batch 64 (``decode_step_s_b64``) and, on a GPU with a known HBM
bandwidth, compares it with the roofline (bytes of weights + live KV read per step / bandwidth) as
``decode_roofline_frac`` (null on CPU). ``--profile`` runs the decode-step breakdown of
engine_profile.py instead.

    python -m laminar_jax.benchmarks.engine --quick
    python -m laminar_jax.benchmarks.engine --preset qwen2.5-0.5b --dtype bfloat16   # GPU
    python -m laminar_jax.benchmarks.engine --host-overhead   # host cost per decode call / token (host_overhead.py)

``--group G`` gives every prompt G requests (a GRPO group: same prompt, own response lengths) and
adds, alternating with the continuous run, the same run with ``rollout.share_prompt_kv=False``
(every sample prefilled): ``share_gain`` is the tokens/s ratio, with CPU-seconds per 1k tokens of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from laminar_jax.benchmarks.engine_profile import run_profile, time_generate
from laminar_jax.benchmarks.machine import emit
from laminar_jax.matmul_precision import apply_matmul_precision

# Peak HBM bandwidth (bytes/s) by device kind substring.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 0.3e12}


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list  # list[list[int]]
    max_new: list  # list[int]: the forced response length of each request


def make_workload(n: int, median: int, cap: int, vocab: int, seed: int = 0,
                  prompt_range: tuple[int, int] = (8, 32)) -> Workload:
    """Lognormal response lengths with sigma = ln(10)/z_0.99, so p99 ~ 10x median; capped at ``cap``."""
    rng = np.random.default_rng(seed)
    sigma = np.log(10.0) / 2.326
    lengths = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), 1, cap).astype(int)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(*prompt_range))).tolist() for _ in range(n)]
    return Workload(prompts, lengths.tolist())


def grouped(wl: Workload, group: int) -> Workload:
    """The same response lengths, every ``group`` consecutive requests on one prompt."""
    return Workload([wl.prompts[i // group] for i in range(len(wl.prompts))], wl.max_new)


def _summary(name: str, wall: float, latencies: list, tokens: int, cpu_s: float = 0.0) -> dict:
    lat = np.asarray(latencies)
    return {"name": name, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "cpu_ms_per_1k_tokens": 1e6 * cpu_s / max(tokens, 1),
            "p50_latency_s": float(np.percentile(lat, 50)), "p99_latency_s": float(np.percentile(lat, 99))}


def run_engine(model, section, wl: Workload, name: str) -> dict:
    from laminar_jax.rollout import Request, RolloutServer, SamplingParams, make_engine
    from laminar_jax.rollout.warmup import warmup

    engine, params = make_engine(model, section)

    def requests(tag):
        return [Request(uid=f"{tag}{i}", prompt_ids=p, seed=i,
                        sampling=SamplingParams(temperature=0.0, max_new_tokens=m, stop_token_ids=()))
                for i, (p, m) in enumerate(zip(wl.prompts, wl.max_new))]

    # Warm-up: compile every prefill bucket and generate() variant, then run a throwaway server (same programs).
    t_warm = time.perf_counter()
    warmup(engine, params)
    print(f"{name}: warm-up compiled in {time.perf_counter() - t_warm:.1f} s", flush=True)
    warm = RolloutServer(engine, params)
    for r in requests("w")[:section.num_slots]:
        warm.submit(dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=2)))
    while not warm.idle():
        warm.step()
    server = RolloutServer(engine, params)
    reqs = requests("r")
    t0, c0 = time.perf_counter(), time.process_time()
    for r in reqs:
        server.submit(r)
    latencies, tokens = [], 0
    while len(latencies) < len(reqs):
        for t in server.step():
            latencies.append(time.perf_counter() - t0)
            tokens += len(t.response_ids)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert tokens == sum(wl.max_new), (tokens, sum(wl.max_new))
    return _summary(name, wall, latencies, tokens, cpu)


def run_hf(hf_dir: str, wl: Workload, batch: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    order = list(range(len(wl.prompts)))

    def run_batch(idx, max_new):
        plen = max(len(wl.prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), plen), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):  # left padding
            p = wl.prompts[i]
            ids[row, plen - len(p):] = torch.tensor(p)
            mask[row, plen - len(p):] = 1
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                 min_new_tokens=max_new, pad_token_id=0)
        return out.shape[1] - plen

    # HF gets its best intra-op thread count (torch degrades badly when cores are oversubscribed).
    best = None
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        run_batch(order[:batch], 2)  # warm-up
        # A probe as long as a typical batch: short probes favoured 2 threads, which then ran the
        # whole workload ~3x slower than 1 thread on the shared 2-core box (HF's loss, not ours).
        t = time.perf_counter()
        run_batch(order[:batch], 64)
        dt = time.perf_counter() - t
        if best is None or dt < best[0]:
            best = (dt, threads)
    torch.set_num_threads(best[1])
    t0 = time.perf_counter()
    latencies, tokens = [], 0
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        longest = max(wl.max_new[i] for i in idx)
        produced = run_batch(idx, longest)
        assert produced == longest, (produced, longest)
        done = time.perf_counter() - t0
        latencies += [done] * len(idx)
        tokens += sum(wl.max_new[i] for i in idx)  # useful tokens only: padding to the longest is waste
    return {**_summary("hf_static", time.perf_counter() - t0, latencies, tokens), "torch_threads": best[1]}


def decode_step_b64(model, section, device_kind: str, batch: int = 64, context: int = 512,
                    iters: int = 10) -> dict:
    """Time one generate() step at ``batch`` live slots of ~``context`` tokens; on a GPU with a known
    HBM bandwidth also the roofline fraction (bytes of weights + live KV read per step / bandwidth / step time).

    ``decode_roofline_frac`` is None where the bandwidth is unknown (CPU).
    """
    import jax
    from flax import nnx

    from laminar_jax.rollout import SlotInit, make_engine

    sec = dataclasses.replace(section, num_slots=batch, max_prompt_len=context, max_total_len=context + 64,
                              prefill_buckets=(context,), decode_steps_per_call=1, decode_chunk=0,
                              batching="continuous",
                              num_pages=batch * (-(-(context + 64) // section.page_size)) + 1)
    engine, params = make_engine(model, sec)
    state = engine.init_decode_state()
    prompt = np.arange(context, dtype=np.int32) % 97 + 3
    pre = engine.prefill(params, *engine.schedule.pad_prompt(prompt))
    for slot in range(batch):
        state = engine.insert(pre, state, slot, SlotInit(np.zeros(2, np.uint32), 0.0, 0, 1.0, 60, np.zeros(0)))
    step_s, state = time_generate(engine, params, state, iters, warmup=2)
    c = model.cfg
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    # The live KV actually attended (live_pages reads only that; gather_dense / pool_scan read more).
    kv_bytes = 2 * c.num_layers * batch * (context + iters) * c.num_kv_heads * c.head_dim * np.dtype(engine.kv_dtype).itemsize
    bw = next((v for k, v in HBM_BANDWIDTH.items() if k in device_kind), None)
    roof = None if bw is None else (weight_bytes + kv_bytes) / bw
    return {"decode_step_s_b64": step_s, "decode_context": context, "decode_roofline_s": roof,
            "decode_roofline_frac": None if roof is None else roof / step_s, "hbm_bytes_per_s": bw}


def main(argv: list[str]) -> dict:
    if "--lora" in argv:  # a LoRA version merged at the swap vs unmerged in the decode step (lora_serve.py)
        from laminar_jax.benchmarks.lora_serve import main as lora_main

        return lora_main([a for a in argv if a != "--lora"])
    ap = argparse.ArgumentParser(prog="bench engine")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--median", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--steps-per-call", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=None,
                    help="rollout.decode_chunk (batch compaction; 0 = off); default: 32 from 64 slots up, else 0 "
                         "(a model pass costs ~2 ms fixed on this CPU, so smaller chunks lost in measurements)")
    ap.add_argument("--attention", default="auto", help="rollout.attention_impl")
    ap.add_argument("--live-buckets", default="fine", choices=["fine", "pow2", "pow4"],
                    help="rollout.live_buckets (one compiled generate() per bucket; pow4 compiles fewest)")
    ap.add_argument("--pool-frac", type=float, default=0.5,
                    help="KV pool size as a fraction of slots x pages_per_seq (admission waits when short)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--group", type=int, default=1,
                    help="requests per prompt (GRPO group); > 1 also runs share_prompt_kv=False alongside")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each side of --group's comparison")
    ap.add_argument("--profile", action="store_true",
                    help="only the decode-step profile (matmul vs measured peak, attention, sampling, host) "
                         "at --profile-rows live rows, for float32 and bfloat16 unless --dtype is given")
    ap.add_argument("--profile-rows", default="32,64")
    ap.add_argument("--profile-context", type=int, default=128)
    ap.add_argument("--profile-page-size", type=int, default=64,
                    help="--profile: tokens per KV page (the offline LLM's default; the RL config's is 16)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="--profile: also trace each profiled step with jax.profiler into DIR/<dtype>_<rows> "
                         "and print its time per XLA op (optrace.py)")
    ap.add_argument("--host-overhead", action="store_true",
                    help="only the host's cost per decode call and per generated token, and device calls per "
                         "token, with a model so small compute is negligible, at 1 step per call and at the "
                         "accelerators' default (host_overhead.py)")
    args = ap.parse_args(argv)
    if args.host_overhead:
        from laminar_jax.benchmarks import host_overhead

        return emit(host_overhead.run(slots=args.slots or 8, max_new=args.max_new or 64,
                                      repeats=args.repeats if "--repeats" in " ".join(argv) else 3))
    if args.profile:
        dtypes = [args.dtype] if "--dtype" in " ".join(argv) else ["float32", "bfloat16"]
        rows = [int(x) for x in args.profile_rows.split(",")]
        result = run_profile(args.preset, dtypes, rows, args.profile_context, 3 if args.quick else 7, args.trace,
                             args.profile_page_size, args.attention)
        return emit(result)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.model import PRESETS, Transformer, save_pretrained
    from laminar_jax.rollout import RolloutSection

    n = args.requests or (96 if args.quick else 384)
    slots = args.slots or (32 if args.quick else 64)
    median = args.median or (12 if args.quick else 24)
    cap = args.max_new or (10 * median + 8)
    cfg = PRESETS[args.preset]
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    apply_matmul_precision("auto", args.dtype)  # as a run of this dtype would (runtime.matmul_precision)
    model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    wl = make_workload(n, median, cap, min(cfg.vocab_size, 500))
    if args.group > 1:
        wl = grouped(wl, args.group)
    page = 16
    max_total = 32 + cap
    pool = max(int(args.pool_frac * slots * (-(-max_total // page))), -(-max_total // page)) + 1
    section = RolloutSection(num_slots=slots, page_size=page, num_pages=pool, attention_impl=args.attention,
                             max_prompt_len=32, max_total_len=max_total, max_new_tokens=cap, prefill_buckets=(16, 32),
                             temperature=0.0, stop_token_ids=(), queue_capacity=n + 1,
                             decode_steps_per_call=args.steps_per_call, live_buckets=args.live_buckets,
                             decode_chunk=(32 if slots >= 64 else 0) if args.chunk is None else args.chunk)
    dev = jax.devices()[0]
    device = f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
    share = None
    if args.group > 1:  # alternating: share on, off, on, off, ...; medians
        runs: dict = {"on": [], "off": []}
        for _ in range(args.repeats):
            runs["on"].append(run_engine(model, section, wl, "engine_continuous"))
            runs["off"].append(run_engine(model, dataclasses.replace(section, share_prompt_kv=False), wl,
                                          "engine_prefill_each"))
        share = {k: {f: float(np.median([r[f] for r in v])) for f in ("tokens_per_s", "cpu_ms_per_1k_tokens")}
                 | {"tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in v]} for k, v in runs.items()}
        share["share_gain"] = share["on"]["tokens_per_s"] / share["off"]["tokens_per_s"]
        print(f"shared prompt KV, groups of {args.group}: {share['on']['tokens_per_s']:.1f} tok/s "
              f"({share['on']['cpu_ms_per_1k_tokens']:.0f} CPU-ms per 1k tokens) vs every sample prefilled "
              f"{share['off']['tokens_per_s']:.1f} ({share['off']['cpu_ms_per_1k_tokens']:.0f}): "
              f"{share['share_gain']:.2f}x; medians of {args.repeats}, load average "
              f"{[round(x, 2) for x in os.getloadavg()]}")
    rows = [run_engine(model, section, wl, "engine_continuous"),
            # Static batches need the full pool: reserving pages for a whole batch of long requests at once.
            run_engine(model, dataclasses.replace(section, batching="static",
                                                  num_pages=slots * section.pages_per_seq + 1), wl, "engine_static")]
    hf = None
    if not args.skip_hf and args.dtype == "float32":
        with tempfile.TemporaryDirectory() as d:
            save_pretrained(model, d)
            hf = run_hf(d, wl, slots)
        rows.append(hf)
    lens = np.asarray(wl.max_new)
    print(f"engine bench: preset={args.preset} dtype={args.dtype} device={device} requests={n} slots={slots} "
          f"response len median={np.median(lens):.0f} p99={np.percentile(lens, 99):.0f} max={lens.max()} "
          f"steps/call={args.steps_per_call} chunk={section.decode_chunk} attention={args.attention} "
          f"live_buckets={args.live_buckets} kv_pages={pool - 1}")
    print(f"{'system':<20}{'wall s':>9}{'tokens':>9}{'tok/s':>10}{'p50 lat s':>11}{'p99 lat s':>11}")
    for r in rows:
        print(f"{r['name']:<20}{r['wall_s']:>9.2f}{r['tokens']:>9d}{r['tokens_per_s']:>10.1f}"
              f"{r['p50_latency_s']:>11.2f}{r['p99_latency_s']:>11.2f}")
    result: dict[str, Any] = {
        "bench": "engine", "device": device, "preset": args.preset, "dtype": args.dtype, "requests": n,
        "attention_impl": args.attention, "live_buckets": args.live_buckets, "kv_pages": pool - 1,
        "steps_per_call": args.steps_per_call,
        "decode_chunk": section.decode_chunk,
        "torch_threads": hf["torch_threads"] if hf else None,
        "slots": slots, "tokens_per_s": rows[0]["tokens_per_s"], "static_tokens_per_s": rows[1]["tokens_per_s"],
        "hf_tokens_per_s": hf["tokens_per_s"] if hf else None,
        "ratio_vs_hf": rows[0]["tokens_per_s"] / hf["tokens_per_s"] if hf else None,
        "ratio_vs_static": rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"],
        "p50_latency_s": rows[0]["p50_latency_s"], "p99_latency_s": rows[0]["p99_latency_s"],
        "static_p99_latency_s": rows[1]["p99_latency_s"],
        "group": args.group, "share_prompt_kv": share, "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    step = decode_step_b64(model, section, getattr(dev, "device_kind", ""), context=128 if args.quick else 512)
    frac = step["decode_roofline_frac"]
    print(f"decode step @b64, context {step['decode_context']}: {step['decode_step_s_b64'] * 1e3:.2f} ms"
          + ("" if frac is None else f" vs roofline {step['decode_roofline_s'] * 1e3:.2f} ms -> {frac:.2f}"))
    result.update(step)
    return emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
