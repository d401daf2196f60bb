"""Built-in architectures for building a model from scratch (demos, tests, benchmarks)."""

from laminar_jax.model.arch import TransformerConfig

PRESETS: dict[str, TransformerConfig] = {
    # CPU demo size: trains in minutes on 2 cores; vocab covers the builtin tokenizer (100 ids).
    "tiny": TransformerConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=192,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              max_position_embeddings=512, tie_word_embeddings=True,
                              bos_token_id=1, eos_token_id=(2,)),
    "small": TransformerConfig(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=704,
                               num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, qkv_bias=True,
                               max_position_embeddings=2048, tie_word_embeddings=True),
    # ~100M-parameter Qwen2 (random weights) for CPU engine benchmarks at a realistic size:
    # 12 layers of width 768 (75.5M) plus a tied 32k-token embedding (25.2M).
    "qwen2-100m": TransformerConfig(model_type="qwen2", vocab_size=32768, hidden_size=768, intermediate_size=2048,
                                    num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, qkv_bias=True,
                                    rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=True,
                                    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=(2,)),
    # Qwen2.5-0.5B shapes (random weights) for GPU benchmarks.
    "qwen2.5-0.5b": TransformerConfig(model_type="qwen2", vocab_size=151936, hidden_size=896,
                                      intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                                      head_dim=64, rope_theta=1000000.0, qkv_bias=True,
                                      tie_word_embeddings=True, max_position_embeddings=32768,
                                      rms_norm_eps=1e-6),
    # Qwen2.5-1.5B shapes.
    "qwen2.5-1.5b": TransformerConfig(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                                      intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                                      head_dim=128, rope_theta=1000000.0, qkv_bias=True,
                                      tie_word_embeddings=True, max_position_embeddings=32768),
    # Qwen2.5-7B shapes (pod configs / simulator).
    "qwen2.5-7b": TransformerConfig(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                                    intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                                    head_dim=128, rope_theta=1000000.0, qkv_bias=True,
                                    max_position_embeddings=32768),
    # Qwen2.5-32B shapes (configs/gpu_node.py:32b, memory planning).
    "qwen2.5-32b": TransformerConfig(model_type="qwen2", vocab_size=152064, hidden_size=5120,
                                     intermediate_size=27648, num_layers=64, num_heads=40, num_kv_heads=8,
                                     head_dim=128, rope_theta=1000000.0, qkv_bias=True,
                                     max_position_embeddings=32768),
}
