"""The learner benchmark's FLOP count: matmul weights only (no embedding lookup), recompute kept apart."""

import dataclasses

import pytest

from laminar_jax.benchmarks.learner import flops_per_token, matmul_params
from laminar_jax.model import PRESETS


def test_matmul_params_excludes_lookup_and_norms():
    for name in ("qwen2.5-0.5b", "qwen2.5-7b", "tiny"):
        cfg = PRESETS[name]
        d, v, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
        norms = 2 * d * L + d
        lookup = 0 if cfg.tie_word_embeddings else v * d  # a tied matrix is counted once, as the lm_head
        assert matmul_params(cfg) == cfg.num_params() - norms - lookup, name
    untied = dataclasses.replace(PRESETS["qwen2.5-0.5b"], tie_word_embeddings=False)
    assert matmul_params(untied) == matmul_params(PRESETS["qwen2.5-0.5b"])  # same FLOPs either way


def test_model_flops_ignore_recompute_hardware_flops_count_it():
    cfg = PRESETS["qwen2.5-0.5b"]
    seq = 1024
    base = flops_per_token(cfg, seq, "none", lm_head_recomputed=False)
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
    assert base.model == base.hardware == 6 * matmul_params(cfg) + attn
    full = flops_per_token(cfg, seq, "full", lm_head_recomputed=True)
    assert full.model == base.model
    layer_fwd = 2 * (matmul_params(cfg) - cfg.vocab_size * cfg.hidden_size) + attn / 3
    assert full.hardware == base.model + layer_fwd + 2 * cfg.vocab_size * cfg.hidden_size
    dots = flops_per_token(cfg, seq, "dots_with_no_batch_dims_saveable", lm_head_recomputed=False)
    assert dots.hardware == base.model + attn / 3


def test_memory_plan_sees_attention_and_remat():
    """bench learner --memory-plan: autodiff residuals shrink with chunked attention and with remat."""
    import jax.numpy as jnp

    from laminar_jax.benchmarks.learner import memory_plan
    from laminar_jax.learner import LearnerSection
    from laminar_jax.model import PRESETS

    def plan(**kw):
        return memory_plan(PRESETS["tiny"], LearnerSection(attention_chunk=64, **kw), 1, 512, jnp.float32)

    dense, chunked = plan(attention_impl="dense"), plan(attention_impl="chunked")
    full = plan(attention_impl="dense", remat="full")
    scores = 2 * 4 * 512 * 512 * 4  # tiny: 2 layers x 4 heads of f32 [T, T] probabilities, at least
    assert dense["residual_gb"] * 1e9 > scores  # measured 46 MB
    assert chunked["residual_gb"] < dense["residual_gb"] / 4  # measured 8.5 MB: the other activations
    assert full["residual_gb"] < chunked["residual_gb"]
    assert dense["temp_gb"] > 0 and dense["rows"] == 1 and dense["seq"] == 512


def test_attention_speed_times_every_portable_attention():
    from laminar_jax.benchmarks.learner import attention_speed

    out = attention_speed(64, block=16, reps=1)
    assert all(out[f"{n}_s"] > 0 for n in ("dense", "chunked", "flash")) and out["flash_vs_dense"] > 0


def test_host_copy_speed_times_three_paths_of_the_same_weights():
    """bench learner --host-copy-speed: each path's median and spread, on the preset's f32 weights
    (the CPU has pinned host memory too, so every path runs)."""
    from laminar_jax.benchmarks import learner as learner_bench

    out = learner_bench.main(["--host-copy-speed", "--preset", "tiny"])
    cfg = learner_bench.PRESETS["tiny"]
    assert out["bench"] == "host_copy" and out["gb"] == pytest.approx(cfg.num_params() * 4 / 1e9, rel=0.05)
    for name in ("unpinned", "pinned_device_put", "snapshot", "h2d_direct", "h2d_via_pinned"):
        lo, hi = out[f"{name}_spread_s"]
        assert 0 < lo <= out[f"{name}_s"] <= hi
