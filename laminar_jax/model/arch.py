"""Architecture description of the decoder family, and its mapping to/from HF config.json.

One dataclass covers Llama-3 (GQA, llama3 RoPE scaling, optional tied embeddings),
Qwen2/Qwen2.5 (q/k/v bias) and Qwen3 (q/k RMSNorm, explicit head_dim).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

# HF `model_type` -> the architecture class name written back on save.
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedArchitecture(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape and flavour of one decoder-only transformer.

    Attributes:
      model_type: 'llama', 'qwen2' or 'qwen3' (as in HF config.json).
      vocab_size: Number of token ids.
      hidden_size: Residual width (d_model).
      intermediate_size: SwiGLU hidden width.
      num_layers: Number of decoder blocks.
      num_heads: Query heads.
      num_kv_heads: Key/value heads (GQA when < num_heads).
      head_dim: Width of one head.
      rope_theta: RoPE base.
      rope_scaling: Llama-3 scaling, or None.
      rms_norm_eps: RMSNorm epsilon.
      tie_word_embeddings: lm_head shares the embedding matrix.
      qkv_bias: Bias on q/k/v projections (Qwen2).
      o_bias: Bias on the output projection.
      mlp_bias: Bias on the MLP projections.
      qk_norm: RMSNorm on per-head q and k before RoPE (Qwen3).
      max_position_embeddings: Longest position the model was trained for.
      bos_token_id: Beginning-of-sequence id, if any.
      eos_token_id: End-of-sequence ids.
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: Optional[int] = None
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED:
            raise UnsupportedArchitecture(
                f"model_type={self.model_type!r} is not supported; supported: {sorted(SUPPORTED)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return self.num_layers * per_layer + v * d + head + d

    def largest_weight(self) -> int:
        """Elements of the largest weight matrix: the hidden size times the widest of the MLP, the
        vocabulary (the head or tied embedding) and the attention heads."""
        return self.hidden_size * max(self.intermediate_size, self.vocab_size, self.num_heads * self.head_dim)


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, Optional[RopeScaling]]:
    # transformers>=5 nests theta and scaling in `rope_parameters`; 4.x uses rope_theta/rope_scaling.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedArchitecture(f"rope_type={rope_type!r} is not supported (supported: default, llama3)")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> TransformerConfig:
    """Build a TransformerConfig from a parsed HF config.json; unsupported features raise, naming them."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        archs = hf.get("architectures")
        raise UnsupportedArchitecture(
            f"{source}: model_type={model_type!r} (architectures={archs}) is not supported; "
            f"supported model_type values: {sorted(SUPPORTED)}")
    if hf.get("use_sliding_window"):
        raise UnsupportedArchitecture(f"{source}: use_sliding_window=true is not supported")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = _rope_from_hf(hf)
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    attention_bias = bool(hf.get("attention_bias", False))
    return TransformerConfig(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
    )


def to_hf_config(cfg: TransformerConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json that transformers (and vLLM) read back as the same architecture."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        rope = {"rope_theta": cfg.rope_theta, "rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    hf = {
        "architectures": [SUPPORTED[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        # Both spellings, so transformers 4.x and 5.x read the same RoPE.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None if cfg.rope_scaling is None else rope,
        "torch_dtype": torch_dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) != 1 else cfg.eos_token_id[0],
    }
    if cfg.model_type == "llama":
        hf["attention_bias"] = cfg.qkv_bias
        hf["mlp_bias"] = cfg.mlp_bias
    elif cfg.model_type == "qwen3":
        hf["attention_bias"] = cfg.qkv_bias
    else:
        hf["use_sliding_window"] = False
    return hf
