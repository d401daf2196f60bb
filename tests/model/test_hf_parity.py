"""Our logits equal transformers' on tiny random Llama-3 / Qwen2 / Qwen3 checkpoints (fp32, CPU)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from laminar_jax.model import (MissingTensorError, UnsupportedArchitecture, from_pretrained,
                               save_pretrained)
from tests.model.hf_fixtures import save_hf_model

FAMILIES = ["llama", "qwen2", "qwen3"]


def _tokens(batch=2, seq=13, vocab=97, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq)).astype(np.int32)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tmp_path):
    hf = save_hf_model(family, str(tmp_path))
    model = from_pretrained(str(tmp_path))
    toks = _tokens()
    ours = np.asarray(model(jnp.asarray(toks)))
    with torch.no_grad():
        ref = hf(torch.from_numpy(toks).long()).logits.numpy()
    assert ours.shape == ref.shape == (2, 13, 97)
    assert np.max(np.abs(ours - ref)) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_matches_unpadded(family, tmp_path):
    """Right padding (segment id 0) must not change the logits of real tokens."""
    save_hf_model(family, str(tmp_path))
    model = from_pretrained(str(tmp_path))
    toks = _tokens(batch=1, seq=9)
    padded = np.concatenate([toks, np.zeros((1, 4), np.int32)], axis=1)
    seg = np.array([[1] * 9 + [0] * 4], np.int32)
    a = np.asarray(model(jnp.asarray(toks)))
    b = np.asarray(model(jnp.asarray(padded), segment_ids=jnp.asarray(seg)))[:, :9]
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_packed_segments_match_separate(tmp_path):
    save_hf_model("qwen2", str(tmp_path))
    model = from_pretrained(str(tmp_path))
    a, b = _tokens(1, 5, seed=1), _tokens(1, 7, seed=2)
    packed = np.concatenate([a, b], axis=1)
    seg = np.array([[1] * 5 + [2] * 7], np.int32)
    pos = np.array([list(range(5)) + list(range(7))], np.int32)
    out = np.asarray(model(jnp.asarray(packed), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg)))
    np.testing.assert_allclose(out[:, :5], np.asarray(model(jnp.asarray(a))), atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], np.asarray(model(jnp.asarray(b))), atol=1e-5)


def test_sharded_checkpoint_loads(tmp_path):
    hf = save_hf_model("llama", str(tmp_path), max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    model = from_pretrained(str(tmp_path))
    toks = _tokens()
    with torch.no_grad():
        ref = hf(torch.from_numpy(toks).long()).logits.numpy()
    assert np.max(np.abs(np.asarray(model(jnp.asarray(toks))) - ref)) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_roundtrip_exact(family, tmp_path):
    save_hf_model(family, str(tmp_path / "src"))
    model = from_pretrained(str(tmp_path / "src"))
    save_pretrained(model, str(tmp_path / "dst"), max_shard_bytes=30_000)
    again = from_pretrained(str(tmp_path / "dst"))
    toks = jnp.asarray(_tokens())
    np.testing.assert_array_equal(np.asarray(model(toks)), np.asarray(again(toks)))


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    import transformers

    save_hf_model("qwen3", str(tmp_path / "src"))
    model = from_pretrained(str(tmp_path / "src"))
    save_pretrained(model, str(tmp_path / "dst"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst")).eval()
    toks = _tokens()
    with torch.no_grad():
        ref = hf(torch.from_numpy(toks).long()).logits.numpy()
    assert np.max(np.abs(np.asarray(model(jnp.asarray(toks))) - ref)) < 1e-4


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitecture, match="gpt2"):
        from_pretrained(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_hf_model("llama", str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.up_proj.weight"):
        from_pretrained(str(tmp_path))


def test_value_head_and_bf16(tmp_path):
    save_hf_model("qwen2", str(tmp_path))
    model = from_pretrained(str(tmp_path), dtype="bfloat16", value_head=True)
    out = model.forward(jnp.asarray(_tokens()))
    assert out.values.shape == (2, 13) and out.values.dtype == jnp.float32
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
