"""Tiny random HF checkpoints of each supported family, created with transformers (test-only)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def hf_config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(
            **COMMON, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
            rope_theta=500000.0)
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1000000.0)
    if family == "qwen3":
        # head_dim deliberately != hidden/heads, as in real Qwen3 checkpoints.
        return transformers.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0)
    raise ValueError(family)


def make_hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), torch_dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb so the test would see a mix-up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_hf_model(family: str, path: str, seed: int = 0, max_shard_size=None):
    model = make_hf_model(family, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model
