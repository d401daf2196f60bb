"""Decode-step profile of the rollout engine (``bench engine --profile``): one step of N live slots
broken down into attention, weight matmuls (against this machine's matmul peak, timed beside it),
sampling, host work and the rest, per dtype and row count; optionally each XLA op's time
(optrace.py)."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import numpy as np

from laminar_jax.benchmarks import optrace
from laminar_jax.matmul_precision import apply_matmul_precision


def time_generate(engine, params, state, iters: int, warmup: int = 1):
    """(seconds per ``generate`` call over ``iters`` calls, the state after them), after ``warmup``
    untimed calls (the first compiles the live-page bucket)."""
    import jax

    out = None
    for _ in range(warmup):
        state, out = engine.generate(params, state)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        state, out = engine.generate(params, state)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters, state


def peak_product(dtype: str, n: int = 2048):
    """(fn, flops): one [n, n] x [n, n] product (bf16 accumulates in f32, as the model's Linear), compiled
    and run once, as this machine's matmul peak."""
    import jax
    import jax.numpy as jnp

    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dt)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dt)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(a, b))
    return (lambda: f(a, b)), 2 * n ** 3


def paired_fractions(step, step_flops: float, peak, peak_flops: float, rounds: int) -> dict:
    """The step's GFLOP/s over the peak product's, from ``rounds`` rounds that each time both, back to
    back (the faster of two calls of each: one call alone is interrupted often enough on a shared
    machine to put single rounds at 50-170%). The machine's speed drifts by 10-25% within minutes, so
    a step and a peak measured apart give a ratio of two moments; a round compares the same moment."""
    fracs, peaks = [], []
    for _ in range(rounds):
        tp, ts = min(_call_times(peak, 2)), min(_call_times(step, 2))
        peaks.append(peak_flops / tp / 1e9)
        fracs.append((step_flops / ts) / (peak_flops / tp))
    return {"frac_of_peak": float(np.median(fracs)), "frac_of_peak_min": min(fracs),
            "frac_of_peak_max": max(fracs), "peak_gflops": max(peaks), "peak_gflops_median": float(np.median(peaks)),
            "paired_rounds": rounds}


def _skip_attention(q, k, v, layer_cache, *, meta):
    """Decode backend that does no attention (output = q, cache untouched): step time minus this = attention."""
    del k, v, meta
    return q, layer_cache


def _call_times(fn, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``, each waited on to its results."""
    import jax

    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return times


def _median_ms(fn, iters: int) -> float:
    _call_times(fn, 1)  # compile, first-touch
    return float(np.median(_call_times(fn, iters))) * 1e3


def _profile_section(rows: int, context: int, attention_impl: str = "auto", page: int = 64):
    from laminar_jax.rollout import RolloutSection

    total = context + 256
    return RolloutSection(num_slots=rows, page_size=page, max_prompt_len=context, max_total_len=total,
                          prefill_buckets=(context,), num_pages=rows * -(-total // page) + 1, temperature=0.0,
                          stop_token_ids=(), attention_impl=attention_impl, queue_capacity=rows + 1)


def _filled_engine(model, rows: int, context: int, **kwargs):
    """(engine, params, state): ``rows`` live slots, each holding a ``context``-token prompt, greedy, long max_new."""
    from laminar_jax.rollout import SlotInit, make_engine

    sec = _profile_section(rows, context, kwargs.pop("attention_impl", "auto"), kwargs.pop("page", 64))
    engine, params = make_engine(model, sec, **kwargs)
    state = engine.init_decode_state()
    pre = engine.prefill(params, *engine.schedule.pad_prompt(np.arange(context, dtype=np.int32) % 97 + 3))
    for slot in range(rows):
        state = engine.insert(pre, state, slot, SlotInit(np.zeros(2, np.uint32), 0.0, 0, 1.0, 250, np.zeros(0)))
    return engine, params, state


def _matmul_fn(model, rows: int, products=None):
    """A jitted pass through every weight matmul of one decode step ([rows, in] x [out, in]^T, the model's
    own Linear modules, plus the head), and its FLOPs. ``products``: as the engine's decode runs them
    (its kernels.products: a kernel for few rows, else XLA's dot; model/products.py)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.model.products import DEFAULT
    from laminar_jax.model.transformer import Linear

    products = DEFAULT if products is None else products
    linears = [m for _, m in nnx.iter_graph(model) if isinstance(m, Linear)]
    graphdef, params = nnx.split(model)
    c = model.cfg
    flops = 2 * rows * (sum(m.weight[...].size for m in linears) + c.vocab_size * c.hidden_size)

    x = jax.random.normal(jax.random.key(0), (rows, max(c.hidden_size, c.intermediate_size,
                                                        c.num_heads * c.head_dim)), jnp.float32)

    @jax.jit
    def run(params, x):
        # Every product is returned whole: a reduction of it would let XLA simplify the dot away.
        m = nnx.merge(graphdef, params)
        outs = [m.logits_from_hidden(x[:, :c.hidden_size].astype(m.dtype), products)]
        for lin in [y for _, y in nnx.iter_graph(m) if isinstance(y, Linear)]:
            outs.append(lin(x[:, :lin.weight.shape[1]].astype(m.dtype), products))  # weight [out, in]
        return outs

    return (lambda: run(params, x)), flops


def profile_decode(model, rows: int, context: int, iters: int = 5, trace_dir: Optional[str] = None,
                   page: int = 64, attention_impl: str = "auto", peak=None) -> dict:
    """One decode step of ``rows`` live slots at ``context`` tokens, broken down (all medians, ms):

    step (engine.generate), attention over pages (step minus the same step with attention skipped),
    weight matmuls (the model's Linear modules + head alone, as the engine runs them: native kernel
    or XLA's dot; and their GFLOP/s), sampling (greedy over the vocabulary), host work per server
    step (server.step() wall minus the device step), and the rest (norms, RoPE, embedding, state
    updates). With ``trace_dir``, also the step's time per XLA op from a jax.profiler trace ('ops',
    see optrace.py). With ``peak`` ((fn, flops), ``peak_product``), also the step's products' share of
    it, per round of one step and one peak product back to back (``paired_fractions``; 2 x iters + 1
    rounds).
    """
    import jax
    import jax.numpy as jnp

    from laminar_jax.rollout import Request, RolloutServer, SamplingParams
    from laminar_jax.rollout.sampling import sample_tokens

    def decode_step(**kw):
        kw.setdefault("attention_impl", attention_impl)
        engine, params, state = _filled_engine(model, rows, context, page=page, **kw)
        box = [state]

        def one():
            box[0], out = engine.generate(params, box[0])
            return out
        return one, engine.kernels.products

    step, kernel = decode_step()
    full = _median_ms(step, iters)
    ops = None if trace_dir is None else optrace.op_table(optrace.capture(step, trace_dir, calls=3), calls=3)
    no_attn = _median_ms(decode_step(attention_impl="skip", attention_backends={"skip": _skip_attention})[0], iters)
    mm_fn, flops = _matmul_fn(model, rows, kernel)
    mm = _median_ms(mm_fn, iters)
    logits = jax.random.normal(jax.random.key(0), (rows, model.cfg.vocab_size), jnp.float32)
    keys = jax.vmap(jax.random.key)(jnp.arange(rows))
    zero = jnp.zeros((rows,), jnp.float32)
    samp = jax.jit(lambda lg, k: sample_tokens(lg, k, zero, jnp.zeros((rows,), jnp.int32), zero + 1.0))
    sampling = _median_ms(lambda: samp(logits, keys), iters)
    # Host: a server at the same geometry, every slot live; its step() minus the device step.
    server = RolloutServer.from_model(model, _profile_section(rows, context, attention_impl, page))
    prompt = (np.arange(context) % 97 + 3).tolist()
    for i in range(rows):
        server.submit(Request(uid=str(i), prompt_ids=prompt, seed=i,
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=200, stop_token_ids=())))
    for _ in range(3):  # admissions and compiles
        server.step()
    if server.stats().slots_used != rows:
        raise RuntimeError(f"profile server holds {server.stats().slots_used} live sequences, not {rows}")
    srv = _median_ms(lambda: server.step(), iters)
    paired = {} if peak is None else paired_fractions(step, flops, *peak, 2 * iters + 1)
    return {**paired, "rows": rows, "context": context, "page_size": page, "attention_impl": attention_impl,
            "step_ms": full, "tokens_per_s": rows / full * 1e3,
            "attention_ms": full - no_attn, "matmul_ms": mm, "matmul_gflops": flops / mm / 1e6,
            "step_matmul_gflops": flops / full / 1e6, "sampling_ms": sampling,
            "host_ms": max(srv - full, 0.0), "server_step_ms": srv,
            "other_ms": max(full - (full - no_attn) - mm - sampling, 0.0), "ops": ops}


def run_profile(preset: str, dtypes: list[str], rows_list: list[int], context: int, iters: int,
                trace_dir: Optional[str] = None, page: int = 64, attention_impl: str = "auto") -> dict:
    """Decode-step profile per dtype and row count, against the matmul peak measured in the same run:
    '%peak' is the median over rounds of one step and one peak product back to back, with its range;
    '%best' the median step against the best peak product of those rounds (the step's worst case).
    Each step's time per XLA op is traced into trace_dir/<dtype>_<rows> when trace_dir is set."""
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.model import PRESETS, Transformer

    cfg = PRESETS[preset]
    out: dict[str, Any] = {"bench": "engine_profile", "preset": preset, "params_m": cfg.num_params() / 1e6,
                           "context": context, "page_size": page, "attention_impl": attention_impl, "rows": {}}
    print(f"decode-step profile: preset={preset} ({cfg.num_params() / 1e6:.1f}M params) context={context} "
          f"page_size={page} attention={attention_impl}")
    print(f"{'dtype':<9}{'rows':>5}{'step ms':>9}{'tok/s':>8}{'attn':>7}{'matmul':>8}{'GF/s':>7}{'step GF/s':>10}"
          f"{'peak':>7}{'%peak':>7}{'range':>10}{'%best':>7}{'sample':>8}{'host':>7}{'other':>7}{'load':>6}")
    for dtype in dtypes:
        apply_matmul_precision("auto", dtype)  # as a run of this dtype would (runtime.matmul_precision)
        dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt)
        for rows in rows_list:
            r = profile_decode(model, rows, context, iters,
                               None if trace_dir is None else os.path.join(trace_dir, f"{dtype}_{rows}"), page,
                               attention_impl, peak=peak_product(dtype))
            r.update(frac_of_best_peak=r["step_matmul_gflops"] / r["peak_gflops"], load_avg=os.getloadavg()[0])
            out["rows"][f"{dtype}_{rows}"] = r
            spread = f"{r['frac_of_peak_min']:.0%}-{r['frac_of_peak_max']:.0%}"
            print(f"{dtype:<9}{rows:>5}{r['step_ms']:>9.1f}{r['tokens_per_s']:>8.0f}{r['attention_ms']:>7.1f}"
                  f"{r['matmul_ms']:>8.1f}{r['matmul_gflops']:>7.0f}{r['step_matmul_gflops']:>10.0f}"
                  f"{r['peak_gflops']:>7.0f}{r['frac_of_peak']:>7.0%}{spread:>10}{r['frac_of_best_peak']:>7.0%}"
                  f"{r['sampling_ms']:>8.1f}{r['host_ms']:>7.1f}{r['other_ms']:>7.1f}{r['load_avg']:>6.1f}", flush=True)
            if r["ops"] is not None:
                optrace.print_table(r["ops"], f"  {dtype} decode step call at {rows} rows, traced")
    return out
