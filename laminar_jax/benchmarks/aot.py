"""Ahead-of-time compile of a decode step for a real TPU (or the kernels for an H100), on a machine without one.

    python launch/bench.py aot [--preset qwen2.5-1.5b] [--layers N] [--rows 64]
        [--context 512] [--topology v5e:2x2]
    python launch/bench.py aot --gpu

It runs on the CPU platform (compile-only devices need no other): a TPU or GPU host works too.

GPU (``--gpu``): with JAX's CUDA PJRT plugin installed at our jax version (``jax-cuda12-plugin`` and
``jax-cuda12-pjrt``; no CUDA libraries, no GPU), ``get_topology_desc(platform="cuda",
topology="1x1x1", target_config=<GpuTargetConfigProto>)`` gives a compile-only H100, and XLA:GPU
compiles for it: the GPU decode kernel (Triton) and tokamax's training attention, forward and
backward, in Triton and in Mosaic GPU. Without the plugin jax has no CUDA topology factory
("topology not implemented for cuda"); without a target config the plugin wants a visible GPU.

Needs libtpu (``pip install 'laminar_jax[tpu]'``, i.e. jax[tpu] at our jax version): it describes
the topology (``jax.experimental.topologies.get_topology_desc``), and XLA:TPU plus Mosaic lower and
compile for it here, which proves the Pallas kernel's lowering. The step is the engine's decode
step: every layer through ``Transformer.forward_cached`` with the TPU paged attention kernel
(rollout/kernels_tpu.py) over head-major bf16 pools, the token written, greedy argmax; the KV pools
are donated (updated in place).

Bytes: the step must read its weights and the live KV (rows x (context + 1) tokens, K and V, every
layer). ``ratio`` = the compiled step's ``cost_analysis()["bytes accessed"]`` / those bytes. XLA's
cost model is not an HBM count: it charges every operand and result whatever its memory space, so a
weight the compiler prefetches into VMEM is charged for the copy (read and write) and again for the
product that reads it on chip, and it charges a Pallas call only part of what it reads.
``hbm_ratio`` (goal <= 1.25) = ``hbm_traffic``'s estimate of the step's HBM traffic from the compiled
module / those bytes: top-level instructions read their HBM operands and write their HBM results,
on-chip arrays count nothing, scatters write in place, gathers read their rows, the Pallas kernel reads
its pools whole (an upper bound: here every page of the table). ``hbm_by_op_mb`` names the largest
parts. The kernel's own KV reads from its blocking are ``kernel_kv_bytes`` (per row, its length
rounded up to the kernel's block of pages, K and V, every layer: the pages it DMAs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np


def needed_bytes(cfg, weight_bytes: int, rows: int, context: int, itemsize: int) -> int:
    """Weights + the live KV (rows x (context + 1) tokens: the cache and the new token), K and V, every layer."""
    return weight_bytes + 2 * cfg.num_layers * rows * (context + 1) * cfg.num_kv_heads * cfg.head_dim * itemsize


def kernel_bytes(cfg, rows: int, context: int, pages_per_seq: int, page: int, itemsize: int) -> int:
    """KV bytes the TPU kernel DMAs: each row's length rounded up to its block of pages (kernels_tpu)."""
    from laminar_jax.rollout.kernels_tpu import pages_per_block

    block = pages_per_block(pages_per_seq, page) * page
    tokens = -(-(context + 1) // block) * block
    return 2 * cfg.num_layers * rows * tokens * cfg.num_kv_heads * cfg.head_dim * itemsize


def tpu_engine(preset: str, rows: int, context: int, *, layers: int = 0, page: int = 16,
               topology: str = "v5e:2x2", attention_impl: str = "auto"):
    """(engine, abstract params, topology device): a rollout Engine of ``preset`` (bf16) on one chip of a
    compile-only TPU topology, its kernels chosen by the seam for 'tpu' (the Pallas kernel where it serves),
    one decode step per call, a page table that holds ``context + 1`` tokens per row."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import topologies

    from laminar_jax.model import PRESETS, Transformer
    from laminar_jax.rollout import RolloutSection, make_engine
    from laminar_jax.rollout.tp import tp_mesh

    cfg = PRESETS[preset]
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    pages_per_seq = -(-(context + 1) // page)
    section = RolloutSection(num_slots=rows, page_size=page, num_pages=rows * pages_per_seq + 1,
                             max_prompt_len=min(context, 256), max_total_len=pages_per_seq * page,
                             max_new_tokens=1, decode_steps_per_call=1, attention_impl=attention_impl,
                             temperature=0.0, dtype="bfloat16")
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    # One chip (a TP-1 mesh): Mosaic reads the chip from the mesh's device.
    engine, params = make_engine(model, section, mesh=tp_mesh(topo.devices[:1]))
    return engine, params, topo.devices[0]


def compile_generate(engine, params):
    """The engine's generate program (one decode step for every slot: the forward through the seam's
    kernels, the token written into the donated pools, sampling) lowered and compiled from shapes."""
    import jax

    from laminar_jax.rollout import programs as prg

    leaves, treedef = jax.tree.flatten(params)
    shardings = engine.placement.shardings(params)
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shardings)]
    state = engine.abstract_state()
    rows, n_chunks = engine.schedule.rows(list(range(engine.num_slots)))
    generate = prg.programs(engine.spec, treedef).generate
    with jax.set_mesh(engine.mesh):
        return generate.lower(leaves, state, rows, n_chunks, engine.schedule.live_buckets[-1]).compile()


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8}
# No memory traffic of their own (aliases, control flow whose bodies are counted, async halves).
_NO_TRAFFIC = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "copy-done", "slice-done", "while", "conditional", "call", "opt-barrier")
_IN_PLACE = ("scatter", "dynamic-update-slice")  # write their updates into their first operand's buffer
_ROWS = ("gather", "dynamic-slice")  # read only the rows they return


def _hbm_bytes(shape: str, on_chip: bool = False) -> int:
    """Bytes of the HBM arrays in an HLO shape (tuple or array); arrays in another memory space
    (``S(n)``: VMEM, SMEM: on-chip) count nothing (``on_chip``: only those count)."""
    import re

    total = 0
    for dtype, dims, layout in re.findall(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\](\{[^}]*\})?", shape):
        if ("S(" in (layout or "")) != on_chip:
            continue
        total += _DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def hbm_traffic(hlo: str) -> tuple[int, list[tuple[str, float]]]:
    """An estimate of a compiled TPU module's HBM traffic, and its largest parts by JAX op (MB).

    Why not ``cost_analysis()["bytes accessed"]``: XLA's cost model counts every operand and result
    whatever its memory space, so a weight the compiler prefetches into VMEM (``copy-start`` /
    ``slice-start`` to ``S(1)``) is charged for the copy (read and write) and again for the product
    that reads it on chip, and it charges a Pallas call only part of what it reads. Here each top-level
    instruction (a fusion counted whole, not its insides; loop and branch bodies once) reads its
    operands and writes its result in HBM, except: arrays on chip count nothing; a scatter or
    dynamic-update-slice (or a fusion ending in one) writes in place, moving its updates, not the
    buffer; a gather or dynamic-slice (or a fusion ending in one) reads the rows it returns; a custom
    call (the Pallas kernel) reads its operands whole (for the kernel, the pools: every page of the
    table, an upper bound of the live KV it DMAs)."""
    import re

    ops_in: dict[str, set] = {}  # computation -> the ops in it (a fusion is classed by what it holds)
    comp = ""
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            comp = head.group(1)
        op = re.match(r"^\s*(?:ROOT )?%[\w.\-]+ = .+? ([\w\-]+)\(", line)
        if op:
            ops_in.setdefault(comp, set()).add(op.group(1))
    sizes: dict[str, int] = {}
    by_op: dict[str, int] = {}
    comp = ""
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            comp = head.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        sizes[name] = _hbm_bytes(shape)
        if comp.startswith("fused") or op in _NO_TRAFFIC:
            continue
        called = re.search(r"calls=%([\w.\-]+)", rest)
        inside = ops_in.get(called.group(1), set()) if op == "fusion" and called else {op}
        kind = next((k for k in (*_IN_PLACE, *_ROWS) if k in inside), op)
        operands = [sizes.get(o, 0) for o in re.findall(r"%([\w.\-]+)", rest.split(")")[0])]
        if op in ("copy-start", "slice-start"):  # a prefetch into on-chip memory reads what it lands
            moved = _hbm_bytes(shape, on_chip=True)
        elif kind in _IN_PLACE and operands:
            moved = 2 * (sum(operands) - max(operands))
        elif kind in _ROWS and operands:
            moved = 2 * sizes[name] + sum(operands) - max(operands)
        else:
            moved = sizes[name] + sum(operands)
        where = re.search(r'op_name="([^"]*)"', line)
        key = "/".join(where.group(1).split("/")[-2:]) if where else op
        by_op[key] = by_op.get(key, 0) + moved
    top = sorted(by_op.items(), key=lambda kv: -kv[1])
    return sum(by_op.values()), [(k, round(v / 1e6, 1)) for k, v in top[:12]]


def tpu_decode_step(preset: str, rows: int, context: int, *, layers: int = 0, page: int = 16,
                    topology: str = "v5e:2x2", attention_impl: str = "auto") -> dict[str, Any]:
    import jax

    engine, params, device = tpu_engine(preset, rows, context, layers=layers, page=page, topology=topology,
                                        attention_impl=attention_impl)
    cfg = engine.model_cfg
    t0 = time.perf_counter()
    compiled = compile_generate(engine, params)
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_bytes, flops = float(cost.get("bytes accessed", 0.0)), float(cost.get("flops", 0.0))
    weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    pages_per_seq = engine.pages_per_seq
    kv = kernel_bytes(cfg, rows, context, pages_per_seq, page, 2)
    writes = 2 * cfg.num_layers * rows * cfg.num_kv_heads * cfg.head_dim * 2  # the new token's K and V
    need = needed_bytes(cfg, weight_bytes, rows, context, 2)
    hlo = compiled.as_text()
    hbm, by_op = hbm_traffic(hlo)
    return {"bench": "aot", "platform": "tpu", "topology": topology, "device_kind": device.device_kind,
            "preset": preset, "layers": cfg.num_layers, "rows": rows, "context": context, "page_size": page,
            "decode_kernel": engine.kernels.summary(), "compile_s": compile_s,
            "mosaic_kernels": hlo.count("tpu_custom_call"),
            "weight_bytes": weight_bytes, "needed_bytes": need, "xla_bytes_accessed": xla_bytes,
            "kernel_kv_bytes": kv, "token_write_bytes": writes, "ratio": xla_bytes / need, "flops": flops,
            "hbm_bytes_estimate": hbm, "hbm_ratio": hbm / need, "hbm_by_op_mb": by_op}


# An H100 SXM as XLA:GPU's compiler sees it (xla::GpuTargetConfigProto, text format): what a
# compile-only CUDA topology needs instead of a visible GPU.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def gpu_topology_device():
    """A compile-only H100 from JAX's CUDA PJRT plugin (jax-cuda12-plugin and jax-cuda12-pjrt at our
    jax version): no GPU needed when the topology gets a target config. Raises where the plugin is absent."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology_name="", platform="cuda", topology="1x1x1",
                                        target_config=H100_TARGET_CONFIG)
    return topo.devices[0]


def gpu_compile(rows: int = 64, context: int = 512, seq: int = 2048) -> dict[str, Any]:
    """Compile for an H100 on this machine: the GPU decode kernel (qwen2.5-1.5b attention geometry,
    bf16) and tokamax's training attention forward + backward (Triton and Mosaic GPU) over packed rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from laminar_jax.model import train_kernels
    from laminar_jax.rollout import head_major, kernels_gpu
    from laminar_jax.rollout.attention import DecodeMeta

    dev = gpu_topology_device()
    at = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))  # noqa: E731
    h, hkv, d, page = 12, 2, 128, 16
    n = -(-(context + 1) // page)
    pool = at(head_major.pool_shape(rows * n + 1, page, hkv, d), jnp.bfloat16)
    kernel = kernels_gpu.make_decode()

    def decode(q, k, v, kp, vp, table, pos, act):
        meta = DecodeMeta(page_table=table, positions=pos, active=act, page_size=page, kv_dtype=jnp.bfloat16)
        return kernel(q, k, v, (kp, vp), meta=meta)

    out: dict[str, Any] = {"device_kind": dev.device_kind}
    jobs = {"decode_pallas_gpu_paged": (decode, (at((rows, 1, h, d), jnp.bfloat16), at((rows, 1, hkv, d), jnp.bfloat16),
                                                 at((rows, 1, hkv, d), jnp.bfloat16), pool, pool, at((rows, n), jnp.int32),
                                                 at((rows,), jnp.int32), at((rows,), jnp.bool_)))}
    train = (at((2, seq, h, d), jnp.bfloat16), at((2, seq, hkv, d), jnp.bfloat16), at((2, seq, hkv, d), jnp.bfloat16),
             at((2, seq), jnp.int32))
    for impl in ("triton", "mosaic"):
        loss = lambda q, k, v, s, impl=impl: jnp.sum(  # noqa: E731
            train_kernels.tokamax_attention(q, k, v, s, implementation=(impl,)).astype(jnp.float32))
        jobs[f"train_tokamax_{impl}_fwd_bwd"] = (jax.grad(loss, argnums=(0, 1, 2)), train)
    for name, (fn, args) in jobs.items():
        t0 = time.perf_counter()
        try:
            with _tokamax_cross_compile(), jax.default_device(dev):
                text = jax.jit(fn).lower(*args).compile().as_text()
            out[name] = {"compiled": True, "compile_s": time.perf_counter() - t0,
                         "triton_calls": text.count("__gpu$xla.gpu.triton"), "mosaic_gpu_calls": text.count("mosaic_gpu")}
        except Exception as e:  # the failure is the finding
            out[name] = {"compiled": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def _tokamax_cross_compile():
    """tokamax checks for a GPU before it lowers; its own option turns that off for cross compiling."""
    import contextlib

    try:
        import tokamax
    except ImportError:
        return contextlib.nullcontext()
    return tokamax.config.cross_compile(True)


def gpu_compile_without_device() -> dict[str, Any]:
    """Whether XLA:GPU can compile here without a GPU, and why not."""
    try:
        return {"available": True, "device_kind": gpu_topology_device().device_kind}
    except Exception as e:  # the reason is the finding
        return {"available": False, "error": f"{type(e).__name__}: {str(e)[:200]}",
                "needs": "the CUDA PJRT plugin at this jax version (jax-cuda12-plugin, jax-cuda12-pjrt)"}


def main(argv: list[str]) -> dict:
    from laminar_jax.benchmarks.machine import emit

    ap = argparse.ArgumentParser(prog="bench aot")
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the preset's (0 = all)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--gpu", action="store_true",
                    help="compile for an H100 instead (the GPU decode kernel, tokamax training attention); needs "
                         "the CUDA PJRT plugin at this jax version, no GPU")
    a = ap.parse_args(argv)
    import jax

    jax.config.update("jax_platforms", "cpu")  # before any backend starts: libtpu would look for a TPU
    # libtpu takes a machine-wide lock file per process; compiling only, other libtpu processes may run.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if a.gpu:
        r = {"bench": "aot", "platform": "gpu", **gpu_compile(a.rows, a.context)}
        for k, v in r.items():
            if isinstance(v, dict):
                print(f"{k:<36} " + (f"compiled in {v['compile_s']:.1f} s" if v["compiled"] else v["error"]))
        return emit(r)
    r = tpu_decode_step(a.preset, a.rows, a.context, layers=a.layers, page=a.page_size, topology=a.topology)
    r["gpu_without_device"] = gpu_compile_without_device()
    print(f"TPU {r['device_kind']} decode step, {a.preset} ({r['layers']} layers) at {a.rows} rows x {a.context}: "
          f"compiled in {r['compile_s']:.1f} s, {r['mosaic_kernels']} Mosaic kernels; bytes: XLA "
          f"{r['xla_bytes_accessed'] / 1e6:.1f} MB accessed (cost model) vs {r['needed_bytes'] / 1e6:.1f} MB needed "
          f"(weights {r['weight_bytes'] / 1e6:.1f}, live KV {(r['needed_bytes'] - r['weight_bytes']) / 1e6:.1f}; "
          f"the kernel DMAs {r['kernel_kv_bytes'] / 1e6:.1f}) -> {r['ratio']:.3f}x; HBM estimate "
          f"{r['hbm_bytes_estimate'] / 1e6:.1f} MB -> {r['hbm_ratio']:.3f}x (largest: {r['hbm_by_op_mb'][:4]})")
    return emit(r)


if __name__ == "__main__":
    main(sys.argv[1:])
