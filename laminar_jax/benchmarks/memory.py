"""Memory bench: each shipped accelerator config, scaled down, run on fake CPU devices and measured
per device against the memory plan (laminar_jax/placement_memory.py) for that same scaled config.

  python launch/bench.py memory [--quick] [--config gpu_node[:32b]]...
  python launch/bench.py memory --tpu [--quick]   (configs/tpu_pod.py compiled for its TPU topology; memory_tpu.py)
  python launch/bench.py memory --device [--config gpu_single] [--dry-run]   (real size on this machine's
      accelerators, memory_stats() peaks against the plan, and a short run; memory_device.py)

Each config runs in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=N (N: the
devices of its host layout: the learner's and, under Ray, one rollout actor's), with the config's
mesh axes, role placement, TP width, remat, attention and micro-batching, but a tiny model (2
layers, the config's architecture flags, KV heads enough for its TP) and tiny lengths, in float32
(the CPU computes bfloat16 products in float32 anyway). It runs the real code paths: a `Learner` on
the learner devices takes two GRPO steps; each rollout server (an `Engine` and `RolloutServer` on its
devices, built from abstract shapes) generates, takes a new version the way the runtime's swap does
(`fleet.params_from_flat`, `set_params`, the next `step`; where the version is streamed into place
tensor by tensor, sampled after each tensor), generates again, and exports and
re-imports a live sequence (a repack move's two halves).

Measured per device (XLA:CPU has no memory_stats()): the bytes of every live jax array's shards on
that device (`jax.live_arrays()`), sampled at each phase, plus, at the phase a program runs, that
program's own peak beyond its arguments as its compiled `memory_analysis()` gives it per device
(temporaries + outputs not aliased to donated inputs): the learner's prepare pass and update step,
the server's generate program. A device's figure is the largest over phases. unsharded_copies: live
arrays holding a whole weight matrix of the model on a device whose role keeps it sharded.

LAMINAR_BENCH_PHASES=1 prints each sample (phase, device, live bytes, program bytes) and each
unsharded buffer to stderr.

Last line: {"bench": "memory", "rows": [{"config", "role", "device", "planned_bytes",
"measured_bytes"}...], "max_measured_over_planned", "min_measured_over_planned", "unsharded_copies"}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from laminar_jax.benchmarks.memory_phases import learner_phases, live_bytes, serve_and_swap, unsharded
from laminar_jax.placement_memory import SHIPPED

HOST_DEVICES = {(n, v): d for n, v, _, d in SHIPPED}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scaled_config(name: str, variant: str):
    """(the config with tiny lengths and batch, the tiny architecture, host devices of its layout)."""
    from laminar_jax.config import repo_config
    from laminar_jax.model.presets import PRESETS

    c = repo_config(name, variant)
    full = PRESETS[c.model.preset]
    tp = c.placement.rollout_tp
    kv = max(2, tp)
    arch = dataclasses.replace(full, vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
                               num_heads=2 * kv, num_kv_heads=kv, head_dim=128 // (2 * kv),
                               max_position_embeddings=4096)
    c.model.path, c.model.dtype, c.model.param_dtype = None, "float32", "float32"
    if "dtype" in c.rollout:
        c.rollout.dtype = "float32"
    # 160-token rows: no [T, T] mask shares a weight matrix's shape (unsharded() looks for those)
    c.rollout.num_slots, c.rollout.page_size, c.rollout.num_pages = 4, 16, 4 * 10 + 1
    c.rollout.max_prompt_len, c.rollout.max_new_tokens, c.rollout.max_total_len = 32, 128, 160
    c.rollout.decode_steps_per_call, c.rollout.decode_row_buckets = 1, ()
    c.data.max_prompt_tokens = 32
    c.learner.seq_len_buckets, c.learner.logits_chunk_tokens = (160,), 64
    c.learner.micro_batches, c.learner.mini_batches, c.learner.ppo_epochs = 2, 1, 1
    c.learner.attention_chunk = 32
    if c.learner.attention_impl in ("auto", "tokamax", "splash"):  # the accelerator's kernels keep what 'flash'
        c.learner.attention_impl = "flash"  # keeps, and the plan traces 'flash' for them (learner/memory.py)
    c.learner.compile_ahead = "none"
    c.runtime.prompts_per_step, c.runtime.samples_per_prompt = 2, 4
    c.scheduler.max_batch = 4
    from laminar_jax.config import finalize
    from laminar_jax.placement_memory import host_layout

    cfg = finalize(c)
    layout = host_layout(cfg, HOST_DEVICES.get((name, variant), 8))
    devices = 1 + max([*layout.learner, *(d for s in layout.servers for d in s)])
    return cfg, arch, layout, devices


def child(name: str, variant: str) -> list[dict]:
    """Run the scaled config on this process's fake devices; per-device rows (planned, measured)."""
    import jax
    import numpy as np

    from laminar_jax.placement_memory import device_items, role_of

    cfg, arch, layout, n = scaled_config(name, variant)
    devices = jax.devices()[:n]
    peak = {i: 0 for i in range(n)}  # the learner's phases
    base, serving = {}, {i: 0 for i in range(n)}  # the servers': live bytes before them, and their peak

    def sample(extra: dict[int, int] = None, label: str = ""):
        into = serving if base else peak
        for d, b in live_bytes(devices).items():
            into[d] = max(into[d], b + (extra or {}).get(d, 0))
            if os.environ.get("LAMINAR_BENCH_PHASES"):  # where each device's peak comes from
                print(f"phase {label:<10} device {d}: live {b / 1e6:.2f} MB + program "
                      f"{(extra or {}).get(d, 0) / 1e6:.2f} MB", file=sys.stderr)

    learner = learner_phases(cfg, arch, layout, devices, sample)
    # A host copy of its own: on XLA:CPU policy_params() may view the learner's buffers and placing
    # it may not copy, so the server's first version would share the learner's memory (on an
    # accelerator it is a copy of its own, which the measure must see from the start, not at the swap).
    flat = {k: np.array(v, copy=True) for k, v in learner.policy_params().items()}
    copies = unsharded(devices, arch, set(layout.learner) if len(layout.learner) > 1 else set())
    base.update(live_bytes(devices))
    for i, server_devices in enumerate(layout.servers):
        copies += serve_and_swap(cfg, arch, [devices[d] for d in server_devices], flat, sample,
                                 {d for d in server_devices if cfg.placement.rollout_tp > 1}, devices)
    planned = device_items(cfg, layout, arch, pinned_host=False)
    learner.close()
    # Colocated roles run at the same time in a run; here one after the other: add each role's own peak.
    measured = {d: peak[d] + max(0, serving[d] - base[d]) for d in range(n)}
    return [{"config": f"{name}{':' + variant if variant else ''}", "role": role_of(layout, d), "device": d,
             "planned_bytes": sum(planned[d].values()), "measured_bytes": measured[d], "unsharded_copies": copies}
            for d in sorted(planned)]


def run_config(name: str, variant: str, timeout_s: float) -> list[dict]:
    _, _, _, n = scaled_config(name, variant)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)}
    p = subprocess.run([sys.executable, "-m", "laminar_jax.benchmarks.memory", "--child", f"{name}:{variant}"],
                       capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"bench memory: {name}:{variant} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def summarise(rows: list[dict]) -> dict[str, Any]:
    ratios = [r["measured_bytes"] / r["planned_bytes"] for r in rows if r["planned_bytes"]]
    copies = sum({r["config"]: r["unsharded_copies"] for r in rows}.values())  # one figure per config
    for r in rows:
        r.pop("unsharded_copies", None)
    return {"bench": "memory", "rows": rows, "max_measured_over_planned": max(ratios),
            "min_measured_over_planned": min(ratios), "unsharded_copies": copies}


def main(argv: list[str]) -> dict:
    from laminar_jax.benchmarks.machine import emit

    ap = argparse.ArgumentParser(prog="bench memory")
    ap.add_argument("--quick", action="store_true", help="gpu_single and gpu_node only")
    ap.add_argument("--config", action="append", help="name[:variant] (repeatable); default: every shipped one")
    ap.add_argument("--tpu", action="store_true", help="TPU compiler figures for configs/tpu_pod.py (needs libtpu)")
    ap.add_argument("--device", action="store_true", help="one config at its real size on this machine's "
                    "accelerators: memory_stats() peaks against the plan (memory_device.py; --dry-run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per config")
    args, _ = ap.parse_known_args(argv)
    if args.device:
        from laminar_jax.benchmarks import memory_device

        return memory_device.main(argv)
    if args.tpu:
        from laminar_jax.benchmarks import memory_tpu

        return memory_tpu.main(argv)
    if args.child is not None:
        name, _, variant = args.child.partition(":")
        rows = child(name, variant)
        print(json.dumps(rows), flush=True)
        return {"rows": rows}
    wanted = [tuple(c.partition(":")[::2]) for c in args.config] if args.config else \
        [(n, v) for n, v, _, _ in SHIPPED][:2 if args.quick else None]
    rows = []
    for name, variant in wanted:
        got = run_config(name, variant, args.timeout)
        rows.extend(got)
        print(f"{'config':<14} {'role':<16} {'device':>6} {'planned MB':>11} {'measured MB':>12} {'ratio':>6}")
        for r in got:
            print(f"{r['config']:<14} {r['role']:<16} {r['device']:>6} {r['planned_bytes'] / 1e6:>11.2f} "
                  f"{r['measured_bytes'] / 1e6:>12.2f} {r['measured_bytes'] / r['planned_bytes']:>6.2f}", flush=True)
        print(f"{name}{':' + variant if variant else ''}: {got[0]['unsharded_copies']} unsharded weight buffers", flush=True)
    return emit(summarise(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
