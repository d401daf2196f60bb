"""The native CPU kernels (laminar_jax/cpu/native): the paged decode attention (rollout.attention_impl=
'cpu_kernel') against the portable live_pages backend on real pools, the few-row weight products
(rollout.weight_products) against XLA's dot and in the engine; row independence; build and fallback."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.cpu import native
from laminar_jax.cpu.native import ops
from laminar_jax.cpu.kernels import RowKernel, cpu_kernel, resolve_row_kernel
from laminar_jax.rollout.attention import DecodeMeta, as_stored, live_page_list, live_pages, pool_shape
from laminar_jax.rollout.kernels import resolve_backend


def _case(seed, *, kv_dtype, page, heads, kv_heads, d, rows=6, pages_per_row=4, inactive=(4,)):
    rng = np.random.default_rng(seed)
    pool = rows * pages_per_row + 3

    def pool_of(key):
        return as_stored(jnp.asarray(rng.normal(size=pool_shape(pool, page, kv_heads, d, key=key)), jnp.float32),
                         kv_dtype)

    table = rng.permutation(np.arange(1, pool))[:rows * pages_per_row].reshape(rows, pages_per_row)
    positions = rng.integers(0, pages_per_row * page - 1, size=rows)
    positions[0] = 0  # a row with one token (its first), and one on a page boundary
    positions[1] = page
    active = np.array([i not in inactive for i in range(rows)])
    q = jnp.asarray(rng.normal(size=(rows, 1, heads, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(rows, 1, kv_heads, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(rows, 1, kv_heads, d)), jnp.float32)
    meta = DecodeMeta(jnp.asarray(table, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(active), page,
                      kv_dtype=kv_dtype)
    return q, k, v, (pool_of(True), pool_of(False)), meta


def _run(backend, q, k, v, cache, meta):
    if getattr(backend, "needs_live_pages", False):
        meta = meta._replace(live=live_page_list(meta, meta.page_table.size))
    return jax.jit(lambda q, k, v, c: backend(q, k, v, c, meta=meta))(q, k, v, cache)


# (page, heads, kv heads, head dim): 1 to 8 query heads per KV head, passes of 1 to 4 blocks of
# the kernel's vector (16 lanes, 8 on AVX2 without AVX-512) and single blocks after them, pages and
# head dims of one and several blocks.
SHAPES = [(16, 12, 4, 64), (64, 6, 2, 32), (32, 7, 1, 16), (16, 8, 1, 32), (16, 2, 2, 16), (128, 16, 2, 128),
          (64, 8, 2, 64), (16, 10, 2, 32)]


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page,heads,kv_heads,d", SHAPES)
def test_kernel_equals_live_pages(kv_dtype, page, heads, kv_heads, d):
    q, k, v, cache, meta = _case(page + heads, kv_dtype=kv_dtype, page=page, heads=heads, kv_heads=kv_heads, d=d)
    ref, ref_cache = _run(live_pages, q, k, v, cache, meta)
    out, out_cache = _run(cpu_kernel, q, k, v, cache, meta)
    for a, b in zip(ref_cache, out_cache):  # the token written the same way, bit for bit
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(out)[~np.asarray(meta.active)] == 0.0)  # inactive rows: zeros
    assert np.abs(np.asarray(out)).max() > 0.1  # not a degenerate zero output


def test_a_rows_output_depends_only_on_that_row():
    """Moved sequences stay output-identical: another slot, other physical pages, other company."""
    q, k, v, (kp, vp), meta = _case(0, kv_dtype=jnp.float32, page=16, heads=12, kv_heads=4, d=64, inactive=())
    out, _ = _run(cpu_kernel, q, k, v, (kp, vp), meta)
    # Row 3 again, alone in slot 0, its pages copied to other physical ids; the other rows' queries changed.
    table = np.asarray(meta.page_table)
    moved = np.zeros_like(table)
    fresh = np.arange(1, table.shape[1] + 1) + table.max()
    kp2 = jnp.concatenate([kp, kp[table[3]]])
    vp2 = jnp.concatenate([vp, vp[table[3]]])
    moved[0] = fresh
    order = [3, 0, 1, 2, 4, 5]
    meta2 = meta._replace(page_table=jnp.asarray(moved, jnp.int32), positions=meta.positions[jnp.asarray(order)])
    meta2 = meta2._replace(active=jnp.asarray([True] + [False] * 5))
    q2 = jnp.concatenate([q[3:4], -q[:5]])
    out2, _ = _run(cpu_kernel, q2, k[jnp.asarray(order)], v[jnp.asarray(order)], (kp2, vp2), meta2)
    np.testing.assert_array_equal(np.asarray(out2)[0], np.asarray(out)[3])


@pytest.mark.parametrize("page,heads,kv_heads,d,why", [(8, 4, 2, 16, "page_size=8 and head_dim=16"),
                                                      (16, 4, 2, 24, "head_dim=24"),
                                                      (16, 9, 1, 16, "9 query heads per KV head")])
def test_a_geometry_the_kernel_does_not_take_is_an_error_naming_it(page, heads, kv_heads, d, why):
    q, k, v, cache, meta = _case(2, kv_dtype=jnp.float32, page=page, heads=heads, kv_heads=kv_heads, d=d)
    with pytest.raises(ValueError, match=f"rollout.attention_impl='cpu_kernel' cannot run .*{why}"):
        _run(cpu_kernel, q, k, v, cache, meta)


def test_a_page_id_outside_the_pool_is_an_error():
    q, k, v, cache, meta = _case(1, kv_dtype=jnp.float32, page=16, heads=4, kv_heads=2, d=16)
    bad = meta._replace(page_table=meta.page_table.at[0, 0].set(10_000))
    with pytest.raises(Exception, match="page id outside the pool"):
        jax.block_until_ready(_run(cpu_kernel, q, k, v, cache, bad))


def test_auto_picks_the_kernel_on_one_cpu_device_for_the_geometries_it_takes():
    def pick(name="auto", platform="cpu", tp=False, page=16, d=64, group=3):
        return resolve_backend(name, platform=platform, tensor_parallel=tp, page_size=page, head_dim=d, group=group)

    assert pick() == "cpu_kernel"
    assert pick(platform="tpu") == pick(tp=True) == pick(page=8) == pick(d=24) == pick(group=9) == "live_pages"
    assert pick("gather_dense", platform="tpu") == "gather_dense"
    with pytest.raises(ValueError, match="rollout.attention_impl='cpu_kernel' cannot run under a tensor-parallel"):
        pick("cpu_kernel", tp=True)
    with pytest.raises(ValueError, match="rollout.attention_impl='cpu_kernel' cannot run off CPU"):
        pick("cpu_kernel", platform="gpu")
    with pytest.raises(ValueError, match="page_size=8"):
        pick("cpu_kernel", page=8)


def test_the_library_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAMINAR_JAX_NATIVE_CACHE", str(tmp_path))
    path = native.build("paged_attention")
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 0
    stamp = os.stat(path).st_mtime_ns
    assert native.build("paged_attention") == path and os.stat(path).st_mtime_ns == stamp
    assert [p for p in os.listdir(tmp_path)] == [os.path.basename(path)]  # no temporary left behind


def test_without_a_compiler_auto_falls_back_and_an_explicit_request_says_why(tmp_path):
    """A fresh process with an empty kernel cache and no compiler on PATH: 'auto' engines run live_pages."""
    code = """
import dataclasses, jax.numpy as jnp, pytest
from flax import nnx
from laminar_jax.cpu import native
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.rollout import RolloutSection, make_engine
assert 'no C++ compiler' in native.available('paged_attention')
model = Transformer(PRESETS['tiny'], rngs=nnx.Rngs(0))
section = RolloutSection(num_slots=2, page_size=16, num_pages=40, max_prompt_len=8, max_total_len=32)
engine, _ = make_engine(model, section)
assert engine.attention_impl == 'live_pages', engine.attention_impl
assert engine.kernels.products.kernel is None  # rollout.weight_products='auto' falls back to XLA's dot
with pytest.raises(native.NativeUnavailable, match='no C.. compiler'):
    native.load('paged_attention')
print('OK')
"""
    env = {**os.environ, "PATH": str(tmp_path), "CXX": "", "LAMINAR_JAX_NATIVE_CACHE": str(tmp_path / "cache"),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 64, 7), (3, 48, 64), (8, 50, 97), (13, 768, 200), (6, 96, 9),
                                   (16, 64, 50), (40, 96, 61), (64, 130, 49), (70, 33, 13), (20, 45, 30),
                                   (4, 36, 30), (11, 12, 25), (16, 8, 13), (33, 2100, 30), (48, 520, 25)])
def test_row_products_equal_the_dot(dtype, m, k, n):
    """Every path: the 16-lane one's row groups (8, 4, 2, 1) and weight-row blocks (4, 3, 1), with a K
    that is no multiple of 16, bf16 with K in 32s on AVX-512 BF16; the GEMM path's row-vector groups
    (1-4, and 4 + 1 at 70 rows; on AVX2 pairs of 8-row vectors, 40 and 70 rows ending in one) and
    weight-row blocks with a remainder, bf16 in pairs (odd K: not), a K that is no multiple of 8, and
    on AVX2 a long K (2100: units of 12 weight rows, the last of 6) and 48 rows in three row-vector
    pairs with a unit of 25 weight rows (520);
    float32's 4-16-row form in 1-4 groups of 4 rows (11: a padded group), with K in 4s and not (8, 50)."""
    rng = np.random.default_rng(m * k + n)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32).astype(dtype).astype(jnp.float32)
    w = jnp.asarray(rng.normal(size=(n, k)), jnp.float32).astype(dtype)
    out = np.asarray(jax.jit(ops.row_products)(x, w))
    ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    # A row's result does not depend on the rows beside it (the engine's moves rely on that); the
    # path, and so the order of the sums, is chosen by the row count alone: the GEMM from
    # row_products_gemm_rows (AVX-512: float32 4, bfloat16 8, with float32 4-16 rows and K in 4s on
    # the 4-rows-by-4-k form; AVX2: float32 32), the few-row form below it.
    gemm = ops.row_products_gemm_rows(dtype)
    quad = "avx512f" in ops.cpu_flags() and dtype == jnp.float32 and k % 4 == 0
    tail = 1 if not gemm or m < gemm else 17 if quad and m > 16 else gemm
    alone = np.asarray(jax.jit(ops.row_products)(x[m - tail:], w))
    np.testing.assert_array_equal(alone[-1], out[m - 1])
    other = np.asarray(jax.jit(ops.row_products)(x[::-1], w))  # other rows beside each row, same count
    np.testing.assert_array_equal(other[::-1], out)


def test_row_products_refuse_other_weight_dtypes():
    with pytest.raises(ValueError, match="float16"):
        ops.row_products(jnp.ones((2, 16)), jnp.ones((4, 16), jnp.float16))


def test_row_kernel_policy():
    # Where the kernel beats XLA's dot: its GEMM path, 64 rows, on AVX-512; on AVX2, float32 up to 64
    # rows (its 8-float form below 32, the GEMM in 8-float registers from 32) of the larger weights;
    # elsewhere XLA's dot.
    flags = ops.cpu_flags()
    avx512, avx2 = "avx512f" in flags, "avx512f" not in flags and {"avx2", "fma"} <= flags
    auto_rows = 64 if avx512 or avx2 else 0
    floor = ops.MIN_WEIGHTS_AVX2 if avx2 else 0
    assert ops.row_products_min_weights(jnp.float32) == floor

    def rows(policy, dtype=jnp.float32, platform="cpu", tp=False, largest=1 << 30):
        return resolve_row_kernel(policy, dtype, platform=platform, tensor_parallel=tp, largest_weight=largest)

    assert rows("auto") == RowKernel(auto_rows, floor if auto_rows else 0)
    # Insisted on, the kernel runs wherever it is correct (the engine tests below use it on every
    # CPU), for every weight.
    assert rows("native") == RowKernel(64 if avx512 or avx2 else 16, 0)
    assert rows("native", largest=16) == RowKernel(64 if avx512 or avx2 else 16, 0)
    assert rows("native", jnp.bfloat16).rows >= 16
    assert rows("xla") == RowKernel(0, 0)
    bf16 = 64 if avx512 and "avx512_bf16" in flags else 16 if avx2 else 0  # AVX-512 without BF16: XLA's
    assert rows("auto", jnp.bfloat16).rows == bf16
    assert rows("auto", platform="gpu") == RowKernel(0, 0)
    assert rows("auto", tp=True) == RowKernel(0, 0)
    # A model with no weight over the floor gets no kernel at all, in either dtype (the offline LLM
    # asks this for its 1-row bf16 bucket).
    if floor:
        assert rows("auto", largest=floor - 1) == rows("auto", jnp.bfloat16, largest=floor - 1) == RowKernel(0, 0)
        assert rows("auto", largest=floor) == RowKernel(auto_rows, floor)
    with pytest.raises(ValueError, match="rollout.weight_products='native' cannot run off CPU"):
        rows("native", platform="tpu")
    with pytest.raises(ValueError, match="rollout.weight_products='native' cannot run for float16"):
        rows("native", jnp.float16)


def _one_layer(w):
    """A Linear weight as one product sees it: one layer's [out, in] of a stacked (3-D) weight."""
    return w[0] if w.ndim == 3 else w


def test_largest_weight_reads_the_model_config():
    import dataclasses

    from flax import nnx

    from laminar_jax.model import PRESETS, Transformer
    from laminar_jax.model.transformer import Linear

    for cfg in (PRESETS["tiny"], dataclasses.replace(PRESETS["tiny"], hidden_size=256, intermediate_size=512,
                                                     num_layers=1, tie_word_embeddings=False)):
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        sizes = [_one_layer(m.weight[...]).size for _, m in nnx.iter_graph(model) if isinstance(m, Linear)]
        sizes.append(cfg.vocab_size * cfg.hidden_size)  # the head (tied: the embedding)
        assert cfg.largest_weight() == max(sizes)


@pytest.mark.parametrize("tied", [True, False])
def test_linear_and_head_through_the_kernel_equal_the_dot(tied):
    from flax import nnx

    from laminar_jax.model import PRESETS, Transformer
    from laminar_jax.model.products import Products
    from laminar_jax.model.transformer import Linear

    import dataclasses

    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray([[5, 9, 2]], jnp.int32)
    ref = model(tokens)

    def kernel(rows, floor=0):  # products of at most `rows` rows, of weights of at least `floor` elements
        return Products(jnp.float32, ops.row_products, rows, floor)

    def hlo(products):
        return jax.jit(lambda t: model(t, products=products)).lower(tokens).as_text()

    assert "laminar_row_products" in hlo(kernel(16))  # 3 rows: every product through the kernel
    np.testing.assert_allclose(np.asarray(model(tokens, products=kernel(16))), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert "laminar_row_products" not in hlo(kernel(2))  # 3 rows > 2: XLA's dot again
    # A floor on the weight's size: only the products of weights that large take the kernel.
    largest = max(_one_layer(m.weight[...]).size for _, m in nnx.iter_graph(model) if isinstance(m, Linear))
    assert "laminar_row_products" in hlo(kernel(16, largest))
    assert "laminar_row_products" not in hlo(kernel(16, largest + 1))
    np.testing.assert_allclose(np.asarray(model(tokens, products=kernel(16, largest))), np.asarray(ref), atol=1e-5,
                               rtol=1e-5)


def test_engine_decodes_the_same_tokens_with_either_weight_products():
    import dataclasses

    from laminar_jax.rollout import SamplingParams, generate, make_engine
    from tests.rollout.rollout_helpers import SECTION, tiny_model

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=())
    outs = {}
    for policy in ("xla", "native"):
        engine, params = make_engine(tiny_model(0), dataclasses.replace(SECTION, weight_products=policy))
        p = engine.kernels.products
        assert p.kernel_rows == (0 if policy == "xla" else ops.row_products_insisted_rows(jnp.float32))
        assert p.kernel_min_weights == 0  # insisted on: every product, the tiny model's included
        outs[policy] = generate((engine, params), prompts, sp)
    for a, b in zip(outs["xla"], outs["native"]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_short_prefill_runs_its_products_on_the_kernel_and_writes_the_same_kv():
    import dataclasses

    from laminar_jax.rollout import make_engine
    from tests.rollout.rollout_helpers import SECTION, tiny_model

    kv = {}
    for policy in ("xla", "native"):
        engine, params = make_engine(tiny_model(0), dataclasses.replace(SECTION, weight_products=policy))
        leaves, progs, _ = engine.bound(params)
        padded, n = engine.schedule.pad_prompt([1, 2, 3, 4, 5])
        assert padded.size <= engine.kernels.products.kernel_rows or policy == "xla"  # one prompt's bucket fits the kernel
        text = progs.prefill.lower(leaves, padded, np.int32(n)).as_text()
        assert ("laminar_row_products" in text) == (policy == "native")
        kv[policy] = progs.prefill(leaves, padded, np.int32(n))
    for a, b in zip(jax.tree.leaves(kv["xla"]), jax.tree.leaves(kv["native"])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5, rtol=1e-5)


def test_auto_engine_takes_the_kernel_only_for_models_with_weights_over_the_floor():
    """On AVX2 the tiny model has no weight over the floor: its engine keeps XLA's dot and never
    builds the kernel; a model with one takes the kernel for those weights alone."""
    import dataclasses

    from flax import nnx

    from laminar_jax.model import PRESETS, Transformer
    from laminar_jax.rollout import make_engine
    from tests.rollout.rollout_helpers import SECTION, tiny_model

    floor = ops.row_products_min_weights(jnp.float32)
    tiny, _ = make_engine(tiny_model(0), SECTION)
    wide_cfg = dataclasses.replace(PRESETS["tiny"], hidden_size=256, intermediate_size=512, num_layers=1)
    wide, _ = make_engine(Transformer(wide_cfg, rngs=nnx.Rngs(0)), SECTION)
    auto_rows = ops.row_products_max_rows(jnp.float32)
    if floor:  # AVX2: the tiny model's largest weight (a few thousand elements) is under it
        assert (tiny.kernels.products.kernel_rows, tiny.kernels.products.kernel_min_weights) == (0, 0)
        assert (wide.kernels.products.kernel_rows, wide.kernels.products.kernel_min_weights) == (auto_rows, floor)
    else:
        assert tiny.kernels.products.kernel_rows == wide.kernels.products.kernel_rows == auto_rows
        assert tiny.kernels.products.kernel_min_weights == wide.kernels.products.kernel_min_weights == 0


def _argmax_rows(b, v, seed):
    """Random rows with the cases first_argmax defines: ties (the first wins), an all -inf row, NaNs
    (the first NaN wins), a maximum in the tail past the last whole 16-lane block, +inf."""
    x = np.random.default_rng(seed).normal(size=(b, v)).astype(np.float32)
    cases = [lambda r: r.__setitem__([1, v - 1], 50.0), lambda r: r.fill(-np.inf),
             lambda r: r.__setitem__([v - 1, 2], np.nan), lambda r: r.__setitem__(v - 1, 60.0),
             lambda r: r.__setitem__([v // 2, v - 2], np.inf)]
    for row, case in zip(x, cases):
        case(row)
    return x


@pytest.mark.parametrize("b,v", [(1, 5), (3, 16), (5, 17), (7, 97), (64, 1000), (6, 32768)])
def test_native_argmax_picks_the_index_first_argmax_picks(b, v):
    from laminar_jax.rollout.sampling import first_argmax

    x = jnp.asarray(_argmax_rows(b, v, seed=v))
    got, want = jax.jit(ops.first_argmax)(x), jax.jit(first_argmax)(x)
    assert got.dtype == jnp.int32 and got.shape == (b,)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if b >= 5 and v > 2:  # the cases themselves, so a kernel that matched a wrong reference would fail
        assert list(np.asarray(got)[:5]) == [1, 0, 2, v - 1, v // 2]


def test_the_engine_samples_with_the_native_argmax_and_the_same_tokens(monkeypatch):
    """On one CPU device with AVX2 or AVX-512 the decode step's argmax is the kernel's; tokens and
    log-probs are those of the XLA argmax, greedy and sampled."""
    from laminar_jax.rollout import SamplingParams, generate, make_engine
    from laminar_jax.cpu import kernels as cpu_kernels
    from tests.rollout.rollout_helpers import SECTION, tiny_model

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    outs = {}
    for native_on in (ops.first_argmax_is_faster(), False):
        if not native_on:  # the fallback an engine takes where the kernel does not build
            monkeypatch.setattr(cpu_kernels, "native_argmax_here", lambda platform, tensor_parallel: False)
        engine, params = make_engine(tiny_model(0), SECTION)
        assert (engine.kernels.argmax is ops.first_argmax) == native_on
        leaves, progs, _ = engine.bound(params)
        rows, n = engine.page_book.rows()
        bucket = engine.page_book.live_bucket()
        text = progs.generate.lower(leaves, engine.init_decode_state(), rows, n, bucket).as_text()
        assert ("laminar_first_argmax" in text) == native_on
        outs[native_on] = [generate((engine, params), prompts, SamplingParams(temperature=t, max_new_tokens=10,
                                                                              stop_token_ids=()), seeds=[3, 4, 5])
                           for t in (0.0, 1.0)]
    for a, b in zip(outs[True], outs[False]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_array_equal(x.logprobs, y.logprobs)


@pytest.mark.parametrize("flags,expected", [({"avx2", "fma"}, True), ({"avx512f", "avx2"}, True),
                                            ({"sse4_2"}, False), (set(), False)])
def test_the_native_argmax_is_taken_only_on_cpus_with_avx2_or_avx512(monkeypatch, flags, expected):
    from laminar_jax.cpu.kernels import native_argmax_here

    monkeypatch.setattr(ops, "cpu_flags", lambda: frozenset(flags))
    assert ops.first_argmax_is_faster() == expected
    assert native_argmax_here("cpu", False) == (expected and native.available(ops.ARGMAX_LIBRARY) is None)
    assert not native_argmax_here("cpu", True) and not native_argmax_here("gpu", False)
