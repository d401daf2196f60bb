"""Learner throughput benchmark: one Learner.step (GRPO, one optimizer update) on synthetic trajectories.

  python -m laminar_jax.benchmarks.learner [--quick] [--preset small] [--batch 8] [--seq 128]
                                            [--dtype bfloat16] [--steps 5] [--micro-batches 1]

Prints a table, then (last line) one JSON object:
  {"bench": "learner", "device", "params", "tokens_per_s", "step_s", "mfu", ...}
MFU (GPU only; null on CPU) = model FLOPs per step / (step_s * peak dense bf16 FLOP/s), with
model FLOPs per token = 6 * params + 12 * layers * heads * head_dim * seq (PaLM appendix B:
forward+backward matmuls, attention scores counted non-causally).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from laminar_jax.learner import Learner, LearnerSection, LocalPublisher
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.types import Trajectory

# Dense bf16 peak FLOP/s (no sparsity), by substring of jax's device_kind.
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12))


def peak_flops(device: jax.Device) -> Optional[float]:
    if device.platform != "gpu":
        return None
    kind = device.device_kind
    for name, flops in PEAK_BF16:
        if name in kind:
            return flops
    return None


def synthetic_trajectories(n: int, seq: int, vocab: int, group: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    p = max(1, seq // 4)
    out = []
    for i in range(n):
        resp = rng.integers(3, vocab, seq - p).astype(np.int32)
        out.append(Trajectory(uid=f"b{i // group}/{i % group}", prompt_uid=f"b{i // group}", sample_index=i % group,
                              prompt_ids=rng.integers(3, vocab, p).astype(np.int32), response_ids=resp,
                              behaviour_logprobs=rng.normal(-np.log(vocab), 0.1, len(resp)).astype(np.float32),
                              version=0, reward=float(rng.random())))
    return out


def main(argv: list[str]) -> dict:
    on_gpu = jax.devices()[0].platform == "gpu"
    ap = argparse.ArgumentParser(prog="bench learner")
    ap.add_argument("--quick", action="store_true", help="small CPU-sized run (< 90 s on 2 cores)")
    ap.add_argument("--preset", default=None, help="laminar_jax.model.PRESETS name")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="compute dtype (params stay f32)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--group", type=int, default=4)
    args = ap.parse_args(argv)
    quick = args.quick or not on_gpu
    preset = args.preset or ("small" if quick else "qwen2.5-0.5b")
    batch = args.batch or (8 if quick else 16)
    seq = args.seq or (128 if quick else 1024)
    dtype_name = args.dtype or ("float32" if not on_gpu else "bfloat16")
    steps = args.steps or (3 if quick else 10)
    cfg = PRESETS[preset]
    dtype = jnp.bfloat16 if dtype_name == "bfloat16" else jnp.float32

    t0 = time.perf_counter()
    model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32)
    section = LearnerSection(lr=1e-6, adv_estimator="grpo", critic="none", micro_batches=args.micro_batches,
                             seq_len_buckets=(seq,))
    learner = Learner(section, model)
    trajs = synthetic_trajectories(batch, seq, cfg.vocab_size, args.group, 0)
    init_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    learner.step(trajs)  # compile + first step
    compile_s = time.perf_counter() - t0
    publisher = LocalPublisher(keep=1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        learner.step(trajs, publisher=publisher)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    learner.flush()
    flush_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    learner.policy_params()
    host_copy_s = time.perf_counter() - t0
    learner.close()

    step_s = float(np.median(times))
    tokens = batch * seq
    n_params = cfg.num_params()
    flops_per_token = 6 * n_params + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
    peak = peak_flops(jax.devices()[0])
    mfu = None if peak is None else flops_per_token * tokens / (step_s * peak * len(jax.devices()))
    result = {
        "bench": "learner", "device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}",
        "preset": preset, "params": n_params, "batch": batch, "seq": seq, "dtype": dtype_name,
        "micro_batches": args.micro_batches, "tokens_per_s": tokens / step_s, "step_s": step_s,
        "step_s_min": float(np.min(times)), "compile_s": compile_s, "init_s": init_s,
        "host_copy_s": host_copy_s, "publish_flush_s": flush_s, "mfu": mfu,
        "tflops_per_s": flops_per_token * tokens / step_s / 1e12,
    }
    rows = [(k, result[k]) for k in ("device", "preset", "params", "batch", "seq", "dtype", "step_s", "step_s_min",
                                     "tokens_per_s", "tflops_per_s", "mfu", "compile_s", "host_copy_s")]
    print(f"{'metric':<16} value")
    for k, v in rows:
        print(f"{k:<16} {v:.4g}" if isinstance(v, float) else f"{k:<16} {v}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
