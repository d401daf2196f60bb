"""bench memory --device: a shipped accelerator config at its real size on this machine's
accelerators (one GPU for configs/gpu_single.py), each device's peak bytes in use against the
memory plan, and a short end-to-end run of the config.

  python launch/bench.py memory --device [--config gpu_single] [--steps 2] [--run-steps 2] [--dry-run]

Three processes, one after the other, each with the allocator fraction a run sets
(runtime.gpu_memory_fraction, gpu_allocator.py):
  learner   the learner on the layout's learner devices (the model loaded straight onto its shards,
            as a run loads it) takes --steps GRPO steps on worst-case trajectories (every one at
            rollout.max_total_len): memory_phases.learner_phases;
  servers   each rollout server on its devices, built from abstract shapes, with a random version in
            the serving dtype: generate, swap in a new version, generate, export and re-import a live
            sequence (a repack move): memory_phases.serve_and_swap;
  run       launch/run.py on the config for --run-steps steps (synthetic prompts, the builtin
            tokenizer, random weights: no model or data files needed).
Measured per device: the peak bytes in use each role's process reports (`memory_stats()`), added up
where roles share a device (a colocated run holds both at once). Planned: the plan's items for that
device (placement_memory.device_items, the publish snapshot in pinned host memory).
--dry-run prints the layout, the plan and the commands, and runs nothing (works on any machine).

Last line: {"bench": "memory_device", "config", "rows": [{"device", "role", "planned_bytes",
"measured_bytes", "learner_peak_bytes", "servers_peak_bytes"}], "max_measured_over_planned",
"min_measured_over_planned", "run": {"returncode", "seconds"}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLES = ("learner", "servers")


def load(spec: str):
    """(config, architecture, layout on this host's devices) of ``name[:variant]`` at its real size."""
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.placement_memory import SHIPPED, arch_of, host_layout

    name, _, variant = spec.partition(":")
    devices = {(n, v): d for n, v, _, d in SHIPPED}
    if (name, variant) not in devices:
        raise SystemExit(f"bench memory --device: --config {spec!r} is not a shipped accelerator config "
                         f"({', '.join(n + (':' + v if v else '') for n, v, _, _ in SHIPPED)})")
    cfg = finalize(repo_config(name, variant))
    return cfg, arch_of(cfg), host_layout(cfg, devices[(name, variant)])


def run_argv(spec: str, steps: int, run_dir: str) -> list[str]:
    """launch/run.py on the config for ``steps`` steps without model or data files."""
    name, _, variant = spec.partition(":")
    return [sys.executable, os.path.join(ROOT, "launch", "run.py"),
            f"--config={os.path.join(ROOT, 'configs', name + '.py')}{':' + variant if variant else ''}",
            f"--config.runtime.total_steps={steps}", "--config.runtime.checkpoint_every=0",
            "--config.data.source=synthetic_skew", "--config.model.tokenizer=builtin",
            f"--config.runtime.run_dir={run_dir}"]


def role_argv(spec: str, role: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "laminar_jax.benchmarks.memory_device", "--child", role, "--config", spec,
            "--steps", str(steps)]


def child_env(cfg) -> dict:
    return {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": str(cfg.runtime.gpu_memory_fraction),
            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)}


def peaks(devices) -> dict[int, Optional[int]]:
    """memory_stats()['peak_bytes_in_use'] per device index (None where the backend reports none)."""
    out = {}
    for i, d in enumerate(devices):
        stats = d.memory_stats() or {}
        out[i] = stats.get("peak_bytes_in_use")
    return out


def child(spec: str, role: str, steps: int) -> dict:
    """One role at real size on this process's devices; its devices' peaks."""
    import jax
    import numpy as np
    from flax import nnx

    from laminar_jax.benchmarks.memory_phases import learner_phases, serve_and_swap
    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model.sharded import abstract_model
    from laminar_jax.placement_memory import serving_dtype

    cfg, arch, layout = load(spec)
    devices = jax.devices()
    need = 1 + max([*layout.learner, *(d for s in layout.servers for d in s)])
    if len(devices) < need:
        raise SystemExit(f"bench memory --device: {spec} needs {need} devices, this machine has {len(devices)}")
    if role == "learner":  # no sampling (sample=None): the allocator's peak is the measure here
        learner_phases(cfg, arch, layout, devices, None, steps)
    else:
        rng = np.random.default_rng(0)
        dtype = np.dtype(serving_dtype(cfg)) if serving_dtype(cfg) != "bfloat16" else jax.numpy.bfloat16
        shapes = flatten_params(nnx.split(abstract_model(cfg.model))[1], drop=())
        flat = {k: (rng.standard_normal(v.shape, np.float32) * 0.02).astype(dtype) for k, v in shapes.items()}
        for server_devices in layout.servers:
            serve_and_swap(cfg, arch, [devices[d] for d in server_devices], flat, None, set(), devices)
    return {"role": role, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "peaks": peaks(devices[:need])}


def rows_of(cfg, arch, layout, got: dict[str, dict]) -> list[dict]:
    from laminar_jax.placement_memory import device_items, role_of

    planned = device_items(cfg, layout, arch, pinned_host=True)
    rows = []
    for d in sorted(planned):
        per = {r: (got.get(r) or {}).get("peaks", {}).get(str(d)) for r in ROLES}
        held = {"learner": d in layout.learner, "servers": any(d in s for s in layout.servers)}
        rows.append({"device": d, "role": role_of(layout, d), "planned_bytes": sum(planned[d].values()),
                     "measured_bytes": sum(per[r] or 0 for r in ROLES if held[r]), "learner_peak_bytes": per["learner"],
                     "servers_peak_bytes": per["servers"]})
    return rows


def main(argv: list[str]) -> dict:
    from laminar_jax.benchmarks.machine import emit
    from laminar_jax.placement_memory import GB, device_items, role_of

    ap = argparse.ArgumentParser(prog="bench memory --device")
    ap.add_argument("--device", action="store_true")
    ap.add_argument("--config", default="gpu_single", help="name[:variant] of a shipped accelerator config")
    ap.add_argument("--steps", type=int, default=2, help="learner steps")
    ap.add_argument("--run-steps", type=int, default=2, help="steps of the end-to-end run (0: none)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for each role's process")
    ap.add_argument("--run-timeout", type=float, default=240.0, help="seconds for the end-to-end run")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    ap.add_argument("--child", choices=ROLES, help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args(argv)
    if args.child:
        out = child(args.config, args.child, args.steps)
        print(json.dumps(out), flush=True)
        return out
    cfg, arch, layout = load(args.config)
    planned = device_items(cfg, layout, arch, pinned_host=True)
    run_dir = os.path.join(ROOT, "runs", f"bench_memory_device_{int(time.time())}")
    commands = {r: role_argv(args.config, r, args.steps) for r in ROLES}
    if args.run_steps:
        commands["run"] = run_argv(args.config, args.run_steps, run_dir)
    print(f"{args.config}: layout {layout.to_json()}, {arch.num_params() / 1e9:.2f}B params")
    for d in sorted(planned):
        print(f"device {d} ({role_of(layout, d)}): planned {sum(planned[d].values()) / GB:.2f} GB")
    for r, c in commands.items():
        print(f"{r}: XLA_PYTHON_CLIENT_MEM_FRACTION={cfg.runtime.gpu_memory_fraction} {' '.join(c)}", flush=True)
    if args.dry_run:
        return emit({"bench": "memory_device", "config": args.config, "dry_run": True, "layout": layout.to_json(),
                     "planned_bytes": {str(d): sum(v.values()) for d, v in planned.items()},
                     "commands": {r: c for r, c in commands.items()}})
    got, run = {}, None
    for r, c in commands.items():
        t0 = time.perf_counter()
        try:
            p = subprocess.run(c, capture_output=True, text=True, env=child_env(cfg), cwd=ROOT,
                               timeout=args.run_timeout if r == "run" else args.timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e)[-3000:]
        seconds = round(time.perf_counter() - t0, 1)
        print(f"{r}: exit {rc} after {seconds} s", flush=True)
        if rc != 0:
            print(tail, file=sys.stderr, flush=True)
        if r == "run":
            run = {"returncode": rc, "seconds": seconds, "run_dir": run_dir}
        elif rc == 0:
            got[r] = json.loads(p.stdout.strip().splitlines()[-1])
        else:
            got[r] = {"error": tail[-500:]}
    rows = rows_of(cfg, arch, layout, got)
    for row in rows:
        print(f"device {row['device']} ({row['role']}): planned {row['planned_bytes'] / GB:.2f} GB, "
              f"peak in use {row['measured_bytes'] / GB:.2f} GB", flush=True)
    ratios = [r["measured_bytes"] / r["planned_bytes"] for r in rows if r["planned_bytes"]]
    kind = next((g.get("device_kind") for g in got.values() if g.get("device_kind")), None)
    return emit({"bench": "memory_device", "config": args.config, "device_kind": kind, "rows": rows,
                 "max_measured_over_planned": max(ratios) if ratios else None,
                 "min_measured_over_planned": min(ratios) if ratios else None,
                 "errors": {r: g["error"] for r, g in got.items() if "error" in g}, "run": run})


if __name__ == "__main__":
    main(sys.argv[1:])
