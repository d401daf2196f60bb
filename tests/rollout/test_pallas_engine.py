"""Engines on the registered Pallas decode kernels (GPU Triton and TPU Mosaic paged attention, in
interpret mode on the CPU) against the portable live_pages: the engine allocates the head-major
pools the kernels declare, and prefill, share_prompt, decode across page boundaries, ragged lengths,
GQA 2 and 4, f32 and bf16 give the portable kernel's tokens and log-probs; a sequence exported from
one pool layout imports into the other and continues as if unmoved; TP 2 (fake devices, in a
subprocess) runs the kernels per KV-head shard."""

import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from tests.rollout import pallas_engine_cases as cases
from tests.rollout.rollout_helpers import layer_pools
from tests.subprocess_env import child_env


def _same(got, want, dtype, what):
    (gt, gl), (wt, wl) = got, want
    np.testing.assert_array_equal(gt, wt, err_msg=f"{what}: tokens")
    np.testing.assert_allclose(gl, wl, atol=cases.tolerance(dtype, what), rtol=0, err_msg=f"{what}: log-probs")


SLOW = pytest.mark.slow  # interpret mode: ~1 min each on 2 cores; one case of each kernel stays in the default tier


@pytest.mark.parametrize("kernel,kv_heads,dtype", [
    ("pallas_gpu_paged", 2, jnp.float32),
    pytest.param("pallas_gpu_paged", 1, jnp.bfloat16, marks=SLOW),
    pytest.param("pallas_tpu_paged", 2, jnp.float32, marks=SLOW),
    ("pallas_tpu_paged", 1, jnp.bfloat16),
], ids=["gpu-gqa2-f32", "gpu-gqa4-bf16", "tpu-gqa2-f32", "tpu-gqa4-bf16"])
def test_pallas_engine_decodes_as_the_portable_kernel(kernel, kv_heads, dtype):
    eng, toks, lps = cases.run(kernel, kv_heads, dtype)
    assert eng.attention_impl == kernel and eng.pool_layout == "head_major"
    k_pool = layer_pools(eng.init_decode_state().k_pages, eng.model_cfg.num_layers, eng.pool_layout)[0]
    assert k_pool.shape == (kv_heads, cases.SECTION.num_pages, cases.PAGE, 32)
    assert k_pool.dtype == dtype  # head-major pools keep the float dtype
    ref, rtoks, rlps = cases.run("live_pages", kv_heads, dtype)
    assert ref.pool_layout == "split"
    _same((toks, lps), (rtoks, rlps), dtype, kernel)
    np.testing.assert_array_equal(toks[3], toks[0])  # the shared prompt decodes as its source (greedy)


@SLOW
def test_pallas_engine_samples_as_the_portable_kernel():
    _, toks, lps = cases.run("pallas_gpu_paged", 2, jnp.float32, temperature=0.8)
    _, rtoks, rlps = cases.run("live_pages", 2, jnp.float32, temperature=0.8)
    _same((toks, lps), (rtoks, rlps), jnp.float32, "sampled")


@pytest.mark.parametrize("src_kernel,dst_kernel", [("live_pages", "pallas_tpu_paged"),
                                                   ("pallas_gpu_paged", "live_pages")], ids=["split-to-hm", "hm-to-split"])
def test_a_sequence_moves_between_pool_layouts(src_kernel, dst_kernel):
    dtype = jnp.float32
    ref, rp = cases.engine(src_kernel, 2, dtype)
    _, stay, stay_lp = cases.decode(ref, rp, cases.admit(ref, rp), 11)  # the unmoved sequence
    src, sp = cases.engine(src_kernel, 2, dtype)
    dst, dp = cases.engine(dst_kernel, 2, dtype)
    state, first, _ = cases.decode(src, sp, cases.admit(src, sp), 5)
    np.testing.assert_array_equal(first, stay[:, :5])
    # Slot 1 (a prompt ending on a page boundary, now past it) leaves in the wire layout.
    _, moved = cases.move(src, dst, sp, dp, state, 1)
    _, got, got_lp = cases.decode(dst, dp, moved, 6)
    np.testing.assert_array_equal(got[1], stay[1, 5:])
    np.testing.assert_allclose(got_lp[1], stay_lp[1, 5:], atol=cases.tolerance(dtype, dst_kernel), rtol=0)


def test_exported_pages_are_the_wire_layout_whatever_the_pools():
    split, sp = cases.engine("live_pages", 2, jnp.float32)
    hm, hp = cases.engine("pallas_gpu_paged", 2, jnp.float32)
    n = len(cases.PROMPTS[1]) - 1
    a = split.read_slot(cases.admit(split, sp), 1, n)
    b = hm.read_slot(cases.admit(hm, hp), 1, n)
    for x, y in zip(a, b):  # f[L, pages, page, Hkv, D]
        assert x.shape == y.shape == (2, -(-n // cases.PAGE), cases.PAGE, 2, 32)
        np.testing.assert_array_equal(x, y)  # prefill writes the same bits in either layout


def test_an_explicit_kernel_that_cannot_serve_is_an_error_naming_the_field():
    import dataclasses

    from laminar_jax.rollout import make_engine

    with pytest.raises(ValueError, match=r"rollout\.attention_impl='pallas_tpu_paged' cannot run off TPU"):
        make_engine(cases.model(2, jnp.float32), dataclasses.replace(cases.SECTION, attention_impl="pallas_tpu_paged"))
    with pytest.raises(ValueError, match=r"rollout\.attention_impl='pallas_gpu_paged' cannot run off GPU"):
        make_engine(cases.model(2, jnp.float32), dataclasses.replace(cases.SECTION, attention_impl="pallas_gpu_paged"))


TP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from laminar_jax.rollout.tp import tp_mesh
    from tests.rollout import pallas_engine_cases as cases
    mesh = tp_mesh(jax.devices()[:2])
    _, want, want_lp = cases.run("live_pages", 2, jnp.float32)
    for kernel in ("pallas_gpu_paged", "pallas_tpu_paged"):
        eng, toks, lps = cases.run(kernel, 2, jnp.float32, mesh=mesh)
        pool = eng.init_decode_state().k_pages  # every layer's pages in one pool
        assert pool.sharding.spec[0] == "tensor", pool.sharding  # split on the KV heads (head-major axis 0)
        np.testing.assert_array_equal(toks, want)
        np.testing.assert_allclose(lps, want_lp, atol=cases.tolerance(jnp.float32, kernel), rtol=0)
        print(kernel, "ok")
""")


@SLOW
def test_tp2_runs_the_kernels_per_kv_head_shard():
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", TP], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("ok") == 2
