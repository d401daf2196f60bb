"""Learner throughput benchmark: one Learner.step (GRPO, one optimizer update) on synthetic trajectories.

  python -m laminar_jax.benchmarks.learner [--quick] [--preset small] [--batch 8] [--seq 128]
                                            [--dtype bfloat16] [--steps 5] [--micro-batches 1]
                                            [--remat none|full|dots_saveable|dots_with_no_batch_dims_saveable]
                                            [--logits-chunk-tokens 2048] [--attention dense|chunked|flash|pallas_gpu]
  python -m laminar_jax.benchmarks.learner --memory-plan --preset qwen2.5-7b --batch 1 --seq 18432 \
                                            --dtype bfloat16 --remat full --attention chunked
    compiles one gradient pass on abstract shapes (nothing allocated, no device needed) and prints
    XLA's scratch/argument bytes for it, then whether the row fits a --device-gb device (default 80)
    with the state sharded over --devices (default 1), and the fewest devices that fit.
  python -m laminar_jax.benchmarks.learner --attention-speed [--seq 4096]
    times forward + backward of the training attentions alone, side by side on one packed row.

Prints a table, then (last line) one JSON object:
  {"bench": "learner", "device", "params", "tokens_per_s", "step_s", "mfu", "peak_mem_gb", ...}

MFU (GPU only; null on CPU) = model FLOPs per step / (step_s * peak dense bf16 FLOP/s * devices),
with model FLOPs per token (PaLM appendix B: forward + backward, attention scores counted
non-causally)
    6 * matmul_params + 12 * layers * heads * head_dim * seq
where matmul_params = the weights that multiply activations: the decoder layers plus ONE vocab x
hidden projection (the lm_head, or the tied embedding used as one); the embedding lookup is a
gather, not FLOPs. Recomputation is NOT counted: neither the layers re-run by `--remat` nor the
lm_head re-run by the chunked log-probs (2 * vocab * hidden per token), so MFU drops when they
cost time, as it should (it is the useful fraction). `hfu` adds them back (hardware FLOPs).
peak_mem_gb: the device's peak bytes in use (`memory_stats()`, GPU); null where the backend has none (CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from laminar_jax.benchmarks import optrace
from laminar_jax.benchmarks.machine import emit
from laminar_jax.learner import Learner, LearnerSection, LocalPublisher
from laminar_jax.learner.logprobs import chunk_positions
from laminar_jax.learner.memory import abstract_pass, residual_bytes
from laminar_jax.learner.step import make_grad_fn
from laminar_jax.matmul_precision import apply_matmul_precision
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.model.arch import TransformerConfig
from laminar_jax.model.attention import TRAIN_ATTENTION
from laminar_jax.model.transformer import REMAT_POLICIES
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


def matmul_params(cfg: TransformerConfig) -> int:
    """Weights in matmuls per token: decoder layers + one vocab x hidden projection (no lookup, no norms)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (d * q + 2 * d * kv + q * d + 3 * d * f) + v * d


class Flops(NamedTuple):
    model: float  # per token: 6 * matmul_params + attention (the MFU numerator)
    hardware: float  # per token: model + recomputation (remat, chunked lm_head)


def flops_per_token(cfg: TransformerConfig, seq: int, remat: str, lm_head_recomputed: bool) -> Flops:
    """Training FLOPs per token; see the module docstring for the convention."""
    attn_fwd = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq  # QK^T and PV, non-causal
    layers_fwd = 2 * (matmul_params(cfg) - cfg.vocab_size * cfg.hidden_size)
    model = 6 * matmul_params(cfg) + 3 * attn_fwd
    extra = 0.0
    if remat == "full":  # the whole layer forward again
        extra += layers_fwd + attn_fwd
    elif remat == "dots_with_no_batch_dims_saveable":  # attention re-run, weight matmuls saved
        extra += attn_fwd
    if lm_head_recomputed:
        extra += 2 * cfg.vocab_size * cfg.hidden_size
    return Flops(float(model), float(model + extra))


def peak_memory_gb(device: jax.Device) -> Optional[float]:
    """Peak bytes in use on the device (GPU/TPU allocator stats); None where the backend has none."""
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 1e9


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


def memory_plan_residuals(cfg: TransformerConfig, section: LearnerSection, rows: int, seq: int, dtype) -> int:
    """Bytes of the activations one gradient pass over [rows, seq] keeps for its backward pass (no compile)."""
    return residual_bytes(cfg, section, rows, seq, dtype)


def memory_plan(cfg: TransformerConfig, section: LearnerSection, rows: int, seq: int, dtype) -> dict:
    """Memory of one gradient pass of ``section`` over [rows, seq], from abstract shapes only.

    residual_gb: what autodiff keeps for the backward pass (backend-independent; reflects remat and
    attention_impl). temp_gb: XLA's scratch for the compiled pass on the backend jax runs on; on
    XLA:CPU it ignores remat (none/full give the same figure) and computes bf16 matmuls in f32, so
    there it only compares attention settings.
    """
    params, batch, graphs, kept = abstract_pass(cfg, section, rows, seq, dtype)
    residual_gb = kept / 1e9
    t0 = time.perf_counter()
    grads = jax.jit(make_grad_fn(section, graphs))
    mem = grads.lower({"actor": params}, batch).compile().memory_analysis()
    return {"bench": "learner_memory_plan", "backend": jax.devices()[0].platform, "params": cfg.num_params(),
            "rows": rows, "seq": seq, "remat": section.remat, "attention_impl": section.attention_impl,
            "attention_chunk": section.attention_chunk, "logits_chunk_tokens": section.logits_chunk_tokens,
            "residual_gb": residual_gb, "temp_gb": mem.temp_size_in_bytes / 1e9, "argument_gb": mem.argument_size_in_bytes / 1e9,
            "output_gb": mem.output_size_in_bytes / 1e9, "compile_s": time.perf_counter() - t0}


# Bytes per parameter the learner keeps: f32 params + f32 grads + AdamW's two f32 moments.
STATE_BYTES_PER_PARAM = 16


def plan_fit(plan: dict, device_gb: float, devices: int) -> dict:
    """Does the row fit: state (STATE_BYTES_PER_PARAM, sharded over `devices` by fsdp) + the row's
    autodiff residuals (one row per device) against `device_gb`; and the fewest devices that fit."""
    state_gb = plan["params"] * STATE_BYTES_PER_PARAM / 1e9
    need = state_gb / devices + plan["residual_gb"]
    room = device_gb - plan["residual_gb"]
    min_devices = int(-(-state_gb // room)) if room > 0 else None
    return {"device_gb": device_gb, "devices": devices, "state_gb": state_gb,
            "need_gb_per_device": need, "fits": need <= device_gb, "min_devices": min_devices}


def fit_line(plan: dict) -> str:
    verdict = "FITS" if plan["fits"] else "DOES NOT FIT"
    more = (f"; needs >= {plan['min_devices']} devices sharing the state (mesh fsdp)" if plan["min_devices"]
            else "; the row's residuals alone exceed one device: use remat=full / attention flash / a shorter row")
    return (f"{verdict}: [{plan['rows']} x {plan['seq']}] needs {plan['need_gb_per_device']:.1f} GB per device "
            f"(state {plan['state_gb']:.1f} GB / {plan['devices']} devices + residuals {plan['residual_gb']:.1f} GB) "
            f"of {plan['device_gb']:.0f} GB{'' if plan['fits'] else more}")


def attention_speed(seq: int, heads: int = 8, kv_heads: int = 2, head_dim: int = 64, block: int = 512,
                    reps: int = 3) -> dict:
    """Seconds per forward + backward of each training attention on one row of ``seq`` tokens (4 segments)."""
    from laminar_jax.model.attention import train_attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, seq, heads, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, seq, kv_heads, head_dim)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat(np.arange(1, 5), -(-seq // 4))[:seq][None], jnp.int32)
    from laminar_jax.model.train_kernels import auto_name

    platform = jax.devices()[0].platform
    names = ["dense", "chunked", "flash"] + (["pallas_gpu"] if platform == "gpu" else [])
    if auto_name(platform)[0] in ("tokamax", "splash"):  # the library kernel 'auto' runs here
        names.append(auto_name(platform)[0])
    out = {"bench": "attention", "device": jax.devices()[0].device_kind, "seq": seq, "block": block}
    for name in names:
        fn = train_attention(name, block)
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg) ** 2), argnums=(0, 1, 2)))
        jax.block_until_ready(grad(q, k, v))
        t0 = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(grad(q, k, v))
        out[f"{name}_s"] = (time.perf_counter() - t0) / reps
    out["flash_vs_dense"] = out["dense_s"] / out["flash_s"]
    return out


def host_copy_speed(cfg: TransformerConfig, reps: int = 3) -> dict:
    """Seconds to bring the model's float32 weights to host numpy, three ways, medians of `reps`
    (each on fresh device arrays: `np.asarray` caches a host copy on the array it read):
    `copy_to_host_async` of the device arrays (the path before pinned host memory), then
    `host_arrays` (`start_host_copies`: one `device_put` into pinned host memory where the device
    has it; the relay publisher's path), then the learner's snapshot program (pinned-host outputs). And the way
    back, as a rollout server places a pulled version: `device_put` of the numpy arrays, against
    through pinned host memory first (`h2d_direct`, `h2d_via_pinned`; the latter only where the
    device has pinned host memory)."""
    from laminar_jax.learner.learner import _snapshot_fn
    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.naming import host_arrays, pinned_host_sharding

    model = Transformer(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32)
    flat = flatten_params(nnx.split(model)[1], drop=())
    del model
    fresh = jax.jit(lambda f: {k: jnp.array(v, copy=True) for k, v in f.items()})
    snapshot = _snapshot_fn(flat, jnp.float32)  # the weights' own dtype: the three paths copy the same bytes

    def unpinned(f):
        for v in f.values():
            v.copy_to_host_async()
        return [np.asarray(v) for v in f.values()]

    def pinned(f):
        return host_arrays(f)

    def snap(f):
        return [np.asarray(v) for v in snapshot(f).values()]

    out = {"bench": "host_copy", "device": jax.devices()[0].device_kind, "leaves": len(flat),
           "gb": sum(v.nbytes for v in flat.values()) / 1e9}
    host = {k: np.asarray(v) for k, v in flat.items()}
    device = jax.devices()[0]
    pinned_host = pinned_host_sharding(jax.sharding.SingleDeviceSharding(device))

    def h2d_direct(_):
        jax.block_until_ready(jax.device_put(list(host.values()), device))

    def h2d_via_pinned(_):
        staged = jax.device_put(list(host.values()), pinned_host)
        jax.block_until_ready(jax.device_put(staged, jax.sharding.SingleDeviceSharding(device)))

    paths = [("unpinned", unpinned), ("pinned_device_put", pinned), ("snapshot", snap), ("h2d_direct", h2d_direct)]
    if pinned_host is not None:
        paths.append(("h2d_via_pinned", h2d_via_pinned))
    times = {name: [] for name, _ in paths}
    for _ in range(reps + 1):  # the first round compiles; alternating rounds share the machine's noise
        for name, fn in paths:
            arrays = jax.block_until_ready(fresh(flat))
            t0 = time.perf_counter()
            fn(arrays)
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        out[f"{name}_s"] = float(np.median(ts[1:]))
        out[f"{name}_spread_s"] = [float(min(ts[1:])), float(max(ts[1:]))]
    out["unpinned_vs_snapshot"] = out["unpinned_s"] / out["snapshot_s"]
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
    ap.add_argument("--remat", default=None, choices=list(REMAT_POLICIES),
                    help="per-layer activation rematerialization (learner.remat); default: none with --quick, "
                         "else dots_with_no_batch_dims_saveable (without it the attention probabilities of "
                         "all 24 layers of qwen2.5-0.5b at 16 x 1024 tokens are kept for the backward: ~130 GB)")
    ap.add_argument("--logits-chunk-tokens", type=int, default=LearnerSection().logits_chunk_tokens,
                    help="tokens per device per logits chunk (learner.logits_chunk_tokens; 0 = full logits)")
    ap.add_argument("--attention", default="dense", choices=["auto", *TRAIN_ATTENTION],
                    help="learner.attention_impl (chunked/flash/pallas_gpu/tokamax/splash: no [T, T] scores kept; "
                         "auto: the platform's kernel)")
    ap.add_argument("--attention-chunk", type=int, default=None,
                    help=f"learner.attention_chunk (default {LearnerSection().attention_chunk}; 512 with --attention-speed)")
    ap.add_argument("--memory-plan", action="store_true",
                    help="only compile one gradient pass on abstract shapes and print its memory (see memory_plan)")
    ap.add_argument("--device-gb", type=float, default=80.0,
                    help="--memory-plan: memory of one device in GB (default 80, an H100)")
    ap.add_argument("--devices", type=int, default=1,
                    help="--memory-plan: devices the params/grads/optimizer state are sharded over (mesh fsdp)")
    ap.add_argument("--publish-snapshot", default="auto", choices=["auto", "on", "off"],
                    help="learner.publish_snapshot (auto: on for accelerators): publish each version from a "
                         "snapshot in pinned host memory, so the next step does not wait for the host copy")
    ap.add_argument("--no-publish", action="store_true",
                    help="time steps that publish nothing (no device-to-host copy of the weights at all)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="also trace 2 steps with jax.profiler into DIR and print their time per XLA op (optrace.py)")
    ap.add_argument("--attention-speed", action="store_true",
                    help="only time forward + backward of each training attention (see attention_speed)")
    ap.add_argument("--host-copy-speed", action="store_true",
                    help="only time the ways of bringing the preset's f32 weights to host numpy (see host_copy_speed)")
    ap.add_argument("--packing", action="store_true",
                    help="only time the demo's packed step under each mini-batch draw and row-bucket setting, "
                         "side by side (benchmarks/packing.py; --quick, --steps)")
    ap.add_argument("--lora", action="store_true",
                    help="only compare learner state and published bytes per version, learner.lora (--rank, "
                         "default 16) against full fine-tuning: on the demo model and in the 7B plan "
                         "(benchmarks/learner_lora.py)")
    args, rest = ap.parse_known_args(argv)
    if args.lora:
        from laminar_jax.benchmarks import learner_lora

        return learner_lora.main(argv)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.packing:
        from laminar_jax.benchmarks import packing

        return packing.main(argv)
    if args.host_copy_speed:
        return emit(host_copy_speed(PRESETS[args.preset or ("small" if args.quick or not on_gpu else "qwen2.5-0.5b")]))
    if args.attention_speed:
        result = attention_speed(args.seq or 4096, block=args.attention_chunk or 512)
        return emit(result)
    quick = args.quick or not on_gpu
    preset = args.preset or ("small" if quick else "qwen2.5-0.5b")
    batch = args.batch or (8 if quick else 16)
    seq = args.seq or (128 if quick else 1024)
    dtype_name = args.dtype or ("float32" if not on_gpu else "bfloat16")
    steps = args.steps or (3 if quick else 10)
    remat = args.remat or ("none" if quick else "dots_with_no_batch_dims_saveable")
    cfg = PRESETS[preset]
    dtype = jnp.bfloat16 if dtype_name == "bfloat16" else jnp.float32
    apply_matmul_precision("auto", dtype_name)  # as a run of this dtype would (runtime.matmul_precision)

    section = LearnerSection(lr=1e-6, adv_estimator="grpo", critic="none", micro_batches=args.micro_batches,
                             seq_len_buckets=(seq,), remat=remat, logits_chunk_tokens=args.logits_chunk_tokens,
                             attention_impl=args.attention,
                             attention_chunk=args.attention_chunk or LearnerSection().attention_chunk,
                             publish_snapshot={"auto": None, "on": True, "off": False}[args.publish_snapshot])
    if args.memory_plan:
        result = memory_plan(cfg, section, batch, seq, dtype)
        result.update(plan_fit(result, args.device_gb, args.devices))
        print(fit_line(result))
        return emit(result)
    t0 = time.perf_counter()
    model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32)
    learner = Learner(section, model)
    del model  # the learner holds its own (device) copy; the host one only costs memory
    trajs = synthetic_trajectories(batch, seq, cfg.vocab_size, args.group, 0)
    init_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    learner.step(trajs)  # compile + first step
    compile_s = time.perf_counter() - t0
    learner.publisher = LocalPublisher(keep=1)
    publish = not args.no_publish
    times, waits = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        waits.append(learner.step(trajs, publish=publish)["publish_wait_s"])
        times.append(time.perf_counter() - t0)
    ops = None
    if args.trace:
        path = optrace.capture(lambda: learner.step(trajs, publish=publish), args.trace, calls=2)
        ops = optrace.op_table(path, calls=2)
    t0 = time.perf_counter()
    learner.flush()
    flush_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    learner.policy_params()
    host_copy_s = time.perf_counter() - t0
    peak_mem = peak_memory_gb(jax.devices()[0])
    learner.close()

    step_s = float(np.median(times))
    tokens = batch * seq
    n_params = cfg.num_params()
    n_dev = len(jax.devices())
    rows_per_device = batch // args.micro_batches // n_dev
    chunk = chunk_positions(args.logits_chunk_tokens, rows_per_device, seq)
    flops = flops_per_token(cfg, seq, remat, lm_head_recomputed=chunk < seq)
    peak = peak_flops(jax.devices()[0])
    mfu = None if peak is None else flops.model * tokens / (step_s * peak * n_dev)
    hfu = None if peak is None else flops.hardware * tokens / (step_s * peak * n_dev)
    result = {
        "bench": "learner", "device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}",
        "preset": preset, "params": n_params, "batch": batch, "seq": seq, "dtype": dtype_name,
        "micro_batches": args.micro_batches, "remat": remat, "logits_chunk_tokens": args.logits_chunk_tokens,
        "attention_impl": args.attention,
        "logits_chunk_positions": chunk, "tokens_per_s": tokens / step_s, "step_s": step_s,
        "step_s_min": float(np.min(times)), "compile_s": compile_s, "init_s": init_s,
        "host_copy_s": host_copy_s, "publish_flush_s": flush_s, "publish_wait_s": float(np.median(waits)),
        "publish_snapshot": learner.snapshot_publish, "mfu": mfu, "hfu": hfu,
        "tflops_per_s": flops.model * tokens / step_s / 1e12, "peak_mem_gb": peak_mem, "published": publish,
        "ops_per_step": ops,
    }
    rows = [(k, result[k]) for k in ("device", "preset", "params", "batch", "seq", "dtype", "remat",
                                     "logits_chunk_positions", "step_s", "step_s_min", "tokens_per_s",
                                     "tflops_per_s", "mfu", "hfu", "peak_mem_gb", "compile_s", "host_copy_s",
                                     "publish_wait_s")]
    print(f"{'metric':<16} value")
    for k, v in rows:
        print(f"{k:<16} {v:.4g}" if isinstance(v, float) else f"{k:<16} {v}")
    if ops is not None:
        optrace.print_table(ops, f"one learner step, traced ({args.trace})")
    return emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
