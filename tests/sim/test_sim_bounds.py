"""Sync and one_step against their physical upper bounds, computed by hand from the spec sheet.

Per learner step (one version, 512 prompts x 16 samples), nothing can beat:
  decode   the longest trajectory's R tokens, one decode step each, and a step reads at least the
           weights: R * (weight_bytes / tp / (HBM * mem_eff) + decode overhead), plus, when every
           sequence is admitted at once (uniform lengths), the KV of the b sequences of the fullest
           server at context prompt + j on step j. b = max_num_seqs = 256: a server takes as many
           queued prompts as it has free slots (the runtime's RolloutWorker._admit), so the first
           servers to pull fill up
  learner  6 * params * tokens / (GPUs * peak * MFU) + step overhead (+ optimizer state off/onload
           over PCIe when colocated)
  weights  the learner's device-to-host copy (weights / learner GPUs / PCIe) and a server's load
           (weights / tp / PCIe + load overhead)
sync pays all three in series; one_step overlaps generation with training, so its step takes at
least max(learner + d2h, decode + load). The simulator must stay under the bound, and within 20%
of it where nothing else costs much: uniform lengths with few sequences per server (decode steps
stay near the weight-read floor), and the math workload's sync, whose step is its 16K-token tail
(the reason sync is flat from 64 to 1024 GPUs).
"""

import pytest

from laminar_jax.sim import SimSection, simulate
from laminar_jax.sim.hardware import GPUS, model_shape

H800 = GPUS["h800"]
HBM_EFF, DECODE_OVERHEAD, MFU, STEP_OVERHEAD, LOAD_OVERHEAD = 0.8, 0.004, 0.35, 0.5, 0.5  # CostParams defaults
PEAK, HBM, PCIE = H800.bf16_tflops * 1e12, H800.hbm_gbps * 1e9, H800.pcie_gbps * 1e9


def by_hand(model: str, gpus: int, learner_gpus: int, tp: int, response: int, step_tokens: float,
            colocate: bool, batch: int = 0, prompt: int = 0) -> dict:
    m = model_shape(model)
    weights = 2 * m.params
    kv_token = 2 * m.layers * m.kv_heads * m.head_dim * 2  # bf16 K and V per token
    kv_reads = batch * kv_token * (response * prompt + response * (response - 1) / 2)
    decode = response * (weights / tp / (HBM * HBM_EFF) + DECODE_OVERHEAD) + kv_reads / tp / (HBM * HBM_EFF)
    learn = 6 * m.params * step_tokens / (learner_gpus * PEAK * MFU) + STEP_OVERHEAD
    if colocate:
        learn += 2 * m.params * 16 / learner_gpus / PCIE
    d2h = weights / learner_gpus / PCIE
    load = weights / tp / PCIE + LOAD_OVERHEAD
    return {"decode": decode, "learn": learn, "d2h": d2h, "load": load}


def step_tokens(r) -> float:
    return r.tokens_per_s * r.step_s  # tokens of one step (steady state)


@pytest.mark.parametrize("gpus", [64, 256])
def test_sync_uniform_under_and_near_its_bound(gpus):
    cfg = SimSection(model="qwen2.5-7b", gpus=gpus, mode="sync", colocate=True, rollout_tp=1, workload="uniform",
                     duration_s=600.0, warmup_s=120.0, min_steps=3)
    r = simulate(cfg)
    tokens = 512 * 16 * (300 + 1500)  # uniform: every prompt 300 tokens, every response 1500
    assert step_tokens(r) == pytest.approx(tokens, rel=1e-6)
    t = by_hand("qwen2.5-7b", gpus, gpus, 1, 1500, tokens, colocate=True, batch=256, prompt=300)
    bound = tokens / (t["decode"] + t["learn"] + t["d2h"] + t["load"])
    assert r.tokens_per_s <= bound
    assert r.tokens_per_s >= 0.8 * bound, (r.tokens_per_s, bound, t)


def test_one_step_uniform_learner_bound_is_tight():
    # 32 learner GPUs: the learner step (~60 s) dwarfs generation (~20 s), so one_step is learner-bound.
    cfg = SimSection(model="qwen2.5-7b", gpus=64, learner_gpus=32, mode="one_step", rollout_tp=1,
                     workload="uniform", duration_s=900.0, warmup_s=200.0, min_steps=3)
    r = simulate(cfg)
    tokens = 512 * 16 * 1800
    t = by_hand("qwen2.5-7b", 64, 32, 1, 1500, tokens, colocate=False)
    assert t["learn"] > 2 * t["decode"]
    bound = tokens / max(t["learn"] + t["d2h"], t["decode"] + t["load"])
    assert r.tokens_per_s <= bound * (1 + 1e-9)  # learner-bound: steps back to back, equal to the bound
    assert r.tokens_per_s >= 0.8 * bound, (r.tokens_per_s, bound, t)


def test_one_step_uniform_generation_bound():
    # tp 2: 16 servers of 512 sequences (two admission rounds of 256 slots): checked from above only.
    cfg = SimSection(model="qwen2.5-7b", gpus=64, learner_gpus=32, mode="one_step", rollout_tp=2,
                     workload="uniform", duration_s=900.0, warmup_s=200.0, min_steps=3)
    r = simulate(cfg)
    tokens = 512 * 16 * 1800
    t = by_hand("qwen2.5-7b", 64, 32, 2, 1500, tokens, colocate=False, batch=256, prompt=300)
    assert r.tokens_per_s <= tokens / max(t["learn"] + t["d2h"], t["decode"] + t["load"])


def test_math_sync_is_under_its_tail_bound_and_flat():
    """Sync on the math workload: each step waits for a 16K-token response (the clip; a batch of
    8192 draws with p99 = 15K almost surely reaches it), so its throughput stays under
    tokens / (16384 weight-read decode steps + learner + transfers) whatever the GPU count, and
    four times the GPUs buy little (only the learner's share shrinks)."""
    rates = {}
    for gpus in (64, 256):
        cfg = SimSection(model="qwen2.5-7b", gpus=gpus, mode="sync", colocate=True, rollout_tp=1,
                         duration_s=1200.0, warmup_s=300.0, min_steps=3)
        r = simulate(cfg)
        tokens = step_tokens(r)
        t = by_hand("qwen2.5-7b", gpus, gpus, 1, 16384, tokens, colocate=True)
        bound = tokens / (t["decode"] + t["learn"] + t["d2h"] + t["load"])
        assert 0.6 * bound <= r.tokens_per_s <= bound, (gpus, r.tokens_per_s, bound, t)
        rates[gpus] = r.tokens_per_s
    assert rates[256] < 1.35 * rates[64]
