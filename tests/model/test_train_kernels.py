"""Training attention from kernel libraries (model/train_kernels.py) against dense: values and
gradients on packed rows with padding. Splash runs its Pallas kernels in interpret mode on CPU;
tokamax's Triton kernel cannot (its in-loop program ids have no CPU rule in JAX's interpreter), so on
CPU the tokamax path runs tokamax's own XLA implementation of the same op with the same segment mask,
and the compiled kernels run where a GPU is present."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.model import train_kernels
from laminar_jax.model.attention import dense_attention, resolve_train_attention, train_attention
from tests.model.test_train_attention import _loss, _packed_inputs

# tokamax is the gpu extra, not a test dependency: its tests skip without it, splash runs regardless.
HAS_TOKAMAX = importlib.util.find_spec("tokamax") is not None
needs_tokamax = pytest.mark.skipif(not HAS_TOKAMAX, reason="tokamax not installed (pip install tokamax)")
ON_GPU = jax.default_backend() == "gpu"


def _compare(fn, *, b=2, t=40, h=4, hkv=2, d=16, atol=2e-5):
    q, k, v, seg = _packed_inputs(b=b, t=t, h=h, hkv=hkv, d=d)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    real = np.asarray(seg) != 0
    ref, out = np.asarray(dense_attention(q, k, v, seg)), np.asarray(fn(q, k, v, seg))
    np.testing.assert_allclose(out[real], ref[real], atol=atol, rtol=atol)
    g_ref = jax.grad(_loss, argnums=(1, 2, 3))(dense_attention, q, k, v, seg, w)
    g = jax.grad(_loss, argnums=(1, 2, 3))(fn, q, k, v, seg, w)
    for a, b_ in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=atol, rtol=atol)


def test_segment_starts():
    seg = jnp.asarray([[1, 1, 2, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(train_kernels.segment_starts(seg)),
                                  [[0, 0, 2, 2, 2, 5, 6, 7], [0] * 8])


@needs_tokamax
@pytest.mark.parametrize("h,hkv", [(4, 2), (7, 1)], ids=["g2", "g7"])
def test_tokamax_mask_through_its_xla_op_equals_dense(h, hkv):
    _compare(lambda *a: train_kernels.tokamax_attention(*a, implementation=("xla",)), h=h, hkv=hkv)


@needs_tokamax
@pytest.mark.skipif(not ON_GPU, reason="tokamax's Mosaic GPU / Triton kernels compile only for a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_tokamax_kernel_on_gpu_equals_dense(dtype):
    fn = lambda q, k, v, s: train_kernels.tokamax_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), s)
    _compare(lambda *a: fn(*a).astype(jnp.float32), t=256, h=8, hkv=2, d=64,
             atol=2e-2 if dtype == jnp.bfloat16 else 2e-3)


@pytest.mark.parametrize("h,hkv", [(4, 2), (7, 1)], ids=["g2", "g7"])
def test_splash_interpret_equals_dense(h, hkv):
    # t=40 pads to one 128 block; block 128 is splash's smallest tile on a TPU.
    _compare(lambda *a: train_kernels.splash_attention(*a, interpret=True), h=h, hkv=hkv)


def test_auto_and_explicit_choice():
    assert resolve_train_attention("auto", "tpu")[0] == "splash"
    assert resolve_train_attention("auto", "gpu")[0] == ("tokamax" if HAS_TOKAMAX else "pallas_gpu")
    assert train_kernels.auto_name("gpu", tokamax_installed=False)[0] == "pallas_gpu"
    assert resolve_train_attention("auto", "cpu")[0] == "dense"
    assert resolve_train_attention("flash", "cpu") == ("flash", "set in the config")
    with pytest.raises(ValueError, match="learner.attention_impl='splash' runs on TPU"):
        resolve_train_attention("splash", "cpu")
    with pytest.raises(ValueError, match="learner.attention_impl='tokamax' runs on GPU"):
        resolve_train_attention("tokamax", "tpu")
    assert train_attention("tokamax") is train_kernels.tokamax_attention
    assert train_attention("splash") is train_kernels.splash_attention


def test_learner_refuses_an_explicit_kernel_off_its_platform():
    from flax import nnx

    from laminar_jax.learner import Learner, LearnerSection
    from laminar_jax.model import PRESETS, Transformer

    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="learner.attention_impl='splash' runs on TPU, not cpu"):
        Learner(LearnerSection(attention_impl="splash"), model)
    learner = Learner(LearnerSection(attention_impl="auto"), model)
    try:
        assert learner.train_attention == "dense"
    finally:
        learner.close()
