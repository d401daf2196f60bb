"""The accelerator check: one command, one JSON line, for a GPU (or TPU) when one is lent.

    python launch/bench.py accel             # one H100/H200: under 8 minutes
    python launch/bench.py accel --dry-run   # what it would run, and exit
    python launch/bench.py accel --tiny      # every sub-measurement at tiny sizes (runs on CPU)

Sub-measurements, each in its own process (a fresh device, its own compile and peak memory, a
timeout; one that fails is reported and the rest still run), each through an existing bench:
  decode_0.5b, decode_1.5b   one decode step at 64 live rows (engine.decode_step_b64: bf16, random
                             init, context 512) and its fraction of the HBM roofline (weights + live
                             KV per step / bandwidth);
  engine_long_tail           continuous-batching tok/s on the long-tail request set (bench engine);
  learner_publish, learner_no_publish
                             learner step MFU at the 1.5B shape, bf16, rows of 2048 tokens, with and
                             without publishing each version (bench learner);
  learner_plan               the memory plan of that step (state + autodiff residuals, abstract
                             shapes on the CPU: benchmarks/learner.memory_plan_residuals, as
                             placement_memory counts activations), against the step's peak.
Every child reports the seconds JAX spent tracing, lowering and compiling (its monitoring events)
and the device's peak bytes in use. The children share a persistent compilation cache, so the
second learner run loads the first's executables. Goals (issue 67): decode >= 0.5 of the roofline at
64 rows for the 1.5B shape, learner MFU >= 0.4 at the 1.5B shape on one H100.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple, Optional

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CHILD_TAG = "accel_child"


class Sub(NamedTuple):
    name: str
    kind: str  # 'decode', 'plan', or a bench module run through its main(): 'engine', 'learner'
    args: tuple[str, ...]
    timeout_s: int
    cpu_only: bool = False  # abstract shapes only: kept off the accelerator


def plan(tiny: bool) -> list[Sub]:
    """The sub-measurements, full size or tiny (the same code paths at CPU-sized shapes)."""
    small, big = ("tiny", "tiny") if tiny else ("qwen2.5-0.5b", "qwen2.5-1.5b")
    rows, context = (8, 32) if tiny else (64, 512)
    seq, batch, steps = (64, 2, 2) if tiny else (2048, 8, 5)
    decode = ("--rows", str(rows), "--context", str(context), "--dtype", "bfloat16", "--attention", "auto")
    learner = ("--preset", big, "--dtype", "bfloat16", "--batch", str(batch), "--seq", str(seq), "--steps", str(steps),
               "--attention", "auto", "--remat", "none" if tiny else "dots_with_no_batch_dims_saveable")
    engine = (("--preset", small, "--dtype", "bfloat16", "--skip-hf", "--live-buckets", "pow4", "--quick",
               "--requests", "16", "--slots", "8", "--median", "4") if tiny else
              ("--preset", small, "--dtype", "bfloat16", "--skip-hf", "--live-buckets", "pow4",
               "--requests", "256", "--slots", "64"))
    t = (lambda full: 120) if tiny else (lambda full: full)
    return [Sub("decode_0.5b", "decode", ("--preset", small, *decode), t(90)),
            Sub("decode_1.5b", "decode", ("--preset", big, *decode), t(100)),
            Sub("engine_long_tail", "engine", engine, t(150)),
            Sub("learner_publish", "learner", learner, t(150)),
            Sub("learner_no_publish", "learner", (*learner, "--no-publish"), t(90)),
            Sub("learner_plan", "plan", learner, t(60), cpu_only=True)]


# ---------------------------------------------------------------- children (one sub-measurement each)

def _compile_listener(totals: dict):
    def on_event(event: str, duration: float, **_: Any) -> None:
        if event in COMPILE_EVENTS:
            totals[event] = totals.get(event, 0.0) + duration
    return on_event


def _decode(argv: list[str]) -> dict:
    """One decode step at --rows live rows through engine.decode_step_b64 (bf16, random init)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.benchmarks.engine import decode_step_b64
    from laminar_jax.matmul_precision import apply_matmul_precision
    from laminar_jax.model import PRESETS, Transformer
    from laminar_jax.rollout import RolloutSection

    ap = argparse.ArgumentParser(prog="accel decode")
    for flag, default in (("--preset", "tiny"), ("--rows", "64"), ("--context", "512"), ("--dtype", "bfloat16"),
                          ("--attention", "auto"), ("--page-size", "16"), ("--iters", "10")):
        ap.add_argument(flag, default=default)
    a = ap.parse_args(argv)
    apply_matmul_precision("auto", a.dtype)
    dt = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    model = Transformer(PRESETS[a.preset], rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt)
    section = RolloutSection(page_size=int(a.page_size), temperature=0.0, stop_token_ids=(), attention_impl=a.attention)
    dev = jax.devices()[0]
    out = decode_step_b64(model, section, getattr(dev, "device_kind", ""), batch=int(a.rows), context=int(a.context),
                          iters=int(a.iters))
    return {**out, "preset": a.preset, "rows": int(a.rows), "dtype": a.dtype, "attention_impl": a.attention}


def _plan(argv: list[str]) -> dict:
    """The learner step's memory plan on abstract shapes: training state + the residuals autodiff keeps."""
    import jax.numpy as jnp

    from laminar_jax.benchmarks.learner import STATE_BYTES_PER_PARAM, memory_plan_residuals
    from laminar_jax.learner import LearnerSection
    from laminar_jax.model import PRESETS
    from laminar_jax.model.attention import resolve_train_attention

    ap = argparse.ArgumentParser(prog="accel plan")
    for flag in ("--preset", "--dtype", "--batch", "--seq", "--steps", "--attention", "--remat"):
        ap.add_argument(flag)
    a = ap.parse_args(argv)
    cfg = PRESETS[a.preset]
    # The plan is for the accelerator's attention: 'auto' resolved as on a GPU (no [T, T] scores kept).
    attention = resolve_train_attention(a.attention, "gpu")[0] if a.attention == "auto" else a.attention
    attention = attention if attention in ("dense", "chunked", "flash") else "flash"  # same residuals, portable
    section = LearnerSection(seq_len_buckets=(int(a.seq),), remat=a.remat, attention_impl=attention)
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    residual = memory_plan_residuals(cfg, section, int(a.batch), int(a.seq), dtype)
    state = cfg.num_params() * STATE_BYTES_PER_PARAM
    return {"plan_gb": (state + residual) / 1e9, "state_gb": state / 1e9, "residual_gb": residual / 1e9,
            "planned_attention": attention}


def child(name: str, kind: str, argv: list[str]) -> dict:
    """Run one sub-measurement in this process; print its JSON line (tagged) last."""
    import jax

    totals: dict = {}
    jax.monitoring.register_event_duration_secs_listener(_compile_listener(totals))
    t0 = time.perf_counter()
    if kind == "decode":
        result = _decode(argv)
    elif kind == "plan":
        result = _plan(argv)
    else:
        result = importlib.import_module(f"laminar_jax.benchmarks.{kind}").main(list(argv))
    from laminar_jax.benchmarks.learner import peak_memory_gb

    dev = jax.devices()[0]
    line = {CHILD_TAG: name, "result": {k: v for k, v in result.items() if k not in ("machine", "ops_per_step")},
            "compile_s": sum(totals.values()), "wall_s": time.perf_counter() - t0,
            "peak_mem_gb": peak_memory_gb(dev), "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}"}
    print(json.dumps(line), flush=True)
    return line


# ---------------------------------------------------------------- parent

def run_sub(sub: Sub, cache_dir: str) -> dict:
    cmd = [sys.executable, "-m", "laminar_jax.benchmarks.accel", "--child", sub.name, sub.kind, "--", *sub.args]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    if sub.cpu_only:
        env["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=sub.timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"error": f"timed out after {sub.timeout_s} s", "tail": out[-800:]}
    for text in reversed(res.stdout.splitlines()):
        if text.startswith("{") and CHILD_TAG in text:
            return json.loads(text)
    return {"error": f"exit {res.returncode}, no result line ({time.perf_counter() - t0:.0f} s)",
            "tail": (res.stdout + res.stderr)[-1500:]}


def _get(d: Optional[dict], *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def summarize(subs: dict[str, dict]) -> dict:
    """The figures the issue asks for, flat, from the children's results."""
    r = lambda name, key: _get(subs.get(name), "result", key)  # noqa: E731
    out: dict[str, Any] = {}
    for size in ("0.5b", "1.5b"):
        out[f"decode_step_ms_{size}"] = None if r(f"decode_{size}", "decode_step_s_b64") is None \
            else r(f"decode_{size}", "decode_step_s_b64") * 1e3
        out[f"decode_roofline_frac_{size}"] = r(f"decode_{size}", "decode_roofline_frac")
        out[f"decode_compile_s_{size}"] = _get(subs.get(f"decode_{size}"), "compile_s")
    out.update(engine_tokens_per_s=r("engine_long_tail", "tokens_per_s"),
               engine_static_tokens_per_s=r("engine_long_tail", "static_tokens_per_s"),
               engine_compile_s=_get(subs.get("engine_long_tail"), "compile_s"),
               learner_mfu_publish=r("learner_publish", "mfu"), learner_mfu_no_publish=r("learner_no_publish", "mfu"),
               learner_step_s_publish=r("learner_publish", "step_s"),
               learner_step_s_no_publish=r("learner_no_publish", "step_s"),
               learner_publish_wait_s=r("learner_publish", "publish_wait_s"),
               learner_compile_s=_get(subs.get("learner_publish"), "compile_s"),
               learner_peak_mem_gb=_get(subs.get("learner_publish"), "peak_mem_gb"),
               learner_plan_gb=r("learner_plan", "plan_gb"))
    peak, planned = out["learner_peak_mem_gb"], out["learner_plan_gb"]
    out["learner_peak_over_plan"] = None if peak is None or not planned else peak / planned
    frac, mfu = out["decode_roofline_frac_1.5b"], out["learner_mfu_no_publish"]
    out["goals"] = {"decode_roofline_frac_1.5b>=0.5": None if frac is None else frac >= 0.5,
                    "learner_mfu>=0.4": None if mfu is None else mfu >= 0.4}
    out["failed"] = {k: v["error"] for k, v in subs.items() if "error" in v}
    return out


def main(argv: list[str]) -> dict:
    from laminar_jax.benchmarks.machine import emit

    if argv[:1] == ["--child"]:
        name, kind = argv[1], argv[2]
        rest = argv[3:]
        return child(name, kind, rest[1:] if rest[:1] == ["--"] else rest)
    ap = argparse.ArgumentParser(prog="bench accel")
    ap.add_argument("--dry-run", action="store_true", help="print each sub-measurement with its settings and exit")
    ap.add_argument("--tiny", action="store_true", help="every sub-measurement at tiny sizes (runs on a CPU)")
    ap.add_argument("--only", default=None, help="comma-separated sub-measurement names")
    args = ap.parse_args(argv)
    subs = plan(args.tiny)
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {s.name for s in subs}
        if unknown:
            raise SystemExit(f"bench accel: --only: unknown {sorted(unknown)}; one of {[s.name for s in subs]}")
        subs = [s for s in subs if s.name in keep]
    if args.dry_run:
        for s in subs:
            print(f"{s.name:<20} {s.kind:<8} timeout {s.timeout_s:>4} s{'  (cpu)' if s.cpu_only else ''}  "
                  + " ".join(s.args))
        return emit({"bench": "accel", "dry_run": True, "tiny": args.tiny,
                     "plan": [{"name": s.name, "kind": s.kind, "args": list(s.args), "timeout_s": s.timeout_s,
                               "cpu_only": s.cpu_only} for s in subs]})
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="accel-cache-") as cache:
        for s in subs:
            t = time.perf_counter()
            results[s.name] = run_sub(s, cache)
            status = results[s.name].get("error") or f"compile {results[s.name]['compile_s']:.1f} s"
            print(f"{s.name:<20} {time.perf_counter() - t:6.1f} s  {status}", flush=True)
    device = next((v["device"] for v in results.values() if "device" in v and not v["device"].startswith("cpu")),
                  next((v["device"] for v in results.values() if "device" in v), None))
    return emit({"bench": "accel", "tiny": args.tiny, "device": device, "wall_s": time.perf_counter() - t0,
                 "load_avg": [round(x, 2) for x in os.getloadavg()], **summarize(results), "subs": results})


if __name__ == "__main__":
    main(sys.argv[1:])
