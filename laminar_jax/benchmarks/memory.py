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


def live_bytes(devices) -> dict[int, int]:
    """Bytes of every live jax array's shards, per device index, each buffer once (a shard's
    ``data`` is itself a live array over the same buffer, so arrays are told apart by address)."""
    import jax

    index = {d: i for i, d in enumerate(devices)}
    out = {i: 0 for i in index.values()}
    seen = set()
    for a in jax.live_arrays():
        for s in a.addressable_shards:
            key = (index[s.device], s.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                out[key[0]] += s.data.nbytes
    return out


def program_extra(compiled) -> int:
    """A compiled program's peak beyond its arguments, per device: temporaries + unaliased outputs."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def unsharded(devices, arch, sharded_on: set[int]) -> int:
    """Buffers holding a whole weight matrix of the model (its full shape) on a device whose role
    keeps that matrix sharded (learner devices under FSDP > 1, servers at TP > 1)."""
    import jax

    from laminar_jax.placement_memory import param_table

    index = {d: i for i, d in enumerate(devices)}
    # a matrix of one layer, or a stack of them (the layers' scan: a leading unnamed layer axis);
    # a stack of vectors (norms, biases) is not one
    stacked = lambda shape, axes: len(shape) > 1 and shape[0] == arch.num_layers and axes[0] is None
    matrices = [(shape, stacked(shape, axes)) for shape, axes in param_table(arch)]
    # the stack itself, and one layer's matrix out of it (a gathered or staged layer)
    whole = {shape for shape, s in matrices if len(shape) - s == 2} | \
        {shape[1:] for shape, s in matrices if s and len(shape) == 3}
    arrays = jax.live_arrays()
    # A shard's `data` is a single-device live array over a multi-device array's own buffer: a view,
    # not a copy (a TP-split vocab table's [vocab / tp, hidden] shard may have a weight matrix's shape);
    # a whole matrix replicated over the devices still counts, through the multi-device array.
    views = {s.data.unsafe_buffer_pointer() for a in arrays if len(a.sharding.device_set) > 1
             for s in a.addressable_shards}
    seen = set()
    for a in arrays:
        if a.shape not in whole:
            continue
        for s in a.addressable_shards:
            ptr = s.data.unsafe_buffer_pointer()
            view = len(a.sharding.device_set) == 1 and ptr in views
            if index[s.device] in sharded_on and s.data.shape == a.shape and not view:
                seen.add((index[s.device], ptr))
                if os.environ.get("LAMINAR_BENCH_PHASES"):
                    print(f"unsharded: {a.shape} {a.dtype} {a.sharding} on device {index[s.device]}", file=sys.stderr)
    return len(seen)


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


def learner_phases(cfg, arch, layout, devices, sample, steps: int = 2):
    """A `Learner` on the layout's learner devices (the model loaded straight onto its shards, as a
    run loads it) takes ``steps`` GRPO steps on worst-case trajectories (every one at
    rollout.max_total_len), ``sample`` called at each phase (None: no sampling, nothing compiled
    apart from the step itself); returns the learner."""
    from laminar_jax.benchmarks.learner import synthetic_trajectories
    from laminar_jax.learner import Learner
    from laminar_jax.learner.mesh import build_mesh

    mesh = build_mesh(cfg.mesh, [devices[i] for i in layout.learner])
    model = learner_model(cfg, arch, mesh)
    learner = Learner(cfg.learner, model, mesh, rules=cfg.mesh.rules, publish_dtype=getattr(cfg.rollout, "dtype", None))
    del model  # the learner holds its own sharded copy
    seq = cfg.rollout.max_total_len
    trajs = synthetic_trajectories(cfg.runtime.prompts_per_step * cfg.runtime.samples_per_prompt, seq,
                                   arch.vocab_size, cfg.runtime.samples_per_prompt, 0)
    on = lambda b: {d: b for d in layout.learner}  # noqa: E731 - an SPMD program's figure is per device
    for _ in range(steps):
        if sample is not None:  # each program's own peak, compiled for its figure
            prepared = learner.prepare(trajs, learner.version)
            sample(on(program_extra(learner._prepare.lower(learner.state.params, learner.ref_params,
                                                           prepared.batch).compile())), "prepare")
            prep = learner._prepare(learner.state.params, learner.ref_params, prepared.batch)
            step = learner._train_step.lower(learner.state, prep).compile()
            sample(on(program_extra(step)), "update")
            del prep
        learner.step(trajs, publish=False)
        if sample is not None:
            sample(label="stepped")
    return learner


def learner_model(cfg, arch, mesh):
    """The policy on the learner's mesh: the config's own model loaded straight onto its shards (as
    a run loads it: model.sharded.load_model), or, for a scaled architecture the config cannot name,
    a tiny float32 model built on the default device (the learner places its own sharded copy)."""
    import numpy as np
    from flax import nnx

    from laminar_jax.learner.mesh import sharding_of
    from laminar_jax.model.sharded import abstract_model, load_model
    from laminar_jax.model.transformer import Transformer
    from laminar_jax.placement_memory import arch_of

    if arch == arch_of(cfg):
        return load_model(cfg.model, sharding_of(abstract_model(cfg.model), mesh, cfg.mesh.rules))
    return Transformer(arch, rngs=nnx.Rngs(0), param_dtype=np.float32)


def serve_and_swap(cfg, arch, server_devices, flat, sample, sharded_on, devices) -> int:
    """One server on its devices: generate, swap in a new version, generate, move a sequence out and in.
    ``sample`` None: no sampling and no program compiled for its figure (the allocator's peak measures)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from laminar_jax.model.sharded import abstract_model
    from laminar_jax.placement_memory import arch_of
    from laminar_jax.rollout.engine import Engine, make_engine
    from laminar_jax.rollout.records import Request
    from laminar_jax.rollout.server import RolloutServer
    from laminar_jax.runtime.fleet import params_from_flat, server_mesh, server_section

    measure = sample is not None
    sample = sample or (lambda *a, **k: None)
    section = server_section(cfg, 0, 0)
    mesh = server_mesh(server_devices)
    if arch == arch_of(cfg):  # the config's own model, as a run's fleet builds its servers (fleet.py)
        abstract = abstract_model(cfg.model)
        engine, _ = make_engine(abstract, section, mesh=mesh)
    else:
        abstract = nnx.eval_shape(lambda: Transformer_(arch))
        engine = Engine(nnx.split(abstract)[0], arch, section, kv_dtype=jnp.float32, mesh=mesh)
    from_flat = params_from_flat(abstract, engine, getattr(cfg.rollout, "dtype", None))
    server = RolloutServer(engine, from_flat(flat), version=0)
    on = lambda b: {i: b for i, d in enumerate(devices) if d in server_devices}  # noqa: E731
    rng = np.random.default_rng(0)
    for k in range(section.num_slots):
        server.submit(Request(uid=f"p{k}/0", prompt_ids=rng.integers(3, arch.vocab_size, 24).astype(np.int32),
                              prompt_uid=f"p{k}", sample_index=0, seed=k))
    for _ in range(3):
        server.step()
        sample(on(generate_extra(engine, server)) if measure else None, "generate")
    new = from_flat({k: (v * np.float32(1.001)).astype(v.dtype) for k, v in flat.items()})
    if hasattr(new, "on_leaf"):  # a version streamed into place at the swap: sample after every tensor placed
        new = new._replace(on_leaf=lambda i, placed: sample(label="swap"))
    server.set_params(1, new, force=True)  # as RolloutWorker._maybe_swap, forced: no waiting for drains
    del new
    sample(label="swap")
    server.step()
    sample()
    for k in range(2):
        server.submit(Request(uid=f"q{k}/0", prompt_ids=rng.integers(3, arch.vocab_size, 24).astype(np.int32),
                              prompt_uid=f"q{k}", sample_index=0, seed=100 + k))
    for _ in range(2):
        server.step()
        sample(on(generate_extra(engine, server)) if measure else None, "generate")
    live = server.live_slots()
    if live:  # a repack move's two halves on one server: export a live sequence, import it again
        slot = next(iter(live))
        seq = server.export_sequence(slot)
        sample()
        server.import_sequence(seq)
        server.step()
        sample()
    jax.block_until_ready(server._state)
    return unsharded(devices, arch, {i for i, d in enumerate(devices) if d in server_devices and sharded_on})


def Transformer_(arch):
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.model.transformer import Transformer

    return Transformer(arch, rngs=nnx.Rngs(0), param_dtype=jnp.float32)


def generate_extra(engine, server) -> int:
    """The generate program's own peak for the server's current call shape."""
    bound = engine.bound(server._params)
    rows, chunks = engine.page_book.rows()
    bucket = engine.page_book.live_bucket()
    return program_extra(bound.generate_program(len(rows)).lower(bound.leaves, server._state, rows, chunks, bucket)
                         .compile())


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
