"""Compile time against depth: ``python launch/bench.py startup --depths 4,28 [--repeats 3]``.

A model of tiny width (so compilation, not compute, sets the time) is built at each depth, and in
a fresh process per (depth, repeat), with the persistent compilation cache off, it measures:

- ``learner_s``: compiling the learner's step (its first ``Learner.step``: the prepare pass and the
  update program, under the section's default remat policy);
- ``engine_s``: compiling the rollout engine's programs (``rollout.warmup.warmup``: prefill + insert, the
  page copies and the decode program).

Each is the sum of JAX's compile events (tracing, lowering, backend compilation). The last line's
``compile_ratio_learner`` / ``compile_ratio_engine`` are the deepest depth's median over the
shallowest's: with the layers as a scan, compile time stops growing with depth (goal <= 1.5).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

# JAX's compile events, summed per phase (bench startup reads them too).
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "backend_s"}

WIDTH = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
             max_position_embeddings=512)


def _compile_seconds(fn) -> float:
    """Seconds of JAX compile events (trace + lower + backend) while fn() runs."""
    import jax.monitoring

    total = [0.0]
    active = [True]

    def on_duration(event, duration, **_):
        if active[0] and event in EVENTS:
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        fn()
    finally:
        active[0] = False  # listeners cannot be removed one by one: this one stops counting
    return total[0]


def _child(depth: int) -> dict:
    """One depth in this process: the learner step's and the engine's compile seconds."""
    import jax
    from flax import nnx

    jax.config.update("jax_enable_compilation_cache", False)
    from laminar_jax.benchmarks.learner import synthetic_trajectories
    from laminar_jax.learner import Learner, LearnerSection
    from laminar_jax.model import Transformer
    from laminar_jax.model.arch import TransformerConfig
    from laminar_jax.rollout import RolloutSection, make_engine
    from laminar_jax.rollout.warmup import warmup

    cfg = TransformerConfig(num_layers=depth, **WIDTH)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    section = LearnerSection(lr=1e-6, adv_estimator="grpo", critic="none", seq_len_buckets=(64,),
                             compile_ahead="none")
    learner = Learner(section, model)
    trajs = synthetic_trajectories(4, 64, cfg.vocab_size, 2, 0)
    learner_s = _compile_seconds(lambda: learner.step(trajs, publish=False))
    learner.close()
    rollout = RolloutSection(num_slots=4, page_size=16, num_pages=33, prefill_buckets=(16,), max_prompt_len=16,
                             max_new_tokens=16, max_total_len=32, warmup_live_buckets=1, share_prompt_kv=False)
    engine, params = make_engine(model, rollout)
    engine_s = _compile_seconds(lambda: warmup(engine, params))
    return {"depth": depth, "learner_s": learner_s, "engine_s": engine_s}


def main(depths: tuple[int, ...], repeats: int) -> dict:
    from laminar_jax.benchmarks.machine import emit

    rows = []
    for r in range(repeats):
        for depth in depths:  # alternating depths share the machine's noise
            cmd = [sys.executable, "-m", "laminar_jax.benchmarks.startup_depth", str(depth)]
            env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
            line = next((x for x in out.stdout.splitlines() if x.startswith("DEPTH ")), None)
            if out.returncode != 0 or line is None:
                raise RuntimeError(f"depth {depth} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
            row = {**json.loads(line[6:]), "repeat": r, "load_avg": [round(x, 2) for x in os.getloadavg()]}
            rows.append(row)
            print(f"depth {depth:3d} (repeat {r}): learner compile {row['learner_s']:.2f} s, engine compile "
                  f"{row['engine_s']:.2f} s, load {row['load_avg']}", flush=True)
    med = {d: {k: statistics.median(x[k] for x in rows if x["depth"] == d) for k in ("learner_s", "engine_s")}
           for d in depths}
    lo, hi = min(depths), max(depths)
    result = {"bench": "startup", "depths": list(depths), "repeats": repeats, "width": WIDTH,
              "median": {str(d): v for d, v in med.items()}, "runs": rows,
              "compile_ratio_learner": med[hi]["learner_s"] / med[lo]["learner_s"],
              "compile_ratio_engine": med[hi]["engine_s"] / med[lo]["engine_s"]}
    return emit(result)


if __name__ == "__main__":
    print("DEPTH " + json.dumps(_child(int(sys.argv[1]))), flush=True)
