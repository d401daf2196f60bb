"""The LoRA adapter contract (model/lora.py): targeted params, adapter names and shapes, the merge,
the adapted Linear's low-rank path, and finalize's refusals of bad targets and ranks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.config import ConfigError, default_config, finalize
from laminar_jax.learner.publish import flatten_params, load_model_params
from laminar_jax.model import lora
from laminar_jax.model.presets import PRESETS
from laminar_jax.model.transformer import Transformer

TINY = PRESETS["tiny"]


def test_targeted_params_names_and_shapes():
    shapes = lora.param_shapes_of(TINY)
    L, D, F, hd = TINY.num_layers, TINY.hidden_size, TINY.intermediate_size, TINY.head_dim
    assert lora.module_names(shapes) == sorted(lora.PROJECTIONS)  # tied embeddings: no lm_head
    targeted = lora.targeted_params(shapes, ("q_proj", "down_proj"))
    q = TINY.num_heads * hd
    assert targeted == {"layers.mlp.down_proj.weight": (F, D), "layers.self_attn.q_proj.weight": (D, q)}
    got = lora.adapter_shapes(shapes, ("q_proj", "down_proj"), 4)
    assert got == {"layers.self_attn.q_proj.lora_a": (L, 4, D), "layers.self_attn.q_proj.lora_b": (L, q, 4),
                   "layers.mlp.down_proj.lora_a": (L, 4, F), "layers.mlp.down_proj.lora_b": (L, D, 4)}
    assert lora.adapter_names("layers.self_attn.q_proj.weight") == ("layers.self_attn.q_proj.lora_a",
                                                                    "layers.self_attn.q_proj.lora_b")
    assert lora.base_name("layers.mlp.up_proj.lora_b") == "layers.mlp.up_proj.weight"


def test_untied_model_offers_lm_head_unstacked():
    cfg = dataclasses.replace(TINY, tie_word_embeddings=False)
    shapes = lora.param_shapes_of(cfg, value_head=True)
    assert "lm_head" in lora.module_names(shapes) and "value_head" not in lora.module_names(shapes)
    got = lora.adapter_shapes(shapes, ("lm_head",), 2)
    assert got == {"lm_head.lora_a": (2, TINY.hidden_size), "lm_head.lora_b": (TINY.vocab_size, 2)}


def test_merge_orientation_and_dtype():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 5, 7)).astype(np.float32)  # [L, out, in]
    a, b = rng.normal(size=(3, 2, 7)).astype(np.float32), rng.normal(size=(3, 5, 2)).astype(np.float32)
    got = lora.merge(w, a, b, 0.5)
    np.testing.assert_allclose(got[1], w[1] + 0.5 * b[1] @ a[1], rtol=1e-6)
    x = rng.normal(size=(4, 7)).astype(np.float32)  # the adapted Linear: x W^T + s (x A^T) B^T = x W'^T
    np.testing.assert_allclose(x @ got[2].T, x @ w[2].T + 0.5 * (x @ a[2].T) @ b[2].T, rtol=1e-4, atol=1e-5)
    bf = jnp.asarray(w, jnp.bfloat16)
    assert lora.merge(bf, jnp.asarray(a), jnp.asarray(b), 0.5).dtype == jnp.bfloat16


def test_attached_model_equals_merged_base():
    """The adapted forward (low-rank path) equals the plain model holding merge()d weights; an untrained
    adapter (B = 0) leaves the model unchanged; attach leaves the given model unadapted."""
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    section = lora.LoRASection(rank=4, alpha=8.0)
    adapted = lora.attach(model, section)
    assert not hasattr(model.layers.self_attn.q_proj, "lora_a")
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % TINY.vocab_size
    np.testing.assert_array_equal(np.asarray(adapted(tokens)), np.asarray(model(tokens)))
    graphdef, adapters, base = nnx.split(adapted, nnx.LoRAParam, nnx.Param)
    flat = flatten_params(adapters)
    assert set(flat) == set(lora.adapter_shapes(lora.param_shapes_of(TINY), section.targets, 4))
    assert all(x.dtype == jnp.float32 for x in flat.values())
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), adapters)
    trained = nnx.merge(graphdef, adapters, base)
    merged = lora.merge_params(flatten_params(base), flatten_params(adapters), section.scale)
    plain = Transformer(TINY, rngs=nnx.Rngs(7))
    load_model_params(plain, {k: np.asarray(v) for k, v in merged.items()})
    out = np.asarray(trained(tokens))
    assert np.abs(out - np.asarray(model(tokens))).max() > 1e-2  # the adapters do change the model
    np.testing.assert_allclose(out, np.asarray(plain(tokens)), rtol=1e-4, atol=1e-4)


def _config(**lora_keys):
    cd = default_config()
    for k, v in lora_keys.items():
        setattr(cd.learner.lora, k, v)
    return cd


def test_finalize_refuses_unknown_target_naming_key_and_modules():
    with pytest.raises(ConfigError, match=r"learner\.lora\.targets=.*'qkv_proj'.*'down_proj', 'gate_proj'"):
        finalize(_config(rank=4, targets=("q_proj", "qkv_proj")))


def test_finalize_refuses_rank_above_layer():
    kv = TINY.num_kv_heads * TINY.head_dim
    with pytest.raises(ConfigError, match=rf"learner\.lora\.rank={kv + 1}: must be <= min\(in, out\)={kv} of "
                                          r"layers\.self_attn\.k_proj\.weight.*'q_proj'"):
        finalize(_config(rank=kv + 1))
    assert finalize(_config(rank=kv)).learner.lora.rank == kv  # at the bound: accepted
    assert finalize(_config(rank=kv + 1, targets=("q_proj", "o_proj"))).learner.lora.enabled


def test_finalize_takes_lora_with_a_multi_process_learner():
    """The group writes the base (tests/runtime/test_lora_group.py)."""
    cd = _config(rank=4)
    cd.runtime.kind, cd.runtime.learner_processes = "ray", 2
    assert finalize(cd).learner.lora.enabled


def test_finalize_bad_values():
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank=-1"):
        finalize(_config(rank=-1))
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match=r"learner\.lora\.dropout=.*in \[0, 1\)"):
            finalize(_config(rank=2, dropout=bad))
    assert finalize(_config(rank=2, dropout=0.1)).learner.lora.dropout == 0.1
    assert not finalize(default_config()).learner.lora.enabled
