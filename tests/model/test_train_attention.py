"""Training attention implementations agree with dense attention (values and gradients), on packed rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.model import PRESETS, Transformer
from laminar_jax.model.attention import chunked_attention, dense_attention, pallas_gpu_attention, train_attention
from laminar_jax.model.flash import flash_attention


def _packed_inputs(b=2, t=40, h=4, hkv=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (h, hkv, hkv))
    # Row 0: three packed segments then padding; row 1: one segment, no padding.
    seg = np.zeros((b, t), np.int32)
    seg[0, :11], seg[0, 11:25], seg[0, 25:33] = 1, 2, 3
    seg[1, :] = 1
    return q, k, v, jnp.asarray(seg)


def _loss(fn, q, k, v, seg, w):
    out = fn(q, k, v, seg)
    return jnp.sum(out * w * (seg != 0)[:, :, None, None])  # padding rows never reach a loss


@pytest.mark.parametrize("chunk", [8, 16, 13, 64])
def test_chunked_equals_dense_values_and_grads(chunk):
    q, k, v, seg = _packed_inputs()
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    ref = dense_attention(q, k, v, seg)
    out = chunked_attention(q, k, v, seg, chunk=chunk)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    g_ref = jax.grad(_loss, argnums=(1, 2, 3))(dense_attention, q, k, v, seg, w)
    g = jax.grad(_loss, argnums=(1, 2, 3))(lambda *a: chunked_attention(*a, chunk=chunk), q, k, v, seg, w)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("block", [8, 16, 13, 64])
def test_flash_equals_dense_values_and_grads(block):
    q, k, v, seg = _packed_inputs()
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    ref = np.asarray(dense_attention(q, k, v, seg))
    out = np.asarray(flash_attention(q, k, v, seg, block=block))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    assert np.all(out[np.asarray(seg) == 0] == 0)  # padding rows: zeros, as dense
    g_ref = jax.grad(_loss, argnums=(1, 2, 3))(dense_attention, q, k, v, seg, w)
    g = jax.grad(_loss, argnums=(1, 2, 3))(lambda *a: flash_attention(*a, block=block), q, k, v, seg, w)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_flash_grads_include_padding_row_cotangents():
    """Cotangents on padding rows (which dense maps to zeros) contribute nothing, as in dense."""
    q, k, v, seg = _packed_inputs()
    w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    f_ref = lambda q, k, v: jnp.sum(dense_attention(q, k, v, seg) * w)  # noqa: E731
    f = lambda q, k, v: jnp.sum(flash_attention(q, k, v, seg, block=16) * w)  # noqa: E731
    for a, b in zip(jax.grad(f, argnums=(0, 1, 2))(q, k, v), jax.grad(f_ref, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_chunked_holds_one_chunk_of_scores():
    """The compiled backward pass of chunked attention needs far less scratch memory than dense."""
    q, k, v, seg = _packed_inputs(b=2, t=1024, h=4, hkv=2, d=16)
    w = jnp.ones(q.shape, jnp.float32)

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(_loss, argnums=(1, 2, 3)), static_argnums=(0,))
        return grad.lower(fn, q, k, v, seg, w).compile().memory_analysis().temp_size_in_bytes

    dense, chunked = temp_bytes(dense_attention), temp_bytes(lambda *a: chunked_attention(*a, chunk=64))
    flash = temp_bytes(lambda *a: flash_attention(*a, block=64))
    scores = 2 * 4 * 1024 * 1024 * 4  # f32[B, H, T, T]
    one_chunk = scores * 64 // 1024
    assert dense >= scores, dense  # dense keeps full [B, H, T, T] score tensors
    assert chunked < 8 * one_chunk and chunked < dense / 8, (chunked, dense)  # measured: 10.3 MB vs 135 MB
    assert flash < chunked / 2, (flash, chunked)  # measured 3.2 MB: O(T x D) buffers, [64, 64] score blocks


def test_pallas_gpu_kernel_matches_dense_in_interpret_mode():
    q, k, v, seg = _packed_inputs(t=40)
    real = np.asarray(seg) != 0
    ref = np.asarray(dense_attention(q, k, v, seg))
    fn = lambda *a: pallas_gpu_attention(*a, block=16, interpret=True)  # noqa: E731
    np.testing.assert_allclose(np.asarray(fn(q, k, v, seg))[real], ref[real], atol=1e-5)
    # The backward kernels too (the learner differentiates through them).
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    g_ref = jax.grad(_loss, argnums=(1, 2, 3))(dense_attention, q, k, v, seg, w)
    g = jax.grad(_loss, argnums=(1, 2, 3))(fn, q, k, v, seg, w)
    for name, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, err_msg=f"d{name}")


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="the compiled Pallas kernel needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-2), (jnp.bfloat16, 6e-2)])
def test_pallas_gpu_kernel_on_a_gpu_matches_dense_values_and_grads(dtype, tol):
    # The real kernel (not interpret mode), at a length that is not a multiple of its block (padding),
    # with packed segments and grouped KV heads. The reference runs at full f32 precision; the kernel's
    # dots may use TF32 / bf16 inputs, hence tolerances relative to the outputs' scale (~1).
    q, k, v, seg = _packed_inputs(b=2, t=300, h=8, hkv=2, d=64)
    seg = np.array(seg)
    seg[0, 33:200], seg[0, 200:280] = 4, 5  # five segments in row 0, padding after 280
    seg = jnp.asarray(seg)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(dense_attention(q, k, v, seg))
        g_ref = jax.grad(_loss, argnums=(1, 2, 3))(dense_attention, q, k, v, seg, w)
    qc, kc, vc = (x.astype(dtype) for x in (q, k, v))
    fn = jax.jit(lambda q, k, v, s: pallas_gpu_attention(q, k, v, s, block=64))
    real = np.asarray(seg) != 0
    out = np.asarray(fn(qc, kc, vc, seg).astype(jnp.float32))
    np.testing.assert_allclose(out[real], ref[real], atol=tol)
    g = jax.grad(lambda q, k, v: _loss(fn, q, k, v, seg, w.astype(dtype)).astype(jnp.float32),
                 argnums=(0, 1, 2))(qc, kc, vc)
    for name, a, b in zip("qkv", g, g_ref):
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b)
        scale = np.abs(b).max()
        np.testing.assert_allclose(a / scale, b / scale, atol=tol, err_msg=f"d{name}")


def test_model_forward_same_logits_and_grads_with_chunked_attention():
    cfg = PRESETS["tiny"] if "tiny" in PRESETS else PRESETS["small"]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 48)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 20 + [0] * 8], 2, axis=0), jnp.int32)
    pos = jnp.asarray(np.repeat([list(range(20)) * 2 + [0] * 8], 2, axis=0), jnp.int32)

    def loss(p, attention, remat):
        out = nnx.merge(graphdef, p).forward(tokens, pos, seg, remat=remat, attention=attention, attention_chunk=16)
        return jnp.sum(jax.nn.log_softmax(out.logits)[..., 5] * (seg != 0)), out.logits

    # Jitted, as the learner runs it (op by op this test took ~15 s).
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(1, 2))
    (l_ref, logits_ref), g_ref = grad(params, "dense", "none")
    for attention in ("chunked", "flash"):
        (l_c, logits_c), g_c = grad(params, attention, "full")
        np.testing.assert_allclose(np.asarray(logits_c), np.asarray(logits_ref), atol=1e-4, err_msg=attention)
        np.testing.assert_allclose(float(l_c), float(l_ref), rtol=1e-5, err_msg=attention)
        for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, err_msg=attention)


def test_unknown_attention_names_itself():
    with pytest.raises(ValueError, match="attention_impl='ring'"):
        train_attention("ring")
