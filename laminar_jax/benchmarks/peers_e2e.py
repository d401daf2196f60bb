"""Peers end to end: TRL's GRPOTrainer against this project's `sync` and `laminar` modes.

    python launch/bench.py peers --e2e [--quick] [--budget-s 90] [--repeats 2] [--trl-threads 1,2] [--lr 1e-3]

Same HF checkpoint for every system: the demo's tiny model after its supervised warm-start,
written as a self-contained HF directory (weights, config.json, the character tokenizer.json with
the built-in tokenizer's ids, generation_config.json). Same skewed task (synthetic_skew) and
reward, same geometry (8 prompts x 8 samples per step; 4 optimizer updates of 16 samples each),
same optimizer settings (AdamW at --lr, default 1e-3, betas 0.9/0.999, eps 1e-8, no weight decay, grad clip 1.0,
constant schedule; PPO clip 0.2 / 0.28, no KL, per-sequence token-mean loss, group-normalised
advantages), temperature 1.0, at most 144 new tokens, and the same wall-clock budget of training
(TRL: from its first step; ours: the RL clock, after compiling).

TRL runs with its recommended CPU settings (`use_cpu=True`, fp32, HF `generate`, no vLLM), at each
torch thread count of --trl-threads; ours with the demo's settings (2 rollout servers, the
mode's policy, 8 tokens per generate call) or `rollout.decode_steps_per_call` = --decode-steps, at
each XLA CPU thread setting of --ours-threads, each rollout fleet of --ours-servers (a server count,
or servers x slots each) and each fleet of --ours-fleet (servers as threads of the learner's process,
or as child processes), with any --ours-set overrides applied last. Each goal's ratio compares every
system at its own best setting for that figure. Every run is a fresh process; runs alternate between
systems, --repeats times.
Each run reports training tokens per second (prompt + response tokens of the trajectories the
optimizer consumed, per second of training), trained tokens per CPU-second (the process's CPU
time, with its rollout child processes', over the training window), the batch reward at the budget (mean of the last 3 steps) and a
held-out reward: the final weights, exported as an HF directory, complete 64 prompts that no
system trained on, greedily, through one evaluator (this project's engine) and are scored by the
task's reward. Medians and spread, the load average of every run and the versions are printed;
the last line is one JSON object. Each run also reports the cores it kept busy (its CPU time over
its training time): tokens/s = cores busy x tokens per CPU-s, so `laminar_vs_sync_core_bound`
(laminar at its median tokens per CPU-s with every core busy, over sync's tokens/s) is the ratio's
bound on this machine, printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, NamedTuple, Optional

import numpy as np

from laminar_jax.cpu import host_malloc
from laminar_jax.benchmarks.e2e import parse_override
from laminar_jax.benchmarks.machine import emit, usable_cores
from laminar_jax.benchmarks.workers import run_worker_process, worker_env

SYSTEMS = ("trl", "sync", "laminar")
FLEETS = ("threads", "processes")
GEOMETRY = {"prompts_per_step": 8, "samples_per_prompt": 8, "updates_per_step": 4, "max_new_tokens": 144}
HELDOUT_SEED, HELDOUT_N, TRAIN_SEED = 9_999, 64, 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench peers --e2e")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--quick", action="store_true", help="short budget, one repeat, one TRL thread count")
    ap.add_argument("--budget-s", type=float, default=None, help="training seconds per run, every system")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--trl-threads", default=None, help="torch thread counts to run TRL with, e.g. 1,2")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--ours-threads", default=None,
                    help="ours: XLA CPU thread settings to run sync and laminar with, e.g. 0,1 (0: XLA's default, "
                         "a pool of one thread per core and async dispatch; n >= 1: runtime.cpu_threads=n and "
                         "runtime.cpu_async_dispatch=False, each computation started on its calling thread); default: "
                         "the demo config's")
    ap.add_argument("--ours-servers", default=None,
                    help="ours: rollout fleets to run sync and laminar with: N (runtime.num_servers=N servers of the "
                         "demo's rollout.num_slots) or NxS (N servers of S slots each; the KV pool keeps the demo's "
                         "pages per slot), e.g. 2,1x32: the demo's 32 sequences at once on two servers or on one; "
                         "default: the demo config's")
    ap.add_argument("--ours-fleet", default=None,
                    help="ours: where the rollout servers run, e.g. threads,processes (threads of the learner's "
                         "process, or child processes: runtime.server_processes); default: the demo config's")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="ours: rollout.decode_steps_per_call (our engine's setting, as TRL gets its best thread "
                         "count); default: the demo config's")
    ap.add_argument("--trl-malloc", default="system",
                    help="C allocator policies to run TRL with, e.g. system,keep (laminar_jax/cpu/host_malloc.py; "
                         "'keep' as glibc environment variables, so the peer gets the setting ours runs with)")
    ap.add_argument("--ours-malloc", default=None, choices=host_malloc.POLICIES,
                    help="ours: runtime.host_malloc; default: the config's")
    ap.add_argument("--ours-set", type=parse_override, action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="ours: a config override applied to every sync and laminar run after the bench's own "
                         "settings (repeatable), e.g. learner.pack_shrink=True")
    ap.add_argument("--lr", type=float, default=1e-3, help="the learning rate of every system")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.budget_s = a.budget_s or (20.0 if a.quick else 90.0)
    a.repeats = a.repeats or (1 if a.quick else 2)
    a.sft_steps = a.sft_steps if a.sft_steps is not None else (100 if a.quick else 300)
    a.trl_threads = [int(x) for x in (a.trl_threads or ("1" if a.quick else "1,2")).split(",") if x.strip()]
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    a.trl_malloc = [m.strip() for m in a.trl_malloc.split(",") if m.strip()]
    for m in a.trl_malloc:
        if m not in host_malloc.POLICIES:
            raise SystemExit(f"--trl-malloc: unknown policy {m!r} (known: {', '.join(host_malloc.POLICIES)})")
    for s in a.systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: unknown system {s!r} (known: {', '.join(SYSTEMS)})")
    if not a.lr > 0:
        raise SystemExit(f"--lr: must be > 0, got {a.lr}")
    if any(t < 1 for t in a.trl_threads):
        raise SystemExit(f"--trl-threads: thread counts must be >= 1, got {a.trl_threads}")
    a.ours_threads = [int(x) for x in a.ours_threads.split(",") if x.strip()] if a.ours_threads else [None]
    if any(t is not None and t < 0 for t in a.ours_threads):
        raise SystemExit(f"--ours-threads: runtime.cpu_threads settings must be >= 0, got {a.ours_threads}")
    a.ours_servers = [_fleet_shape(x.strip()) for x in a.ours_servers.split(",") if x.strip()] \
        if a.ours_servers else [(None, None)]
    a.ours_fleet = [f.strip() for f in a.ours_fleet.split(",") if f.strip()] if a.ours_fleet else [None]
    for f in a.ours_fleet:
        if f not in (None, *FLEETS):
            raise SystemExit(f"--ours-fleet: unknown fleet {f!r} (known: {', '.join(FLEETS)})")
    return a


def _fleet_shape(text: str) -> tuple[int, Optional[int]]:
    """'N' -> (N, None: the demo's slots per server); 'NxS' -> (N, S)."""
    servers, x, slots = text.partition("x")
    try:
        shape = int(servers), (int(slots) if x else None)
    except ValueError:
        raise SystemExit(f"--ours-servers: {text!r} is not N or NxS (servers, or servers x slots each)") from None
    if shape[0] < 1 or (shape[1] is not None and shape[1] < 1):
        raise SystemExit(f"--ours-servers: {text!r}: servers and slots must be >= 1")
    return shape


class Setting(NamedTuple):
    """One configuration a system runs at (None: its default); each becomes a row of the table."""

    system: str
    threads: Optional[int] = None
    malloc: Optional[str] = None
    servers: Optional[int] = None
    fleet: Optional[str] = None
    slots: Optional[int] = None

    def label(self, several_mallocs: bool) -> str:
        t = self.threads
        out = self.system if t is None else f"{self.system}-{t}t" if t else f"{self.system}-auto"
        out += f"+{self.malloc}" if self.system == "trl" and several_mallocs else ""
        out += "" if self.servers is None else f"-{self.servers}srv" if self.slots is None \
            else f"-{self.servers}x{self.slots}"
        return out + ("" if self.fleet is None else "-proc" if self.fleet == "processes" else "-thr")


# ---------------------------------------------------------------- the shared pieces

def prepare_checkpoint(out_dir: str, sft_steps: int) -> str:
    """The warm-started demo model as a self-contained HF directory (what both systems load)."""
    from laminar_jax.benchmarks.e2e import demo_config, warm_start
    from laminar_jax.config import finalize
    from laminar_jax.model.export import write_generation_config, write_tokenizer_files
    from laminar_jax.model.pretrained import from_pretrained

    warm_start(out_dir, sft_steps)
    section = finalize(demo_config()).model
    write_tokenizer_files(section, out_dir)
    write_generation_config(from_pretrained(out_dir), section, out_dir)
    return out_dir


def problems(seed: int, n: int) -> list[tuple[str, str]]:
    """(prompt text, target) of the task (the RL stream of the data plane for `seed`)."""
    from laminar_jax.data.synthetic_skew import SkewTask, sample_problem

    return [(p.prompt, p.target) for p in (sample_problem(SkewTask(), seed, i) for i in range(n))]


def heldout_reward(hf_dir: str) -> float:
    """Mean task reward of greedy completions of HELDOUT_N prompts no run trains on (one evaluator for all)."""
    from laminar_jax.data.synthetic_skew import skew_reward
    from laminar_jax.model.tokenizer import BuiltinTokenizer
    from laminar_jax.rollout import LLM, SamplingParams

    tok = BuiltinTokenizer()
    probs = problems(HELDOUT_SEED, HELDOUT_N)
    llm = LLM(hf_dir, kv_memory_gb=0.25, max_num_seqs=16, max_model_len=192, max_prompt_len=32)
    outs = llm.generate([[tok.bos_id] + tok.encode(p) for p, _ in probs],
                        SamplingParams(temperature=0.0, max_new_tokens=GEOMETRY["max_new_tokens"],
                                       stop_token_ids=(tok.eos_id,)))
    return float(np.mean([skew_reward(tok.decode(o.token_ids), t) for o, (_, t) in zip(outs, probs)]))


def reward_at_end(rewards: list[float]) -> Optional[float]:
    return round(float(np.mean(rewards[-3:])), 4) if rewards else None


# ---------------------------------------------------------------- workers (one process per run)

def _trl_worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from laminar_jax.data.synthetic_skew import skew_reward

    g = GEOMETRY
    data = Dataset.from_list([{"prompt": "<bos>" + p, "ground_truth": t} for p, t in problems(TRAIN_SEED, 4096)])

    def reward(completions, ground_truth, **_):
        return [skew_reward(c, t) for c, t in zip(completions, ground_truth)]

    clock: dict[str, float] = {}

    class Budget(TrainerCallback):
        """Stops at the first step boundary past the budget (a whole generation batch trained)."""

        def on_step_begin(self, args, state, control, **kw):
            if "t0" not in clock:
                clock.update(t0=time.perf_counter(), cpu0=time.process_time())

        def on_step_end(self, args, state, control, **kw):
            if (state.global_step % g["updates_per_step"] == 0
                    and time.perf_counter() - clock["t0"] > spec["budget_s"]):
                clock.update(t1=time.perf_counter(), cpu1=time.process_time())
                control.should_training_stop = True

    cfg = trl.GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, seed=0, report_to=[], save_strategy="no", logging_steps=1,
        per_device_train_batch_size=g["prompts_per_step"] * g["samples_per_prompt"] // g["updates_per_step"],
        num_generations=g["samples_per_prompt"], steps_per_generation=g["updates_per_step"], num_iterations=1,
        max_completion_length=g["max_new_tokens"], temperature=1.0, learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="grpo", scale_rewards="group", max_steps=100_000,
        dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(spec["dir"], torch_dtype=torch.float32)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                              processing_class=AutoTokenizer.from_pretrained(spec["dir"]), callbacks=[Budget()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    trained = float(logs[-1]["num_tokens"]) if logs else 0.0
    final = os.path.join(spec["out"], "final")
    trainer.save_model(final)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        _copy(os.path.join(spec["dir"], name), os.path.join(final, name))
    wall, cpu = clock["t1"] - clock["t0"], clock["cpu1"] - clock["cpu0"]
    return {"train_s": wall, "cpu_s": cpu, "trained_tokens": trained, "steps": trainer.state.global_step,
            "reward_at_budget": reward_at_end([h["reward"] for h in logs]), "heldout_reward": heldout_reward(final),
            "version": f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__} "
                       f"({spec['threads']} thread{'s' if spec['threads'] > 1 else ''}, malloc {spec['malloc']})"}


def _copy(src: str, dst: str) -> None:
    import shutil

    if os.path.isfile(src):
        shutil.copyfile(src, dst)


def _ours_worker(spec: dict) -> dict:
    import jax

    from laminar_jax.cpu.threads import apply_cpu_threads
    from laminar_jax.benchmarks.e2e import demo_config, set_config_key
    from laminar_jax.config import finalize, save_config
    from laminar_jax.weights.export import export_pretrained
    from laminar_jax.runtime.parts import resolve
    from laminar_jax.runtime.local import LocalRun

    g = GEOMETRY
    c = demo_config()
    c.model.path = spec["dir"]
    c.runtime.mode = spec["system"]
    c.runtime.sft_warmup_steps = 0
    c.runtime.total_steps = 100_000
    c.runtime.max_wall_s = spec["budget_s"]
    c.runtime.progress = False
    c.runtime.timeline = False
    c.runtime.prompts_per_step, c.runtime.samples_per_prompt = g["prompts_per_step"], g["samples_per_prompt"]
    c.learner.mini_batches = g["updates_per_step"]
    c.rollout.max_new_tokens = g["max_new_tokens"]
    c.rollout.decode_steps_per_call = spec["decode_steps"]
    c.learner.lr = spec["lr"]
    if spec.get("cpu_threads") is not None:
        c.runtime.cpu_threads = spec["cpu_threads"]
        c.runtime.cpu_async_dispatch = spec["cpu_threads"] == 0
    if spec.get("servers") is not None:
        c.runtime.num_servers = spec["servers"]
    if spec.get("slots") is not None:  # the KV pool keeps the demo's pages per slot (plus the null page)
        pages_per_slot = (c.rollout.num_pages - 1) // c.rollout.num_slots
        c.rollout.num_slots, c.rollout.num_pages = spec["slots"], spec["slots"] * pages_per_slot + 1
    if spec.get("fleet") is not None:
        c.runtime.server_processes = spec["fleet"] == "processes"
    if spec.get("malloc"):
        c.runtime.host_malloc = spec["malloc"]
    for key, value in spec.get("overrides", ()):
        set_config_key(c, key, value)
    c.runtime.run_dir = os.path.join(spec["out"], "run")
    cfg = finalize(c)
    host_malloc.apply_host_malloc(cfg.runtime.host_malloc)  # as the run's entry point does, before JAX allocates
    apply_cpu_threads(cfg.runtime.cpu_threads, cfg.runtime.cpu_async_dispatch)  # before this process starts JAX
    save_config(resolve(cfg, cfg.runtime.run_dir)[0], cfg.runtime.run_dir)  # export_pretrained reads it
    s = LocalRun(cfg, cfg.runtime.run_dir).run()
    final = os.path.join(spec["out"], "final")
    export_pretrained(cfg.runtime.run_dir, final)
    # Process CPU over the training window: cores busy (first to last step) x the RL wall-clock.
    cpu = (s["cpu_cores_busy"] or 0.0) * s["rl_wall_s"]
    return {"train_s": s["rl_wall_s"], "cpu_s": cpu, "trained_tokens": s["train_tokens_per_s"] * s["rl_wall_s"],
            "steps": s["steps_this_run"], "reward_at_budget": reward_at_end([r for _, r in s["reward_curve"]]),
            "heldout_reward": heldout_reward(final), "version": f"laminar_jax (jax {jax.__version__}; "
            f"{s['xla_cpu_pool_threads']} XLA pool threads, async dispatch {s['cpu_async_dispatch']}, "
            f"host malloc {cfg.runtime.host_malloc})"}


def _worker_main(args: argparse.Namespace) -> None:
    with open(args.spec) as f:
        spec = json.load(f)
    out = _trl_worker(spec) if args.worker == "trl" else _ours_worker(spec)
    print("PEERS_E2E_RESULT " + json.dumps(out), flush=True)


def run_one(system: str, spec: dict, spec_dir: str, timeout_s: float) -> dict:
    """One run in a fresh process: its figures, or {'ok': False, 'reason': ...}."""
    path = os.path.join(spec_dir, f"spec_{spec['label']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = worker_env()
    if system == "trl":
        env.update(OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
        env.update(host_malloc.environment(spec["malloc"]))
    cmd = [sys.executable, "-m", "laminar_jax.benchmarks.peers_e2e", "--worker", system, "--spec", path]
    run = run_worker_process(cmd, env, timeout_s, "PEERS_E2E_RESULT ")
    if not run["ok"]:
        return run
    r = run["result"]
    return {"ok": True, **r, "train_tps": r["trained_tokens"] / max(r["train_s"], 1e-9),
            "tokens_per_cpu_s": r["trained_tokens"] / max(r["cpu_s"], 1e-9),
            "cores_busy": r["cpu_s"] / max(r["train_s"], 1e-9), "load_avg": run["load_avg"]}


# ---------------------------------------------------------------- result assembly (pure)

FIGURES = ("train_tps", "tokens_per_cpu_s", "cores_busy", "reward_at_budget", "heldout_reward")


def summarize(runs: list[dict], cores: int = 2) -> dict:
    """Per system label: median / min / max of each figure over successful runs, load averages,
    version, failures; the ratios the goals name (laminar vs the best TRL thread count, vs sync) and
    the `cores`-core bound on laminar / sync (tok/s = cores busy x tokens per CPU-s, so laminar at its
    measured tokens per CPU-s with every core busy, over sync's tok/s)."""
    rows: dict[str, Any] = {}
    for r in runs:
        row = rows.setdefault(r["label"], {"system": r["system"], "load_avg": [], "version": None, "failures": [],
                                           **{f: [] for f in FIGURES}})
        row["load_avg"].append(r["load_avg"])
        if not r["ok"]:
            row["failures"].append(r["reason"])
            continue
        row["version"] = r["version"]
        for f in FIGURES:
            if r.get(f) is not None:
                row[f].append(float(r[f]))
    for row in rows.values():
        row["runs"] = len(row["train_tps"])
        for f in FIGURES:
            xs = row.pop(f)
            row[f] = {"median": float(np.median(xs)), "min": min(xs), "max": max(xs)} if xs else None
    med = {k: {f: (v[f] or {}).get("median") for f in FIGURES} for k, v in rows.items()}

    def best(system: str, figure: str) -> Optional[str]:
        """The system's label (thread setting) with the best median of `figure`: each system is
        compared at its own best setting for that figure."""
        labels = [k for k, v in rows.items() if v["system"] == system and med[k]["train_tps"]]
        return max(labels, key=lambda k: med[k][figure]) if labels else None

    ratios = {}
    for figure, name in (("tokens_per_cpu_s", "per_cpu_s"), ("train_tps", "tps")):
        lam = best("laminar", figure)
        if lam is None:
            continue
        for peer in ("trl", "sync"):
            other = best(peer, figure)
            if other is not None:
                ratios[f"laminar_vs_{peer}_{name}"] = round(med[lam][figure] / med[other][figure], 3)
                ratios[f"{peer}_best_{name}"] = other
        ratios[f"laminar_best_{name}"] = lam
    lam, syn = best("laminar", "tokens_per_cpu_s"), best("sync", "train_tps")
    if lam is not None and syn is not None and med[syn]["cores_busy"] and med[lam]["cores_busy"]:
        ratios["laminar_vs_sync_core_bound"] = round(cores * med[lam]["tokens_per_cpu_s"] / med[syn]["train_tps"], 3)
        ratios["sync_cores_busy"] = round(med[syn]["cores_busy"], 3)
        ratios["laminar_cores_busy"] = round(med[lam]["cores_busy"], 3)
    return {"rows": rows, "ratios": ratios}


def _fmt(fig: Optional[dict], nd: int = 0) -> str:
    return "n/a" if not fig else f"{fig['median']:.{nd}f} [{fig['min']:.{nd}f}-{fig['max']:.{nd}f}]"


def print_table(summary: dict, budget_s: float) -> None:
    print(f"\npeers e2e: {budget_s:.0f} s of training per run; medians [min-max]")
    print(f"{'system':<14}{'runs':>5} {'train tok/s':>22} {'tok per CPU-s':>22} {'reward at budget':>22} "
          f"{'held-out reward':>22}  load avg / version")
    for label, row in summary["rows"].items():
        if not row["runs"]:
            print(f"{label:<14}{0:>5}  failed: {row['failures'][0]}")
            continue
        print(f"{label:<14}{row['runs']:>5} {_fmt(row['train_tps']):>22} {_fmt(row['tokens_per_cpu_s']):>22} "
              f"{_fmt(row['reward_at_budget'], 3):>22} {_fmt(row['heldout_reward'], 3):>22}  "
              f"{row['load_avg']} {row['version']}")
    for k, v in summary["ratios"].items():
        print(f"{k}: {v}")


def main(argv: list[str]) -> Optional[dict]:
    args = parse_args(argv)
    if args.worker:
        _worker_main(args)
        return None
    from laminar_jax.benchmarks.e2e import demo_config, set_config_key

    demo = demo_config()
    decode_steps = args.decode_steps or demo.rollout.decode_steps_per_call
    for key, value in args.ours_set:  # a bad key fails here, before any run
        set_config_key(demo, key, value)
    out = args.out or tempfile.mkdtemp(prefix="laminar_peers_e2e_")
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    ckpt = prepare_checkpoint(os.path.join(out, "checkpoint"), args.sft_steps)
    settings = [Setting(s, t, args.ours_malloc, n, f, k) for s in args.systems if s != "trl" for t in args.ours_threads
                for n, k in args.ours_servers for f in args.ours_fleet]
    if "trl" in args.systems:
        settings = [Setting("trl", t, m) for t in args.trl_threads for m in args.trl_malloc] + settings
    runs = []
    for rep in range(args.repeats):
        for setting in (settings if rep % 2 == 0 else settings[::-1]):  # alternate who goes first
            system, label = setting.system, setting.label(len(args.trl_malloc) > 1)
            spec = {"dir": ckpt, "budget_s": args.budget_s, "system": system, "label": label,
                    "malloc": setting.malloc, "servers": setting.servers, "fleet": setting.fleet,
                    "slots": setting.slots,
                    "threads" if system == "trl" else "cpu_threads": setting.threads,
                    "decode_steps": decode_steps, "lr": args.lr, "overrides": args.ours_set,
                    "out": os.path.join(out, f"{label}_{rep}")}
            r = run_one(system, spec, out, args.timeout_s)
            r.update(system=system, label=label, repeat=rep)
            print(f"  run {rep} {label:<12} " + (
                f"{r['train_tps']:.0f} tok/s, {r['tokens_per_cpu_s']:.0f} tok/CPU-s, reward {r['reward_at_budget']}, "
                f"held-out {r['heldout_reward']:.3f}, {r['steps']} steps" if r["ok"] else f"failed: {r['reason']}")
                + f"  load {r['load_avg']:.1f}", flush=True)
            runs.append(r)
    summary = summarize(runs, usable_cores())
    print_table(summary, args.budget_s)
    result = {"bench": "peers_e2e", "budget_s": args.budget_s, "repeats": args.repeats, **GEOMETRY,
              "decode_steps_per_call": decode_steps, "lr": args.lr, "ours_overrides": dict(args.ours_set),
              "rows": summary["rows"], **summary["ratios"], "wall_s": round(time.time() - t0, 1),
              "load_avg": [round(x, 2) for x in os.getloadavg()]}
    return emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
