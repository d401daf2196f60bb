"""bench memory --tpu: configs/tpu_pod.py's learner update and decode step compiled ahead of time for
its TPU topology on this machine (no TPU needed: libtpu's compiler runs on the CPU, as MaxText's
train_compile.py does), and the TPU compiler's per-chip bytes compared with the memory plan.

  python launch/bench.py memory --tpu [--topology v5e:2x4] [--quick]

Needs libtpu (`pip install -e ".[tpu]"`); the default backend stays the CPU (JAX_PLATFORMS=cpu).
Compiled figure per chip = the program's arguments (what it reads: state or weights and KV pool,
batch) + temporaries + outputs not aliased to donated arguments (`memory_analysis()`). Planned: the
learner items but the publish snapshot (host) and the server items but the swap staging (a swap is
not inside the decode step). --quick compiles a 4-layer copy of the model (same widths) instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

TOPOLOGY = "v5e:2x4"  # configs/tpu_pod.py: a v5e-8 host, 8 chips


def compiled_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def learner_program(cfg, arch, devices):
    """The update step of the config's learner mesh on ``devices``, lowered on abstract shapes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.learner.memory import abstract_batch
    from laminar_jax.learner.mesh import (batch_sharding, build_mesh, param_shardings, replicated,
                                          state_shardings_like)
    from laminar_jax.learner.step import Graphs, init_train_state, make_optimizer, make_train_step
    from laminar_jax.model.transformer import Transformer
    from laminar_jax.placement_memory import learner_axes, pack_length

    mesh = build_mesh(cfg.mesh, devices)
    model = nnx.eval_shape(lambda: Transformer(arch, rngs=nnx.Rngs(0), dtype=jnp.dtype(cfg.model.dtype),
                                               param_dtype=jnp.dtype(cfg.model.param_dtype)))
    graphdef, params = nnx.split(model)
    p_shard = {"actor": param_shardings(params, mesh, cfg.mesh.rules)}
    tree = {"actor": params}
    optimizer = make_optimizer(cfg.learner)
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer, 0), tree)
    s_shard = state_shardings_like(state, tree, p_shard, mesh)._replace(params=p_shard)
    axes = learner_axes(cfg, len(devices))
    multiple = axes["data"] * axes["fsdp"] * cfg.learner.micro_batches * cfg.learner.mini_batches
    trajectories = cfg.runtime.prompts_per_step * cfg.runtime.samples_per_prompt
    rows = -(-trajectories // multiple) * multiple // cfg.learner.mini_batches  # one update's rows
    batch = abstract_batch(rows, pack_length(cfg))
    b_shard = jax.tree.map(lambda _: batch_sharding(mesh), batch)
    step = jax.jit(make_train_step(cfg.learner, Graphs(graphdef, None, None), optimizer, mesh),
                   in_shardings=(s_shard, b_shard), out_shardings=(s_shard, replicated(mesh)), donate_argnums=(0,))
    return step.lower(state, batch)


def decode_program(cfg, arch, devices):
    """One server's generate() program on ``devices`` (its TP mesh), lowered on abstract shapes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from laminar_jax.model.transformer import Transformer
    from laminar_jax.placement_memory import serving_dtype
    from laminar_jax.rollout import tp as tpl
    from laminar_jax.rollout import programs as prg
    from laminar_jax.rollout.engine import Engine
    from laminar_jax.runtime.fleet import server_section

    dtype = jnp.dtype(serving_dtype(cfg))
    model = nnx.eval_shape(lambda: Transformer(arch, rngs=nnx.Rngs(0), dtype=jnp.dtype(cfg.model.dtype),
                                               param_dtype=dtype))
    graphdef, params = nnx.split(model)
    mesh = tpl.tp_mesh(devices)
    engine = Engine(graphdef, arch, server_section(cfg, 0, 0), kv_dtype=jnp.dtype(cfg.model.dtype), mesh=mesh)
    leaves, treedef = jax.tree.flatten(params)
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
              for x, s in zip(leaves, tpl.param_shardings_list(params, mesh))]
    state = engine.abstract_state()
    rep = tpl.replicated(mesh)
    rows = jax.ShapeDtypeStruct((engine.num_slots,), np.int32, sharding=rep)
    chunks = jax.ShapeDtypeStruct((), np.int32, sharding=rep)
    bucket = engine.schedule.live_buckets[-1]  # every slot's pages live: the largest program
    return prg.programs(engine.spec, treedef).generate.lower(leaves, state, rows, chunks, bucket)


def main(argv: list[str]) -> dict:
    import jax
    from jax.experimental import topologies

    from laminar_jax.benchmarks.machine import emit
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.placement_memory import GB, arch_of, device_items, host_layout, role_of

    ap = argparse.ArgumentParser(prog="bench memory --tpu")
    ap.add_argument("--tpu", action="store_true")
    ap.add_argument("--topology", default=TOPOLOGY)
    ap.add_argument("--quick", action="store_true", help="a 4-layer copy of the model (same widths)")
    args = ap.parse_args(argv)
    topo = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
    chips = list(topo.devices)
    cfg = finalize(repo_config("tpu_pod"))
    arch = arch_of(cfg)
    if args.quick:
        arch = dataclasses.replace(arch, num_layers=4)
    layout = host_layout(cfg, len(chips))
    planned = device_items(cfg, layout, arch, pinned_host=True)
    t0 = time.perf_counter()
    server = compiled_bytes(decode_program(cfg, arch, [chips[i] for i in layout.servers[0]]).compile())
    print(f"decode step compiled for {args.topology} in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    learner = compiled_bytes(learner_program(cfg, arch, [chips[i] for i in layout.learner]).compile())
    print(f"learner update compiled for {args.topology} in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for d in (layout.learner[0], layout.servers[0][0]):
        items = dict(planned[d])
        items.pop("publish_snapshot", None)
        items.pop("swap_staging", None)
        measured = learner if d in layout.learner else server
        rows.append({"config": "tpu_pod", "role": role_of(layout, d), "device": d, "planned_bytes": sum(items.values()),
                     "measured_bytes": measured, "measured_by": "TPU compiler memory_analysis"})
        print(f"{role_of(layout, d):<10} chip {d}: planned {sum(items.values()) / GB:.2f} GB, "
              f"TPU compiler {measured / GB:.2f} GB", flush=True)
    ratios = [r["measured_bytes"] / r["planned_bytes"] for r in rows]
    return emit({"bench": "memory_tpu", "topology": args.topology, "device_kind": chips[0].device_kind,
                 "layers": arch.num_layers, "jax": jax.__version__, "rows": rows,
                 "max_measured_over_planned": max(ratios), "min_measured_over_planned": min(ratios)})


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])["rows"]))
