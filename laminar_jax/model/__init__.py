"""Model plane: Llama-3 / Qwen2 / Qwen3 decoders in Flax NNX, HF checkpoint I/O, tokenizers.

Public API:
  Transformer, ModelOutput       -- NNX module; ``model(tokens)`` -> logits
  TransformerConfig, PRESETS     -- architecture description and built-in shapes
  from_pretrained, save_pretrained
  build_model(section)           -- from a ModelSection config
  load_tokenizer, BuiltinTokenizer, HFTokenizer
  CacheBackend, gqa_attention    -- the attention seam for paged KV decoding
"""

from laminar_jax.model.arch import TransformerConfig, UnsupportedArchitecture
from laminar_jax.model.attention import CacheBackend, dense_attention, gqa_attention
from laminar_jax.model.hf import MissingTensorError, load_hf_config, save_pretrained
from laminar_jax.model.pretrained import from_pretrained
from laminar_jax.model.presets import PRESETS
from laminar_jax.model.tokenizer import BuiltinTokenizer, HFTokenizer, load_tokenizer
from laminar_jax.model.transformer import ModelOutput, Transformer
from laminar_jax.model.build import build_model, token_logprobs

__all__ = [
    "TransformerConfig", "UnsupportedArchitecture", "CacheBackend", "dense_attention", "gqa_attention",
    "MissingTensorError", "from_pretrained", "load_hf_config", "save_pretrained", "PRESETS",
    "BuiltinTokenizer", "HFTokenizer", "load_tokenizer", "ModelOutput", "Transformer", "build_model",
    "token_logprobs",
]
