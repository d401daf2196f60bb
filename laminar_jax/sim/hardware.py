"""Hardware and model shapes the cost model is built from (spec-sheet numbers, no fitting).

GPU presets are vendor peak figures (dense bf16, no sparsity). Model shapes come from
``laminar_jax.model.PRESETS`` where present; Qwen2.5-32B/72B are defined here (their HF
config.json values) because the model plane has no use for them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One accelerator and its links.

    Attributes:
      name: Preset name.
      hbm_gbps: HBM bandwidth, GB/s (1e9 bytes/s).
      bf16_tflops: Dense bf16 peak, TFLOP/s.
      hbm_gib: HBM capacity, GiB.
      nvlink_gbps: Per-GPU NVLink bandwidth (one direction), GB/s; bounds tensor-parallel all-reduce.
      pcie_gbps: Host<->device bandwidth per GPU, GB/s (effective, not the link's nominal rate).
      nic_gbps: Network bandwidth per GPU (one NIC per GPU), GB/s.
      gpus_per_node: GPUs per machine (one relay per rollout machine).
    """

    name: str
    hbm_gbps: float
    bf16_tflops: float
    hbm_gib: float
    nvlink_gbps: float
    pcie_gbps: float
    nic_gbps: float
    gpus_per_node: int = 8


GPUS: dict[str, GpuSpec] = {
    # H100 SXM5: 3.35 TB/s HBM3, 989 TF dense bf16, 80 GB, NVLink4 900 GB/s total (450 one way), PCIe5.
    "h100": GpuSpec("h100", 3350.0, 989.0, 80.0, 450.0, 50.0, 50.0),
    # H200 SXM: 4.8 TB/s HBM3e, same compute, 141 GB.
    "h200": GpuSpec("h200", 4800.0, 989.0, 141.0, 450.0, 50.0, 50.0),
    # H800 SXM (China SKU): H100 compute/HBM, NVLink cut to 400 GB/s total; 400 Gbps NIC per GPU.
    "h800": GpuSpec("h800", 3350.0, 989.0, 80.0, 200.0, 50.0, 50.0),
    # A100 SXM 80GB: 2.04 TB/s, 312 TF bf16, NVLink3 600 GB/s total, PCIe4, 200 Gbps NIC.
    "a100": GpuSpec("a100", 2039.0, 312.0, 80.0, 300.0, 25.0, 25.0),
    # A CPU host standing in for one device (the CPU e2e check): nominal round figures, meant to be
    # used with a calibration (its efficiencies and overheads come from this project's CPU benches).
    "cpu": GpuSpec("cpu", 20.0, 0.1, 16.0, 20.0, 20.0, 10.0, gpus_per_node=1),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder.

    Attributes:
      name: Model name.
      vocab: Vocabulary size.
      hidden: d_model.
      layers: Decoder blocks.
      heads: Query heads.
      kv_heads: Key/value heads.
      head_dim: Width of one head.
      intermediate: SwiGLU width.
      tied: Embedding and LM head shared.
    """

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + q + 2 * kv  # q/k/v/o weights + qkv bias
        mlp = 3 * h * self.intermediate
        return attn + mlp + 2 * h

    @property
    def params(self) -> int:
        """All parameters: embedding + blocks + final norm + LM head (unless tied)."""
        emb = self.vocab * self.hidden
        return emb * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters touched by matmuls per token (the embedding lookup is a gather): 2·this = FLOPs/token."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V for every layer: 2 · layers · kv_heads · head_dim · 2 bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def weight_bytes(self) -> int:
        return 2 * self.params  # bf16


_EXTRA = {
    "qwen2.5-32b": ModelShape("qwen2.5-32b", 152064, 5120, 64, 40, 8, 128, 27648),
    "qwen2.5-72b": ModelShape("qwen2.5-72b", 152064, 8192, 80, 64, 8, 128, 29568),
}


def model_shape(name: str) -> ModelShape:
    """Shape by name: laminar_jax.model.PRESETS first, then the simulator's own 32B/72B."""
    if name in _EXTRA:
        return _EXTRA[name]
    from laminar_jax.model.presets import PRESETS  # lazy: importing the model plane pulls in jax

    if name not in PRESETS:
        raise ValueError(f"sim.model={name!r}: must be one of {sorted(set(PRESETS) | set(_EXTRA))}")
    c = PRESETS[name]
    return ModelShape(name, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads,
                      c.head_dim, c.intermediate_size, c.tie_word_embeddings)


def model_names() -> list[str]:
    """Every model shape name model_shape() accepts."""
    from laminar_jax.model.presets import PRESETS

    return sorted(set(PRESETS) | set(_EXTRA))


def gpu_spec(name: str) -> GpuSpec:
    if name not in GPUS:
        raise ValueError(f"sim.gpu={name!r}: must be one of {sorted(GPUS)}")
    return GPUS[name]
