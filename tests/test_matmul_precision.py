"""runtime.matmul_precision: the entry points' setting reaches every matrix product of the model the
learner and the engine trace (as the products' precision attribute, the only thing the CPU shows;
docs/notes/2026-11-gpu-leases.md has what it changes on an H200); 'auto' is float32 products for a
float32 model and the backend's default for a bfloat16 one; an unknown name is a config error naming
the key; the CPU's compiled programs are the same at every setting."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from laminar_jax.cli import finalize_flag
from laminar_jax.config import ConfigError, default_config, finalize
from laminar_jax.matmul_precision import apply_matmul_precision, matmul_precision, resolve_matmul_precision
from laminar_jax.model import PRESETS, Transformer


@pytest.fixture
def keep_setting():
    before = matmul_precision()
    yield
    apply_matmul_precision(before, "float32")


def _dot_precisions() -> list[str]:
    """The precision attribute of every dot in a tiny float32 model's forward, traced now."""
    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    graph, state = nnx.split(model)
    tokens = jnp.ones((2, 8), jnp.int32)
    text = jax.jit(lambda s, t: nnx.merge(graph, s)(t)).lower(state, tokens).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots, "the forward has no matrix product"
    return [m.group(1) if (m := re.search(r"precision = \[([^\]]*)\]", d)) else "" for d in dots]


@pytest.mark.parametrize("dtype,expected", [("float32", "highest"), ("bfloat16", "default")])
def test_the_entry_points_auto_setting_follows_the_model_dtype(keep_setting, dtype, expected):
    cd = default_config()
    cd.model.dtype = dtype
    cd.runtime.compilation_cache_dir = ""  # keep the test session's cache (conftest.py)
    cfg = finalize_flag(cd, "usage")
    assert cfg.runtime.matmul_precision == "auto" and matmul_precision() == expected
    precisions = _dot_precisions()
    if expected == "highest":
        assert all(p == "HIGHEST, HIGHEST" for p in precisions), precisions
    else:
        assert all("HIGHEST" not in p for p in precisions), precisions


def test_an_explicit_setting_wins_over_the_dtype():
    assert resolve_matmul_precision("default", "float32") == "default"
    assert resolve_matmul_precision("highest", "bfloat16") == "highest"
    assert resolve_matmul_precision("high", "float32") == "high"


def test_an_unknown_precision_is_a_config_error_naming_the_key():
    cd = default_config()
    cd.runtime.matmul_precision = "tf32"
    with pytest.raises(ConfigError, match=r"runtime\.matmul_precision"):
        finalize(cd)
    with pytest.raises(ValueError, match=r"runtime\.matmul_precision='tf32'"):
        apply_matmul_precision("tf32", "float32")


def test_the_cpu_compiles_the_same_program_at_every_setting(keep_setting):
    def compiled(name: str) -> str:
        apply_matmul_precision(name, "float32")
        f = jax.jit(lambda x, w: jnp.tanh(jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))).sum())
        text = f.lower(jnp.ones((8, 64)), jnp.ones((32, 64))).compile().as_text()
        # Only the attribute and source positions may differ: the kernels chosen are the same.
        text = re.sub(r"operand_precision=\{[^}]*\}, ", "", text)
        return "\n".join(line for line in text.splitlines() if "file_name_id" not in line)

    assert compiled("highest") == compiled("default")
