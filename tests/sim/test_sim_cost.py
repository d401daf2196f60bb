"""Cost-model units against hand computations (numbers typed from the model cards / spec sheets)."""

import math

import numpy as np
import pytest

from laminar_jax.sim.cost import CostModel, CostParams
from laminar_jax.sim.hardware import gpu_spec, model_shape
from laminar_jax.sim.workload import PRESETS, sample

P7 = 7_615_616_512  # Qwen2.5-7B parameters (HF safetensors total)
W7 = 2 * P7  # bf16 bytes


def cm(name="qwen2.5-7b", gpu="h800", tp=1, **kw):
    return CostModel(model_shape(name), gpu_spec(gpu), CostParams(**kw), tp)


def test_shapes():
    assert model_shape("qwen2.5-7b").params == P7
    assert abs(model_shape("qwen2.5-32b").params / 1e9 - 32.76) < 0.01
    assert abs(model_shape("qwen2.5-72b").params / 1e9 - 72.71) < 0.01
    assert model_shape("qwen2.5-7b").kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # 57,344
    assert model_shape("qwen2.5-72b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    with pytest.raises(ValueError, match="sim.model"):
        model_shape("gpt-17")


def test_decode_memory_bound_by_hand():
    c = cm()
    # batch 1, no context: read all weights at 3350 GB/s * 0.8, plus 4 ms overhead.
    assert float(c.decode_step_s(1, 0)) == pytest.approx(W7 / (3350e9 * 0.8) + 0.004, rel=1e-9)
    # batch 64 at 4096 tokens each: + KV bytes.
    kv = 57344 * 64 * 4096
    assert float(c.decode_step_s(64, 64 * 4096)) == pytest.approx((W7 + kv) / (3350e9 * 0.8) + 0.004, rel=1e-9)
    assert float(c.decode_step_s(0, 0)) == 0.0


def test_decode_compute_bound_and_tp_by_hand():
    c = cm()
    m = model_shape("qwen2.5-7b")
    b = 4096  # huge batch, no context: matmul FLOPs bind
    flops = 2 * m.matmul_params * b
    assert float(c.decode_step_s(b, 0)) == pytest.approx(flops / (989e12 * 0.6) + 0.004, rel=1e-9)
    c2 = cm(tp=2)
    allreduce = 2 * 28 * (10e-6 + 2 * 1 / 2 * 1 * 3584 * 2 / 200e9)
    assert float(c2.decode_step_s(1, 0)) == pytest.approx(W7 / 2 / (3350e9 * 0.8) + 0.004 + allreduce, rel=1e-9)
    # vectorised over servers
    np.testing.assert_allclose(c.decode_step_s(np.array([1, 64]), np.array([0, 64 * 4096])),
                               [float(c.decode_step_s(1, 0)), float(c.decode_step_s(64, 64 * 4096))])


def test_prefill_kv_learner_relay_by_hand():
    c = cm()
    m = model_shape("qwen2.5-7b")
    flops = 2 * m.matmul_params * 1000 + 2 * 28 * 28 * 128 * 1000 ** 2
    assert float(c.prefill_s(1000, 1000 ** 2)) == pytest.approx(flops / (989e12 * 0.5) + 0.01, rel=1e-9)
    assert c.kv_pages() == math.floor((0.9 * 80 * 2**30 - W7) / (16 * 57344))
    assert c.learner_step_s(1e6, 64) == pytest.approx(6 * P7 * 1e6 / (64 * 989e12 * 0.35) + 0.5, rel=1e-9)
    chunk_s = 32e6 / (50e9 * 8 * 0.5) + 1e-3
    assert c.relay_arrival_s(3) == pytest.approx((math.ceil(W7 / 32e6) + 3) * chunk_s, rel=1e-9)
    assert c.weight_load_s() == pytest.approx(W7 / 50e9 + 0.5, rel=1e-9)
    assert c.publish_d2h_s(16) == pytest.approx(W7 / 16 / 50e9, rel=1e-9)
    # 16 bytes/param at 80% of 80 GiB: 7B needs 1.77 GPUs -> one machine.
    assert c.min_learner_gpus() == 8
    assert cm("qwen2.5-72b").min_learner_gpus() == 8 * math.ceil(72.7e9 * 16 / (0.8 * 80 * 2**30) / 8)


def test_min_tp():
    assert [cm(n).min_tp() for n in ("qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b")] == [1, 2, 4]


def test_math_workload_shape():
    spec = PRESETS["math"]
    s = sample(spec, 20000, 16, np.random.default_rng(0))
    med, p99 = np.median(s.response_len), np.percentile(s.response_len, 99)
    assert 1350 < med < 1650
    assert 8.5 < p99 / med < 11  # p99 ~ 10x median (clipping at 16K trims it a little)
    assert s.response_len.max() <= 16384 and s.prompt_len.max() <= 2048
    assert (s.prompt_len.reshape(-1, 16) == s.prompt_len.reshape(-1, 16)[:, :1]).all()  # one prompt per group
