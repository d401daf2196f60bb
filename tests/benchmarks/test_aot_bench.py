"""bench aot: the decode step with the TPU Pallas kernel compiled ahead of time for a v5e (needs libtpu), and
the GPU kernels compiled for an H100 (needs JAX's CUDA PJRT plugin). Each runs where its library is
importable by this Python, or by the Python named in LAMINAR_TPU_PYTHON / LAMINAR_GPU_AOT_PYTHON;
otherwise it is skipped."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from laminar_jax.benchmarks import aot
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(module: str, env_var: str):
    try:
        here = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is absent
        here = False
    if here:
        return sys.executable
    return os.environ.get(env_var)


def _run(python: str, *args: str) -> dict:
    res = subprocess.run([python, "launch/bench.py", "aot", *args], cwd=ROOT, env=child_env(JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_needed_and_kernel_bytes():
    from laminar_jax.model import PRESETS

    cfg = PRESETS["qwen2.5-1.5b"]
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16, every layer
    assert aot.needed_bytes(cfg, 1000, rows=2, context=63, itemsize=2) == 1000 + 2 * 64 * kv_token
    # 33 pages per row: blocks of 1 page (33 is odd), so the kernel reads exactly the pages a row fills.
    assert aot.kernel_bytes(cfg, 2, 511, pages_per_seq=33, page=16, itemsize=2) == 2 * 512 * kv_token
    # 32 pages per row: blocks of 8 pages (128 tokens); 130 tokens read as 256.
    assert aot.kernel_bytes(cfg, 1, 129, pages_per_seq=32, page=16, itemsize=2) == 256 * kv_token


TPU_PYTHON = _python("libtpu", "LAMINAR_TPU_PYTHON")


@pytest.mark.skipif(TPU_PYTHON is None, reason="libtpu not installed (pip install 'laminar_jax[tpu]', or set "
                                                "LAMINAR_TPU_PYTHON to a Python that has it)")
def test_tpu_decode_step_compiles_for_v5e():
    out = _run(TPU_PYTHON, "--layers", "1", "--rows", "8", "--context", "127")
    assert out["device_kind"].startswith("TPU v5")
    assert out["mosaic_kernels"] == 1  # the Pallas kernel lowered through Mosaic, one per layer
    assert out["xla_bytes_accessed"] > 0 and out["ratio"] > 0


GPU_PYTHON = _python("jax_plugins.xla_cuda12", "LAMINAR_GPU_AOT_PYTHON")


@pytest.mark.slow  # three XLA:GPU compiles (Triton and Mosaic GPU), ~1 min
@pytest.mark.skipif(GPU_PYTHON is None, reason="JAX's CUDA PJRT plugin not installed (jax-cuda12-plugin and "
                                               "jax-cuda12-pjrt at the jax version), nor LAMINAR_GPU_AOT_PYTHON set")
def test_gpu_kernels_compile_for_h100():
    out = _run(GPU_PYTHON, "--gpu", "--rows", "8", "--context", "64")
    assert out["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert out["decode_pallas_gpu_paged"]["compiled"] and out["decode_pallas_gpu_paged"]["triton_calls"] >= 1
    assert out["train_tokamax_triton_fwd_bwd"]["compiled"], out["train_tokamax_triton_fwd_bwd"]
    assert out["train_tokamax_mosaic_fwd_bwd"]["mosaic_gpu_calls"] >= 1, out["train_tokamax_mosaic_fwd_bwd"]


HLO = """
%fused_computation.1 (param_0: bf16[4,1024], param_1: s32[2], param_2: bf16[2,1024]) -> bf16[4,1024] {
  ROOT %scatter.1 = bf16[4,1024]{1,0} scatter(%param_0, %param_1, %param_2), to_apply=%region
}

ENTRY %main (w: bf16[512,1024], pool: bf16[4,1024], x: bf16[8,1024]) -> bf16[8,512] {
  %w = bf16[512,1024]{1,0} parameter(0)
  %pool = bf16[4,1024]{1,0} parameter(1)
  %x = bf16[8,1024]{1,0} parameter(2)
  %copy-start = (bf16[512,1024]{1,0:S(1)}, bf16[512,1024]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %copy-done = bf16[512,1024]{1,0:S(1)} copy-done(%copy-start)
  %fusion.1 = bf16[4,1024]{1,0} fusion(%pool, %idx, %upd), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(f)/write/scatter"}
  ROOT %convolution = bf16[8,512]{1,0} convolution(%x, %copy-done), metadata={op_name="jit(f)/proj/dot_general"}
}
"""


def test_hbm_traffic_counts_what_moves_through_hbm():
    total, by_op = aot.hbm_traffic(HLO)
    weight, x, out = 512 * 1024 * 2, 8 * 1024 * 2, 8 * 512 * 2
    assert dict(by_op)["copy-start"] == round(weight / 1e6, 1)
    # The prefetch reads the weight once; the product reads it on chip (nothing) and x, writes out;
    # the fused scatter writes in place (its updates, not the pool: here unnamed, so nothing).
    assert dict(by_op)["proj/dot_general"] == round((x + out) / 1e6, 1)
    assert total == weight + 4 + x + out  # (+ the copy's u32 semaphore, on chip)
    assert dict(by_op)["write/scatter"] == 0.0
