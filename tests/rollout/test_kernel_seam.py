"""The kernel seam (rollout/kernels.py): one DecodeKernels chosen from (platform, dtype, geometry,
TP); explicit choices that cannot serve are errors naming the field and the reason; 'auto' falls
back with the reason; accelerator platforms take their Pallas kernels (head-major pools, run per TP
shard) where those serve and never get a CPU workaround; the model, the learner and
the rollout core import no CPU plugin; the decode schedule's steps per call follow the platform."""

import ast
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from laminar_jax.cpu import native
from laminar_jax.cpu.native import ops
from laminar_jax.rollout import attention, kernels as seam
from laminar_jax.rollout.kernels import AttentionKernel, Geometry, choose_decode_kernels
from laminar_jax.rollout.schedule import AUTO_STEPS_ACCELERATOR, steps_per_call

GOOD = Geometry(heads=12, kv_heads=4, head_dim=64, page_size=16, dtype=jnp.float32)
BIG = 1 << 24  # a model's largest weight: over every floor the row kernel has


def choose(platform="cpu", geometry=GOOD, attention_impl="auto", weight_products="auto", largest=BIG, **kw):
    return choose_decode_kernels(attention_impl, weight_products, platform=platform, geometry=geometry,
                                 largest_weight=largest, **kw)


def _native_builds(library) -> bool:
    return native.available(library) is None


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cpu_takes_its_native_kernels_for_the_geometries_they_serve(dtype):
    if not _native_builds(ops.ATTENTION_LIBRARY):
        pytest.skip("no C++ compiler here: the native kernels do not build")
    k = choose(geometry=GOOD._replace(dtype=dtype))
    assert k.attention == "cpu_kernel" and k.platform == "cpu" and k.reason == ""
    assert k.products.low_out == jnp.float32  # XLA:CPU's low-precision products come out in float32
    rows = ops.row_products_max_rows(dtype)
    assert (k.products.kernel is ops.row_products) == bool(rows) and k.products.kernel_rows == rows
    assert k.summary()["attention"] == "cpu_kernel" and "fallback" not in k.summary()


@pytest.mark.parametrize("geometry,why", [
    (GOOD._replace(page_size=8), "page_size=8 and head_dim=64 must be multiples of 16"),
    (GOOD._replace(head_dim=24), "head_dim=24"),
    (GOOD._replace(heads=36), "9 query heads per KV head"),
    (GOOD._replace(tensor_parallel=2), "under a tensor-parallel mesh"),
    (GOOD._replace(dtype=jnp.float16), "KV of dtype float16"),
])
def test_cpu_auto_falls_back_to_live_pages_and_says_why(geometry, why):
    k = choose(geometry=geometry)
    assert k.attention == "live_pages" and k.needs_live_pages
    assert "cpu_kernel cannot run" in k.reason and why in k.reason
    assert k.summary()["fallback"] == k.reason
    with pytest.raises(ValueError, match=r"rollout\.attention_impl='cpu_kernel' cannot run .*" + why.split(" ")[0]):
        choose(geometry=geometry, attention_impl="cpu_kernel")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_accelerators_take_their_pallas_kernels_where_they_serve(dtype):
    k = choose("gpu", GOOD._replace(dtype=dtype, tensor_parallel=2))
    assert (k.attention, k.platform, k.pool_layout, k.per_shard, k.reason) == ("pallas_gpu_paged", "gpu", "head_major",
                                                                               True, "")
    assert not k.needs_live_pages and k.summary()["attention"] == "pallas_gpu_paged"
    t = choose("tpu", GOOD._replace(dtype=jnp.bfloat16, head_dim=128, tensor_parallel=2))
    assert (t.attention, t.pool_layout, t.per_shard, t.reason) == ("pallas_tpu_paged", "head_major", True, "")


@pytest.mark.parametrize("platform,geometry,why", [
    ("gpu", GOOD._replace(head_dim=80), "head_dim=80 must be a power of two"),
    ("tpu", GOOD._replace(dtype=jnp.bfloat16), "head_dim=64 must be a multiple of 128"),
    ("tpu", GOOD._replace(head_dim=128), "KV dtype float32"),
], ids=["gpu-head-dim", "tpu-head-dim", "tpu-f32"])
def test_accelerators_fall_back_to_portable_kernels_with_the_reason_and_no_cpu_workaround(platform, geometry, why):
    k = choose(platform, geometry._replace(tensor_parallel=2))
    assert k.attention == "live_pages" and k.platform == platform and k.pool_layout == "split" and not k.per_shard
    assert f"pallas_{platform}_paged cannot run {why}" in k.reason
    # The portable live_pages with a plain gather, not the CPU plugin's one-hot product form.
    assert k.attend is attention.live_pages
    assert k.products.kernel is None and k.products.low_out is None  # bf16 products come out in bf16
    assert k.argmax is seam.xla_argmax and k.argmax_name == "xla"  # not XLA:CPU's first_argmax form
    assert choose(platform, attention_impl="gather_dense").attention == "gather_dense"
    with pytest.raises(ValueError, match=rf"rollout\.attention_impl='pallas_{platform}_paged' cannot run {why}"):
        choose(platform, geometry, attention_impl=f"pallas_{platform}_paged")


def test_cpu_live_pages_is_the_plugins_form_and_equal_engines_share_a_choice():
    k = choose(geometry=GOOD._replace(page_size=8))
    assert k.attend is not attention.live_pages and k.attend.keywords["rows_of"].__name__ == "rows_of_onehot"
    assert k == choose(geometry=GOOD._replace(page_size=8)) and hash(k) == hash(choose(geometry=GOOD._replace(page_size=8)))


def test_explicit_choices_that_cannot_serve_are_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"rollout\.attention_impl='cpu_kernel' cannot run off CPU \(this engine runs on gpu\)"):
        choose("gpu", attention_impl="cpu_kernel")
    with pytest.raises(ValueError, match=r"rollout\.weight_products='native' cannot run off CPU"):
        choose("tpu", weight_products="native")
    with pytest.raises(ValueError, match=r"rollout\.weight_products='native' cannot run for float16 weights"):
        choose(geometry=GOOD._replace(dtype=jnp.float16), weight_products="native")
    with pytest.raises(ValueError, match=r"rollout\.attention_impl='flashy': not a decode attention"):
        choose(attention_impl="flashy")
    with pytest.raises(ValueError, match=r"rollout\.weight_products='fast'"):
        choose(weight_products="fast")


def test_weight_products_auto_and_xla():
    assert choose(weight_products="xla").products.kernel is None
    assert choose("gpu", weight_products="xla").products.low_out is None
    small = choose(weight_products="auto", largest=16)  # no weight over the floor (where there is one)
    assert small.products.kernel is None or ops.row_products_min_weights(jnp.float32) == 0


def test_a_registered_accelerator_kernel_is_auto_where_it_serves(monkeypatch):
    """The registration point accelerator kernels (Pallas) plug into: ranked above live_pages on
    their platform, refusing what they cannot take (auto then falls back with the reason)."""
    def fake(q, k, v, layer_cache, *, meta):
        raise AssertionError("never traced here")

    def refuses(g):
        return None if g.page_size % 16 == 0 else f"page_size={g.page_size} (multiples of 16)"

    monkeypatch.setitem(seam._ATTENTION, ("gpu", "fake_paged"), AttentionKernel("fake_paged", fake, refuses, 50))
    monkeypatch.setitem(seam.PLUGIN_ATTENTION, "fake_paged", "gpu")
    assert choose("gpu").attention == "fake_paged"
    fallback = choose("gpu", GOOD._replace(page_size=8))  # to the next rank: JAX's paged attention
    assert fallback.attention == "pallas_gpu_paged" and "fake_paged cannot run page_size=8" in fallback.reason
    assert choose("tpu").attention == "live_pages"
    assert choose().attention != "fake_paged"
    with pytest.raises(ValueError, match=r"'fake_paged' cannot run off GPU"):
        choose("tpu", attention_impl="fake_paged")
    assert "fake_paged" in seam.attention_names()


def test_caller_supplied_backends_run_only_when_named():
    def mine(q, k, v, layer_cache, *, meta):
        raise AssertionError("never traced here")

    assert choose("tpu", extra_attention={"mine": mine}).attention == "live_pages"
    assert choose("tpu", attention_impl="mine", extra_attention={"mine": mine}).attend is mine


def test_steps_per_call_auto_is_one_on_cpu_and_several_on_accelerators():
    assert steps_per_call(0, "cpu") == 1
    assert steps_per_call(0, "gpu") == steps_per_call(0, "tpu") == AUTO_STEPS_ACCELERATOR >= 8
    assert steps_per_call(4, "gpu") == steps_per_call(4, "cpu") == 4


def test_gpu_configs_decode_several_steps_per_call():
    import importlib.util

    for name in ("gpu_single", "gpu_node", "gpu_pod"):
        path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cfg = module.get_config() if hasattr(module, "get_config") else module.CONFIG
        assert 8 <= cfg.rollout.decode_steps_per_call <= 16, (name, cfg.rollout.decode_steps_per_call)


# ---------------------------------------------------------------- the CPU is a plugin

_ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "laminar_jax")
_CORE = ("model", "learner", "rollout")
_PLUGIN = ("laminar_jax.cpu", "laminar_jax.native")


def _imports(path: str) -> set:
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_core_module_imports_the_cpu_plugin_or_asks_for_its_backend():
    for plane in _CORE:
        folder = os.path.join(_ROOT, plane)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            bad = {m for m in _imports(path) if m.startswith(_PLUGIN)}
            assert not bad, f"laminar_jax/{plane}/{name} imports {sorted(bad)}"
            if plane == "model":
                assert "default_backend" not in open(path).read(), f"laminar_jax/model/{name} asks for the backend"


def test_the_cpu_plugin_loads_only_when_the_cpu_platform_kernels_are_asked_for():
    code = """
import sys
import jax.numpy as jnp
from flax import nnx
import laminar_jax.learner, laminar_jax.rollout
from laminar_jax.model import PRESETS, Transformer
from laminar_jax.rollout.kernels import Geometry, choose_decode_kernels
model = Transformer(PRESETS['tiny'], rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
model(jnp.ones((1, 4), jnp.int32))
g = Geometry(4, 2, 16, 16, jnp.bfloat16)
choose_decode_kernels('auto', 'auto', platform='gpu', geometry=g, largest_weight=1 << 20)
assert not [m for m in sys.modules if m.startswith('laminar_jax.cpu')], sorted(sys.modules)
choose_decode_kernels('auto', 'xla', platform='cpu', geometry=g, largest_weight=1 << 20)
assert 'laminar_jax.cpu.kernels' in sys.modules
print('OK')
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_xla_argmax_picks_the_index_first_argmax_picks():
    import numpy as np

    from laminar_jax.rollout.sampling import first_argmax

    inf, nan = np.inf, np.nan
    x = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [-inf, -inf, -inf, -inf], [1.0, nan, 5.0, nan], [2.0, 2.0, 2.0, 2.5]])
    x = jnp.concatenate([x, jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)])
    np.testing.assert_array_equal(seam.xla_argmax(x), first_argmax(x))
    assert seam.xla_argmax(x).dtype == jnp.int32
