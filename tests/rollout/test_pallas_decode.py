"""The Pallas decode kernels (GPU Triton and TPU Mosaic paged attention) in interpret mode on CPU,
against the portable gather_dense path: ragged lengths, page boundaries, GQA 1/2/7, f32 and bf16,
and kv heads split over 2 devices (shard_map, in a subprocess)."""

import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax.numpy as jnp
import pytest

from laminar_jax.rollout import head_major, kernels_gpu, kernels_tpu
from tests.rollout.pallas_decode_cases import check, make_case
from tests.subprocess_env import child_env

GPU = kernels_gpu.make_decode(interpret=True)
TPU = kernels_tpu.make_decode(interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (7, 1)], ids=["g1", "g2", "g7"])
def test_gpu_paged_matches_reference(heads, kv_heads, dtype):
    check(GPU, make_case(heads=heads, kv_heads=kv_heads, dtype=dtype))


def test_gpu_paged_long_table_several_splits():
    # 16 pages per row: 16 partitions merged flash-style, rows ending mid-partition.
    check(GPU, make_case(rows=6, heads=4, kv_heads=2, page=8, pages_per_seq=16, seed=3))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (7, 1)], ids=["g1", "g2", "g7"])
def test_tpu_paged_matches_reference(heads, kv_heads, dtype):
    # The kernel rounds K and V to bf16 even from an f32 pool (supports() refuses f32 KV for that):
    # both dtypes are held to the bf16 tolerance.
    check(TPU, make_case(heads=heads, kv_heads=kv_heads, head_dim=128, page=16, dtype=dtype, seed=1),
          tol_dtype=jnp.bfloat16)


def test_supports_names_the_reason():
    geo = head_major.DecodeGeometry("gpu", jnp.bfloat16, 16, 64, 14, 2, 256)
    assert kernels_gpu.supports(geo) == (True, "")
    ok, why = kernels_gpu.supports(geo._replace(head_dim=80))
    assert not ok and "head_dim=80" in why
    ok, why = kernels_gpu.supports(geo._replace(platform="tpu"))
    assert not ok and "tpu" in why
    assert kernels_tpu.supports(geo._replace(platform="tpu", head_dim=128)) == (True, "")
    ok, why = kernels_tpu.supports(geo._replace(platform="tpu"))  # Qwen2.5-0.5B's head_dim 64
    assert not ok and "head_dim=64" in why
    ok, why = kernels_tpu.supports(geo._replace(platform="tpu", head_dim=128, kv_dtype=jnp.float32))
    assert not ok and "bfloat16" in why
    ok, why = kernels_tpu.supports(geo._replace(platform="tpu", head_dim=128, page_size=8))
    assert not ok and "page_size=8" in why


def test_tiling_divides_the_table():
    for n in (1, 3, 4, 12, 64, 256, 257):
        for page in (8, 16, 64):
            splits, pages = kernels_gpu.tiling(n, page)
            assert n % splits == 0 and (n // splits) % pages == 0
    assert kernels_gpu.tiling(256, 16) == (16, 8)
    assert kernels_tpu.pages_per_block(256, 16) == 8 and 12 % kernels_tpu.pages_per_block(12, 16) == 0


SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from laminar_jax.rollout import head_major, kernels_gpu, kernels_tpu
    from tests.rollout.pallas_decode_cases import check, make_case
    assert jax.device_count() == 2
    mesh = jax.sharding.Mesh(jax.devices(), ("tp",))  # auto axes, as the engine's TP mesh
    for name, kernel, kw in [("gpu", kernels_gpu.make_decode(interpret=True), dict(head_dim=16, page=8)),
                             ("tpu", kernels_tpu.make_decode(interpret=True), dict(head_dim=32, page=8))]:
        for heads, dtype in [(4, jnp.float32), (14, jnp.bfloat16)]:  # GQA 2 and 7 per shard's KV head
            check(head_major.shard_over_kv_heads(kernel, mesh, "tp"),
                  make_case(heads=heads, kv_heads=2, dtype=dtype, seed=heads, **kw), tol_dtype=jnp.bfloat16 if name == "tpu" else None)
            print(name, heads, "ok")
""")


def test_kv_heads_split_over_two_devices():
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("ok") == 4


class FakeSeamGeometry(NamedTuple):
    """A stand-in with the kernel seam's geometry fields (global heads, TP width)."""

    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: object = jnp.bfloat16
    tensor_parallel: int = 1
    pages_per_seq: int = 0


def test_refuses_reads_the_seams_geometry_per_shard():
    assert kernels_gpu.refuses(FakeSeamGeometry(12, 2, 128, 16, pages_per_seq=33)) is None
    assert "head_dim=80" in kernels_gpu.refuses(FakeSeamGeometry(12, 2, 80, 16))
    assert kernels_tpu.refuses(FakeSeamGeometry(14, 2, 64, 16)) == "head_dim=64 must be a multiple of 128 (a TPU lane tile)"
    geo = head_major.as_geometry(FakeSeamGeometry(28, 4, 128, 16, tensor_parallel=2), "tpu")
    assert (geo.num_heads, geo.num_kv_heads, geo.platform) == (14, 2, "tpu")  # one shard's heads
