"""End-to-end benchmark: the same workload in every mode, side by side, in one run.

python launch/bench.py e2e [--quick] [--budget-s 60] [--modes sync,one_step,stream,laminar,laminar_norepack]
                           (also by name: inflight, inflight_reprefill: runtime.mode='inflight', rollout.inflight_kv)
                           [--workload demo|agentic] [--env-median-s 3.0] [--profile]
                           [--set section.key=value ...]
                           [--decode-steps K] [--no-engine-alone]

Same tiny model (one supervised warm-start shared by all modes), same skewed task, same number of
rollout servers and generation slots, same wall-clock budget of RL per mode. Reports training
throughput (trajectory tokens consumed by the learner per second of RL), time-weighted generation
slot utilization, and reward against wall-clock (plotted).

--workload agentic: each prompt is a multi-turn episode against the `latency` environment
(configs/agentic_demo.py: 3 turns, log-normal latency per step, median 3 s unless
--env-median-s), so generation waits on the environment, not on compute; the JSON adds the
environment figures per mode (turns, env latency p50/p99, failures, share of slot-time waiting)
and the load average. The workload releases the slot of a waiting episode, lets servers admit
while 2 versions behind and keeps 3 batches in flight (configs/agentic_demo.py, _env_bound);
e.g. --set env.release_slot_while_waiting=False keeps slots. --quick runs 90 s of RL per mode for this
workload (a learner step waits ~10-20 s for its episodes).

Loop efficiency (demo workload): after the modes, the run's rollout servers run alone for the same
budget (engine_alone(): same model, servers, slots, section and sampling, fed the task's prompts so
no slot waits, no learner, buffer or weight traffic). `loop_gen_efficiency` is each mode's
generation tokens/s over that figure; `--no-engine-alone` skips it. `loop_gen_efficiency_parts`
splits it (loop_efficiency()): cores the run kept busy over the engine alone's, times the engine
alone's CPU per generated token over the whole loop's (learner included); `bound` is the figure
with every core busy at the loop's own CPU cost per generated token.

Swaps: `swap_stall_p50_s`/`swap_stall_p99_s` per mode (a server drained and ready -> serving the
new version) and `swap_staged_frac` (versions prefetched before the drain ended); compare
`--set rollout.prefetch=False` (pull after the drain) with the default, and `--set
relay.local_handoff=False` to pull through the in-process relay as a Ray host does.

--profile: every mode runs with runtime.profile=True (monitor/profile.py); a CPU-time table per
mode (process CPU by phase, CPU-ms per 1k trained tokens, Python vs XLA threads, GIL wait) is
printed, the JSON gets a `profile` block per mode and the 2-core bound on laminar/sync derived from
it: laminar can at most keep both cores busy at the CPU cost per trained token it measured, so
laminar_tps <= 2 / (laminar CPU-s per trained token), and the bound on the ratio is that over sync_tps
(`laminar_vs_sync_core_bound`; under load sync gets fewer cores and the bound is inflated), and
`laminar_vs_sync_per_cpu_s`, the ratio of trained tokens per CPU-second, which does not depend on
the cores each mode got.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Optional

from laminar_jax.benchmarks.machine import emit, usable_cores

MODES = ("sync", "one_step", "stream", "laminar", "laminar_norepack")
# runtime.mode='inflight' with rollout.inflight_kv 'keep' / 'reprefill': asked for by name (--modes).
INFLIGHT = {"inflight": "keep", "inflight_reprefill": "reprefill"}
KNOWN = MODES + tuple(INFLIGHT)


def demo_config():
    """The demo's config as the benches run it (e2e, peers --e2e, packing)."""
    from laminar_jax.config import repo_config

    c = repo_config("demo")
    c.runtime.eval_every = 0  # the modes are compared on training throughput: no eval traffic
    c.runtime.eval_before_train = False
    c.learner.compile_ahead = "all"  # ... and no step waits for a compile inside the measured window
    return c


def warm_start(out_dir: str, steps: int, seed: int = 0) -> str:
    """One supervised warm-start shared by every mode, saved as a HF directory."""
    from laminar_jax.config import finalize
    from laminar_jax.data.synthetic_skew import sft_examples
    from laminar_jax.model import build_model, load_tokenizer, save_pretrained
    from laminar_jax.learner.sft import sft_warmup

    cfg = finalize(demo_config())
    tok = load_tokenizer(cfg.model.tokenizer)
    model = build_model(cfg.model)
    pairs = [([tok.bos_id] + tok.encode(p), tok.encode(r) + [tok.eos_id]) for p, r in sft_examples(2048, seed + 1)]
    sft_warmup(model, pairs, steps, cfg.runtime.sft_lr, seed=seed)
    save_pretrained(model, out_dir)
    return out_dir


def _workload_config(args):
    if getattr(args, "workload", "demo") == "agentic":
        from laminar_jax.config import repo_config

        c = repo_config("agentic_demo", "latency")
        c.env.env_kwargs = {"latency": dict(c.env.env_kwargs["latency"], median_s=args.env_median_s)}
        return c
    return demo_config()


def parse_override(text: str) -> tuple:
    """--set section.key=value -> (key, value); the value is a Python literal, else a string."""
    import ast

    key, sep, raw = text.partition("=")
    if not sep or "." not in key:
        raise argparse.ArgumentTypeError(f"--set: expected section.key=value, got {text!r}")
    try:
        return key, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key, raw


def set_config_key(c, key: str, value) -> None:
    """Apply one --set: config `c`'s `section.key` = value; an unknown section or key exits naming it."""
    section, name = key.rsplit(".", 1)
    node = c
    for part in section.split("."):
        if part not in node:
            raise SystemExit(f"--set {key}: the config has no section {section!r}")
        node = node[part]
    if name not in node:
        raise SystemExit(f"--set {key}: section {section!r} has no key {name!r}")
    node[name] = value


def mode_config(mode: str, model_dir: str, budget_s: float, run_root: str, args):
    """The finalized config of one mode's run: the workload, the bench's geometry, then --set."""
    from laminar_jax.config import finalize

    c = _workload_config(args)
    c.model.path = model_dir
    c.runtime.mode = "laminar" if mode == "laminar_norepack" else ("inflight" if mode in INFLIGHT else mode)
    if mode in INFLIGHT:
        c.rollout.inflight_kv = INFLIGHT[mode]
    c.scheduler.repack = mode != "laminar_norepack"
    c.buffer.max_staleness = 1 if mode == "stream" else None
    c.runtime.sft_warmup_steps = 0
    c.runtime.total_steps = 10_000
    c.runtime.max_wall_s = budget_s
    c.runtime.progress = False
    c.runtime.num_servers = args.servers
    c.rollout.num_slots = args.slots
    c.runtime.prompts_per_step = args.prompts_per_step
    c.runtime.run_dir = os.path.join(run_root, mode)
    c.runtime.profile = bool(getattr(args, "profile", False))
    c.runtime.cpu_threads = getattr(args, "cpu_threads", 0)
    c.runtime.cpu_async_dispatch = not getattr(args, "cpu_inline", False)
    if getattr(args, "decode_steps", None):
        c.rollout.decode_steps_per_call = args.decode_steps
    for key, value in getattr(args, "set", None) or ():
        set_config_key(c, key, value)
    return finalize(c)


def run_mode(mode: str, model_dir: str, budget_s: float, run_root: str, args) -> dict:
    from laminar_jax.runtime.local import LocalRun

    cfg = mode_config(mode, model_dir, budget_s, run_root, args)
    return LocalRun(cfg, cfg.runtime.run_dir).run()


def engine_alone(cfg, budget_s: float) -> dict:
    """Generation with the machine to itself: the run's rollout servers (same model, count, slots,
    section and seeds as in the loop), each driven by its own thread as in the loop, fed the task's
    prompts (samples_per_prompt each, the server's default sampling) so that no slot waits for work,
    with no learner, buffer or weight traffic. Counts the response tokens of finished sequences in
    ``budget_s`` seconds after every program is compiled: the denominator of the loop-efficiency
    figure (generation tokens/s inside the run over this)."""
    import threading

    from laminar_jax.data import build_prompt_source
    from laminar_jax.model import build_model, load_tokenizer
    from laminar_jax.rollout import Request, RolloutServer, make_engine
    from laminar_jax.rollout.warmup import warmup
    from laminar_jax.runtime.fleet import server_section

    model = build_model(cfg.model)
    source = build_prompt_source(cfg.data, load_tokenizer(cfg.model.tokenizer))
    n, lock = cfg.runtime.samples_per_prompt, threading.Lock()

    def group() -> list:
        with lock:
            p = next(source)
        return [Request(uid=f"{p.uid}/{k}", prompt_ids=p.prompt_ids, prompt_uid=p.uid, sample_index=k)
                for k in range(n)]

    servers = []
    for i in range(cfg.runtime.num_servers):
        engine, params = make_engine(model, server_section(cfg, i, 0))
        warmup(engine, params)
        servers.append(RolloutServer(engine, params))
    tokens, errors = [0] * len(servers), []

    def drive(i: int, deadline: float) -> None:
        server, outstanding = servers[i], 0
        try:
            while time.perf_counter() < deadline:
                while outstanding < server.section.num_slots + n:  # every slot busy, a group queued
                    for r in group():
                        server.submit(r, timeout=10.0)
                    outstanding += n
                for t in server.step():
                    outstanding -= 1
                    tokens[i] += len(t.response_ids)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"server {i}: {e!r}")

    deadline = time.perf_counter() + budget_s
    threads = [threading.Thread(target=drive, args=(i, deadline), name=f"engine-alone-{i}", daemon=True)
               for i in range(len(servers))]
    t0, cpu0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=budget_s + 60)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"engine alone: {errors or 'a server thread did not finish within budget + 60 s'}")
    return {"servers": len(servers), "slots": cfg.rollout.num_slots, "wall_s": round(wall, 2),
            "gen_tokens": sum(tokens), "gen_tokens_per_s": round(sum(tokens) / wall, 1),
            "cpu_cores_busy": round(cpu / wall, 3), "load_avg": [round(x, 2) for x in os.getloadavg()]}


def loop_efficiency(gen_tps: float, cores_busy: Optional[float], alone: dict, cores: int) -> dict:
    """Generation in the loop over the engine alone, and why: tokens/s = cores busy / CPU-s per
    generated token, so the efficiency is exactly (cores the run kept busy / cores the engine alone
    kept busy) x (the engine alone's CPU per generated token / the run's, learner and all). The
    second factor is the share of the loop's CPU per generated token that generation itself needs;
    with every one of `cores` busy at the run's own cost per token, the efficiency is at most
    `bound` = cores / (cores the engine alone used) x that share."""
    eff = gen_tps / alone["gen_tokens_per_s"]
    out = {"efficiency": round(eff, 3), "cores_ratio": None, "cost_ratio": None, "bound": None}
    if cores_busy and alone.get("cpu_cores_busy"):
        run_cost = cores_busy / gen_tps  # CPU-s per generated token, the whole loop
        alone_cost = alone["cpu_cores_busy"] / alone["gen_tokens_per_s"]
        out.update(cores_ratio=round(cores_busy / alone["cpu_cores_busy"], 3),
                   cost_ratio=round(alone_cost / run_cost, 3),
                   bound=round(cores / alone["cpu_cores_busy"] * alone_cost / run_cost, 3))
    return out


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py e2e")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=None, help="RL seconds per mode")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--out", default=None, help="directory for runs and the plot")
    ap.add_argument("--workload", choices=("demo", "agentic"), default="demo")
    ap.add_argument("--env-median-s", type=float, default=3.0, help="agentic: median latency of an env step")
    ap.add_argument("--set", type=parse_override, action="append", metavar="SECTION.KEY=VALUE",
                    help="a config override applied in every mode after the bench's own (repeatable)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="rollout.decode_steps_per_call (default: the workload config's)")
    ap.add_argument("--warm-start", default=None, help="HF directory of a warm-started model to reuse (skips the warm-start)")
    ap.add_argument("--profile", action="store_true", help="CPU-time accounting of each mode (runtime.profile)")
    ap.add_argument("--no-engine-alone", action="store_true",
                    help="skip the run's rollout servers alone (the loop-efficiency figure's denominator)")
    ap.add_argument("--cpu-threads", type=int, default=0,
                    help="runtime.cpu_threads for the whole bench process (XLA's CPU pool; 0 = one per core)")
    ap.add_argument("--cpu-inline", action="store_true",
                    help="runtime.cpu_async_dispatch=False for the whole bench process (computations on their callers)")
    args = ap.parse_args(argv)
    from laminar_jax.cpu.threads import apply_cpu_threads, xla_cpu_pool_threads

    if args.cpu_threads < 0:
        raise SystemExit(f"--cpu-threads: must be >= 0, got {args.cpu_threads}")
    apply_cpu_threads(args.cpu_threads, not args.cpu_inline)  # one pool per process, before the warm-start
    budget = args.budget_s or ((90.0 if args.workload == "agentic" else 30.0) if args.quick else 120.0)
    sft_steps = args.sft_steps if args.sft_steps is not None else (100 if args.quick else 300)
    out = args.out or tempfile.mkdtemp(prefix="laminar_e2e_")
    os.makedirs(out, exist_ok=True)

    import jax

    t0 = time.time()
    model_dir = args.warm_start or warm_start(os.path.join(out, "warm_start"), sft_steps)
    results = {}
    for mode in args.modes.split(","):
        if mode not in KNOWN:
            raise SystemExit(f"--modes: unknown mode {mode!r} (known: {', '.join(KNOWN)})")
        results[mode] = run_mode(mode, model_dir, budget, out, args)
    alone = None
    if not args.no_engine_alone and args.workload == "demo":  # agentic servers wait on environments
        alone = engine_alone(mode_config("laminar", model_dir, budget, out, args), budget)

    from laminar_jax.monitor.timeline import plot_curves

    plot = plot_curves(os.path.join(out, "reward_vs_wallclock.png"),
                       {m: r["reward_curve"] for m, r in results.items()}, "seconds of RL", "batch mean reward")
    print(f"{'mode':18s} {'steps':>6s} {'tok/s':>9s} {'gen tok/s':>9s} {'slot_util':>9s} {'kv_util':>8s} "
          f"{'lat p50':>8s} {'lat p99':>8s} {'stale':>6s} {'reward first->last':>19s} {'moves':>6s} {'learner':>8s} {'cores':>6s}")
    for m, r in results.items():
        print(f"{m:18s} {r['steps_this_run']:6d} {r['train_tokens_per_s']:9.1f} {r['gen_tokens_per_s'] or 0:9.1f} "
              f"{r['slot_util']:9.3f} {r['kv_util'] or 0:8.3f} {r['latency_p50_s'] or 0:8.2f} "
              f"{r['latency_p99_s'] or 0:8.2f} {(r['mean_staleness'] or 0):6.2f} "
              f"{str(r['reward_first']):>9s}->{str(r['reward_last']):<9s} {r['repack_moves']:6d} "
              f"{r['learner_busy_frac']:8.3f} {r['cpu_cores_busy'] or 0:6.2f}")
    tps = {m: r["train_tokens_per_s"] for m, r in results.items()}

    def ratio(a, b):
        return round(tps[a] / tps[b], 3) if a in tps and b in tps and tps[b] > 0 else None

    def reward_at(curve, t):
        pts = [r for s, r in curve if s <= t]
        return round(sum(pts[-3:]) / len(pts[-3:]), 4) if pts else None

    result = {
        "bench": "e2e", "device": jax.devices()[0].device_kind, "budget_s": budget,
        "overrides": dict(args.set or ()),
        **{f"{m}_tps": tps.get(m) for m in KNOWN if m in MODES or m in tps},
        "laminar_vs_sync": ratio("laminar", "sync"), "laminar_vs_one_step": ratio("laminar", "one_step"),
        "laminar_vs_stream": ratio("laminar", "stream"), "repack_gain": ratio("laminar", "laminar_norepack"),
        **({f"{m}_vs_laminar": ratio(m, "laminar") for m in INFLIGHT if m in tps}),
        "slot_util": {m: r["slot_util"] for m, r in results.items()},
        "kv_util": {m: r["kv_util"] for m, r in results.items()},
        "gen_tps": {m: r["gen_tokens_per_s"] for m, r in results.items()},
        "latency_p50_s": {m: r["latency_p50_s"] for m, r in results.items()},
        "latency_p99_s": {m: r["latency_p99_s"] for m, r in results.items()},
        "learner_busy": {m: r["learner_busy_frac"] for m, r in results.items()},
        "cpu_cores_busy": {m: r["cpu_cores_busy"] for m, r in results.items()},
        "repack_moves": {m: r["repack_moves"] for m, r in results.items()},
        "prompts_shared_frac": {m: r["prompts_shared_frac"] for m, r in results.items()},
        "reward_at_budget": {m: reward_at(r["reward_curve"], budget) for m, r in results.items()},
        "mean_staleness": {m: r["mean_staleness"] for m, r in results.items()},
        # Per policy token (each judged on the version that sampled it) and trajectories spanning versions.
        "mean_token_staleness": {m: r.get("mean_token_staleness") for m, r in results.items()},
        "mixed_version_frac": {m: r.get("mixed_version_frac") for m, r in results.items()},
        # per swap: drained and ready -> serving the new version (rollout.prefetch stages it ahead)
        **{k: {m: r.get(k) for m, r in results.items()}
           for k in ("swap_stall_p50_s", "swap_stall_p99_s", "swap_staged_frac", "swap_stall_staged_p50_s", "swaps")},
        "lost_prompts": sum(r["lost_prompts"] for r in results.values()),
        "duplicated_prompts": sum(r["duplicated_prompts"] for r in results.values()),
        "plot": plot, "wall_s": round(time.time() - t0, 1), "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "decode_steps_per_call": args.decode_steps,
        "cpu_threads": args.cpu_threads, "cpu_inline": args.cpu_inline, "xla_cpu_pool_threads": xla_cpu_pool_threads(),
    }
    if alone is not None:
        cores = usable_cores()
        parts = {m: loop_efficiency(r["gen_tokens_per_s"], r["cpu_cores_busy"], alone, cores)
                 for m, r in results.items() if r["gen_tokens_per_s"] and alone["gen_tokens_per_s"]}
        result.update(engine_alone=alone, loop_gen_efficiency={m: p["efficiency"] for m, p in parts.items()},
                      loop_gen_efficiency_parts=parts)
        print(f"engine alone ({alone['servers']} servers x {alone['slots']} slots, every slot fed, no learner): "
              f"{alone['gen_tokens_per_s']:.0f} gen tok/s on {alone['cpu_cores_busy']:.2f} cores; in the loop: "
              + ", ".join(f"{m} {100 * p['efficiency']:.0f}%" for m, p in parts.items())
              + f"; load average {alone['load_avg']}")
        for m, p in parts.items():
            if p["bound"] is not None:
                print(f"  {m}: {p['efficiency']:.2f} = cores {p['cores_ratio']:.2f} x cost {p['cost_ratio']:.2f} "
                      f"(the engine alone's CPU per generated token over the loop's); with all "
                      f"{cores} cores busy at the loop's cost, at most {p['bound']:.2f}")
    if args.profile:
        result.update(profile_result(results, tps))
    if args.workload == "agentic":
        result.update(workload="agentic", env_median_s=args.env_median_s,
                      load_avg=[round(x, 2) for x in os.getloadavg()],
                      **{k: {m: r.get(k) for m, r in results.items()}
                         for k in ("turns_per_trajectory", "env_latency_p50_s", "env_latency_p99_s", "env_failures",
                                   "env_wait_share")})
    return emit(result)


def print_profile(mode: str, p: dict) -> None:
    """One mode's CPU-time table (monitor/profile.py's report), with the load average now."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nCPU profile of {mode}: {p['process_cpu_s']:.1f} s process + {p['children_cpu_s']:.1f} s reward "
          f"processes over {p['wall_s']:.1f} s ({p['cores_busy']:.2f} cores), {p['trained_tokens']} trained tokens, "
          f"{p['cpu_ms_per_1k_trained_tokens']:.0f} CPU-ms per 1k; load average {load}")
    print(f"{'':46s} {'CPU s':>7s} {'share':>6s} {'cores':>6s} {'Python s':>8s} {'XLA s':>7s} {'I/O s':>6s} "
          f"{'ms/1k tok':>9s}")
    for r in p["rows"]:
        print(f"{r['row'][:46]:46s} {r['cpu_s']:7.2f} {100 * (r['share'] or 0):5.1f}% {r['cores']:6.2f} "
              f"{r['python_s']:8.2f} {r['xla_s']:7.2f} {r['io_s']:6.2f} {r['cpu_ms_per_1k_tokens']:9.1f}")
    print(f"Python threads {p['python_threads_cpu_s']:.1f} s ({100 * (p['python_share'] or 0):.0f}% of process CPU), "
          f"XLA threads {p['xla_threads_cpu_s']:.1f} s, tensorstore I/O threads {p['io_threads_cpu_s']:.1f} s; "
          f"GIL/lock wait in {','.join(p['gil_wait_in'])} phases "
          f"{p['gil_wait_s']:.2f} s, run-queue wait there {p['run_queue_wait_s']:.2f} s")
    print("CPU s by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in list(p["threads"].items())[:12]))


def profile_result(results: dict, tps: dict) -> dict:
    """Print each mode's table; the JSON's profile blocks and the 2-core bound on laminar/sync."""
    out = {"profile": {}}
    for m, r in results.items():
        if r.get("profile"):
            print_profile(m, r["profile"])
            out["profile"][m] = r["profile"]
    lam = results.get("laminar", {}).get("profile")
    if lam and tps.get("sync"):
        cpu_per_tok = 1e-6 * lam["cpu_ms_per_1k_trained_tokens"]  # CPU-s per trained token
        cores = usable_cores()
        bound_tps = cores / max(cpu_per_tok, 1e-12)
        out["laminar_vs_sync_core_bound"] = round(bound_tps / tps["sync"], 3)
        out["laminar_tps_core_bound"] = round(bound_tps, 1)
        syn = results.get("sync", {}).get("profile")
        if syn:  # trained tokens per CPU-second, laminar over sync: the part of the ratio that is not core share
            out["laminar_vs_sync_per_cpu_s"] = round(syn["cpu_ms_per_1k_trained_tokens"]
                                                     / max(lam["cpu_ms_per_1k_trained_tokens"], 1e-9), 3)
        print(f"\n{cores}-core bound: laminar at {lam['cpu_ms_per_1k_trained_tokens']:.0f} CPU-ms per 1k "
              f"trained tokens can reach at most {bound_tps:.0f} tok/s = {out['laminar_vs_sync_core_bound']:.2f}x sync "
              f"({tps['sync']:.0f} tok/s); measured {tps.get('laminar') or 0:.0f} tok/s")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
