"""Ahead-of-time compile of a decode step for a real TPU, on a machine without one.

    JAX_PLATFORMS=cpu python launch/bench.py aot [--preset qwen2.5-1.5b] [--layers N] [--rows 64]
        [--context 512] [--topology v5e:2x2]

Needs libtpu (``pip install 'laminar_jax[tpu]'``, i.e. jax[tpu] at our jax version): it describes
the topology (``jax.experimental.topologies.get_topology_desc``), and XLA:TPU plus Mosaic lower and
compile for it here, which proves the Pallas kernel's lowering. The step is the engine's decode
step: every layer through ``Transformer.forward_cached`` with the TPU paged attention kernel
(rollout/kernels_tpu.py) over head-major bf16 pools, the token written, greedy argmax; the KV pools
are donated (updated in place).

Bytes: the step must read its weights and the live KV (rows x (context + 1) tokens, K and V, every
layer). XLA's cost model cannot see inside a Mosaic kernel: it charges the custom call (and the
scatter writing the token) with their whole operands, i.e. every layer's entire KV pool, whatever
the rows' lengths. So the step is compiled twice: as it is (``cost_analysis_ratio``), and with
attention replaced by nothing, which gives what the cost model charges the rest of the step; the
kernel's reads are counted by construction (per row, its length rounded up to the kernel's block
of pages, K and V, every layer: the pages it DMAs), and the token writes likewise.
``ratio`` = (rest + kernel reads + writes) / the bytes the step must read; goal <= 1.25.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

import numpy as np


def decode_step_fn(model, kernel, page_size: int):
    """step(params, pools, tokens, positions, page_table, active) -> (next tokens, new pools)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.rollout.attention import DecodeMeta

    graphdef, _ = nnx.split(model)

    def step(params, pools, tokens, positions, page_table, active):
        m = nnx.merge(graphdef, params)
        meta = DecodeMeta(page_table=page_table, positions=positions, active=active, page_size=page_size,
                          kv_dtype=pools[0][0].dtype)
        logits, new = m.forward_cached(tokens[:, None], positions[:, None], pools, functools.partial(kernel, meta=meta))
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), new

    return step


def needed_bytes(cfg, weight_bytes: int, rows: int, context: int, itemsize: int) -> int:
    """Weights + the live KV (rows x (context + 1) tokens: the cache and the new token), K and V, every layer."""
    return weight_bytes + 2 * cfg.num_layers * rows * (context + 1) * cfg.num_kv_heads * cfg.head_dim * itemsize


def kernel_bytes(cfg, rows: int, context: int, pages_per_seq: int, page: int, itemsize: int) -> int:
    """KV bytes the TPU kernel DMAs: each row's length rounded up to its block of pages (kernels_tpu)."""
    from laminar_jax.rollout.kernels_tpu import pages_per_block

    block = pages_per_block(pages_per_seq, page) * page
    tokens = -(-(context + 1) // block) * block
    return 2 * cfg.num_layers * rows * tokens * cfg.num_kv_heads * cfg.head_dim * itemsize


def tpu_decode_step(preset: str, rows: int, context: int, *, layers: int = 0, page: int = 16,
                    topology: str = "v5e:2x2") -> dict[str, Any]:
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from laminar_jax.model import PRESETS, Transformer
    from laminar_jax.rollout import head_major, kernels_tpu

    cfg = PRESETS[preset]
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    ok, why = kernels_tpu.supports(head_major.DecodeGeometry("tpu", jnp.bfloat16, page, cfg.head_dim, cfg.num_heads,
                                                             cfg.num_kv_heads, 1))
    if not ok:
        raise ValueError(f"{preset}: the TPU decode kernel cannot serve it: {why}")
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))  # one chip; Mosaic reads the chip from the mesh's device
    rep = NamedSharding(mesh, P())
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    _, params = nnx.split(model)
    pages_per_seq = -(-(context + 1) // page)
    num_pages = rows * pages_per_seq + 1
    abstract = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    pool = abstract(head_major.pool_shape(num_pages, page, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    args = (jax.tree.map(lambda x: abstract(x.shape, x.dtype), params), [(pool, pool)] * cfg.num_layers,
            abstract((rows,), jnp.int32), abstract((rows,), jnp.int32), abstract((rows, pages_per_seq), jnp.int32),
            abstract((rows,), jnp.bool_))
    def compile_step(kernel):
        step = jax.jit(decode_step_fn(model, kernel, page), donate_argnums=(1,))
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = step.lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return compiled, float(cost.get("bytes accessed", 0.0)), float(cost.get("flops", 0.0)), time.perf_counter() - t0

    compiled, xla_bytes, flops, compile_s = compile_step(kernels_tpu.make_decode())
    # The same step with attention replaced by nothing (zeros out, pools passed through): what XLA's
    # cost model charges the rest of the step (weights, embedding, norms, logits, argmax).
    _, rest_bytes, _, _ = compile_step(lambda q, k, v, cache, *, meta: (jnp.zeros_like(q), cache))
    weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv = kernel_bytes(cfg, rows, context, pages_per_seq, page, 2)
    writes = 2 * cfg.num_layers * rows * cfg.num_kv_heads * cfg.head_dim * 2  # the new token's K and V
    need = needed_bytes(cfg, weight_bytes, rows, context, 2)
    hlo = compiled.as_text()
    return {"bench": "aot", "platform": "tpu", "topology": topology, "device_kind": topo.devices[0].device_kind,
            "preset": preset, "layers": cfg.num_layers, "rows": rows, "context": context, "page_size": page,
            "compile_s": compile_s, "mosaic_kernels": hlo.count("tpu_custom_call"),
            "weight_bytes": weight_bytes, "needed_bytes": need, "xla_bytes_accessed": xla_bytes,
            "xla_bytes_without_attention": rest_bytes, "kernel_kv_bytes": kv, "token_write_bytes": writes,
            # What the step reads: XLA's ops outside attention (its cost model) + the kernel's DMAs + the writes.
            "ratio": (rest_bytes + kv + writes) / need,
            # XLA's whole-step figure; it charges each Mosaic call and each token scatter its whole pool operands.
            "cost_analysis_ratio": xla_bytes / need, "flops": flops}


def gpu_compile_without_device() -> dict[str, Any]:
    """Whether XLA:GPU can compile here without a GPU: what jax offers at this version, and why not."""
    from jax.experimental import topologies

    found: dict[str, Any] = {}
    for platform in ("cuda", "gpu"):
        try:
            topologies.get_topology_desc(topology_name="", platform=platform)
            found[platform] = "ok"
        except Exception as e:  # the reason is the finding
            found[platform] = f"{type(e).__name__}: {str(e)[:200]}"
    return found


def main(argv: list[str]) -> dict:
    from laminar_jax.benchmarks.machine import emit

    ap = argparse.ArgumentParser(prog="bench aot")
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the preset's (0 = all)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--topology", default="v5e:2x2")
    a = ap.parse_args(argv)
    r = tpu_decode_step(a.preset, a.rows, a.context, layers=a.layers, page=a.page_size, topology=a.topology)
    r["gpu_without_device"] = gpu_compile_without_device()
    print(f"TPU {r['device_kind']} decode step, {a.preset} ({r['layers']} layers) at {a.rows} rows x {a.context}: "
          f"compiled in {r['compile_s']:.1f} s, {r['mosaic_kernels']} Mosaic kernels; bytes: XLA "
          f"outside attention {r['xla_bytes_without_attention'] / 1e6:.1f} MB + kernel KV {r['kernel_kv_bytes'] / 1e6:.1f} MB "
          f"vs needed {r['needed_bytes'] / 1e6:.1f} MB (weights {r['weight_bytes'] / 1e6:.1f}) -> {r['ratio']:.3f}x; "
          f"XLA's whole-step figure {r['xla_bytes_accessed'] / 1e6:.1f} MB -> {r['cost_analysis_ratio']:.3f}x")
    return emit(r)


if __name__ == "__main__":
    main(sys.argv[1:])
