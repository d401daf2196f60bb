"""Roofline cost model: decode/prefill step times, KV capacity, learner step, weight transfer.

All functions are closed forms of (model shape, GPU spec, efficiency parameters); the decode
step accepts numpy arrays so the simulator evaluates every server at once.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from laminar_jax.sim.hardware import GpuSpec, ModelShape


@dataclasses.dataclass(frozen=True)
class CostParams:
    """Efficiency parameters (the only numbers a calibration changes).

    Attributes:
      mem_efficiency: Achieved fraction of HBM bandwidth in decode.
      flops_efficiency: Achieved fraction of bf16 peak in decode matmuls.
      decode_overhead_s: Fixed time per decode step (scheduler, kernel launches, sampling).
      prefill_mfu: Achieved fraction of peak in prefill.
      prefill_overhead_s: Fixed time per prefill call.
      tp_latency_s: Latency of one tensor-parallel all-reduce (two per layer per step).
      learner_mfu: Model FLOPs utilisation of the learner (6·params·tokens per step).
      learner_step_overhead_s: Fixed time per learner step (optimizer, data loading, log-probs bookkeeping).
      train_bytes_per_param: Learner memory per parameter (bf16 weights+grads, fp32 master + Adam moments).
      gpu_mem_util: Fraction of HBM a rollout engine may use (weights + KV), as vLLM's gpu_memory_utilization.
      relay_efficiency: Achieved fraction of the NIC bandwidth on one relay hop.
      relay_hop_latency_s: Per-chunk per-hop latency of the relay chain.
      chunk_mb: Relay chunk size (MB).
      load_overhead_s: Fixed cost of swapping weights in a rollout engine besides the PCIe copy.
      kv_net_efficiency: Achieved fraction of NIC bandwidth when moving KV pages during repack.
    """

    mem_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    decode_overhead_s: float = 0.004
    prefill_mfu: float = 0.5
    prefill_overhead_s: float = 0.01
    tp_latency_s: float = 10e-6
    learner_mfu: float = 0.35
    learner_step_overhead_s: float = 0.5
    train_bytes_per_param: float = 16.0
    gpu_mem_util: float = 0.9
    relay_efficiency: float = 0.5
    relay_hop_latency_s: float = 1e-3
    chunk_mb: float = 32.0
    load_overhead_s: float = 0.5
    kv_net_efficiency: float = 0.5


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Cost model of one placement: a model on a GPU type, rollout servers of ``tp`` GPUs."""

    model: ModelShape
    gpu: GpuSpec
    params: CostParams
    tp: int = 1
    page_tokens: int = 16

    # ---- rollout ----------------------------------------------------------------------------
    def decode_step_s(self, batch, ctx_tokens):
        """Time of one decode step of ``batch`` sequences holding ``ctx_tokens`` KV tokens in total.

        t = max(bytes / (HBM·eff_mem), flops / (tp·peak·eff_flops)) + overhead + TP all-reduce, with
        bytes = (weights + kv_bytes_per_token · ctx) / tp and
        flops = 2·matmul_params·batch + 4·layers·heads·head_dim·ctx (QK^T and PV).
        Zero for an empty batch. Works elementwise on arrays.
        """
        m, g, p = self.model, self.gpu, self.params
        b = np.asarray(batch, dtype=np.float64)
        c = np.asarray(ctx_tokens, dtype=np.float64)
        mem_s = (m.weight_bytes + m.kv_bytes_per_token * c) / self.tp / (g.hbm_gbps * 1e9 * p.mem_efficiency)
        flops = 2.0 * m.matmul_params * b + 4.0 * m.layers * m.heads * m.head_dim * c
        cmp_s = flops / (self.tp * g.bf16_tflops * 1e12 * p.flops_efficiency)
        t = np.maximum(mem_s, cmp_s) + p.decode_overhead_s + self.tp_comm_s(b)
        return np.where(b > 0, t, 0.0)

    def decode_roofline_s(self, batch, ctx_tokens):
        """The ideal (efficiency 1, no overhead) decode step time, for calibration fits."""
        m, g = self.model, self.gpu
        b = np.asarray(batch, dtype=np.float64)
        c = np.asarray(ctx_tokens, dtype=np.float64)
        mem_s = (m.weight_bytes + m.kv_bytes_per_token * c) / self.tp / (g.hbm_gbps * 1e9)
        flops = 2.0 * m.matmul_params * b + 4.0 * m.layers * m.heads * m.head_dim * c
        return np.maximum(mem_s, flops / (self.tp * g.bf16_tflops * 1e12))

    def tp_comm_s(self, batch):
        """Two ring all-reduces of batch·hidden bf16 activations per layer: latency + 2(tp-1)/tp·bytes/NVLink."""
        if self.tp == 1:
            return np.zeros_like(np.asarray(batch, dtype=np.float64))
        nbytes = np.asarray(batch, dtype=np.float64) * self.model.hidden * 2
        per = self.params.tp_latency_s + 2 * (self.tp - 1) / self.tp * nbytes / (self.gpu.nvlink_gbps * 1e9)
        return 2 * self.model.layers * per

    def prefill_s(self, tokens, sq_tokens):
        """Prefill of prompts with ``tokens`` total and ``sq_tokens`` = Σ len² (causal attention).

        t = (2·matmul_params·tokens + 2·layers·heads·head_dim·Σlen²) / (tp·peak·prefill_mfu) + overhead
        (the causal half of 4·L·H·d·len²). Zero when nothing is prefilled. Elementwise on arrays.
        """
        m, p = self.model, self.params
        n = np.asarray(tokens, dtype=np.float64)
        flops = 2.0 * m.matmul_params * n + 2.0 * m.layers * m.heads * m.head_dim * np.asarray(sq_tokens, np.float64)
        t = flops / (self.tp * self.gpu.bf16_tflops * 1e12 * p.prefill_mfu) + p.prefill_overhead_s
        return np.where(n > 0, t, 0.0)

    def kv_pages(self) -> int:
        """KV capacity of one server in pages: (tp·HBM·util − weights) / (page_tokens·kv_bytes_per_token)."""
        free = self.tp * self.gpu.hbm_gib * 2**30 * self.params.gpu_mem_util - self.model.weight_bytes
        return max(0, int(free // (self.page_tokens * self.model.kv_bytes_per_token)))

    def min_tp(self) -> int:
        """Smallest power-of-two TP whose KV capacity holds at least 64K tokens (weights fit with room)."""
        tp = 1
        while tp <= 64:
            if dataclasses.replace(self, tp=tp).kv_pages() * self.page_tokens >= 65536:
                return tp
            tp *= 2
        raise ValueError(f"model {self.model.name} does not fit a rollout server of <= 64 {self.gpu.name} GPUs")

    def weight_load_s(self) -> float:
        """Rollout weight swap: the server's shard over PCIe (all TP GPUs in parallel) + fixed overhead."""
        return self.model.weight_bytes / self.tp / (self.gpu.pcie_gbps * 1e9) + self.params.load_overhead_s

    def kv_move_s(self, pages) -> np.ndarray:
        """Moving KV pages between servers (repack): bytes / (NIC·eff over tp GPUs) + one hop latency."""
        nbytes = np.asarray(pages, np.float64) * self.page_tokens * self.model.kv_bytes_per_token
        bw = self.tp * self.gpu.nic_gbps * 1e9 * self.params.kv_net_efficiency
        return nbytes / bw + self.params.relay_hop_latency_s

    # ---- learner ----------------------------------------------------------------------------
    def learner_step_s(self, tokens: float, gpus: int) -> float:
        """6·params·tokens / (gpus·peak·mfu) + fixed overhead."""
        flops = 6.0 * self.model.params * tokens
        return flops / (gpus * self.gpu.bf16_tflops * 1e12 * self.params.learner_mfu) + self.params.learner_step_overhead_s

    def min_learner_gpus(self) -> int:
        """GPUs whose HBM holds params·train_bytes_per_param at 80% fill, rounded up to whole machines."""
        need = self.model.params * self.params.train_bytes_per_param / (0.8 * self.gpu.hbm_gib * 2**30)
        node = self.gpu.gpus_per_node
        return max(node, int(math.ceil(need / node)) * node)

    def train_state_offload_s(self, gpus: int) -> float:
        """Colocated sync: moving the learner's state (params·train_bytes_per_param) between HBM and host."""
        return self.model.params * self.params.train_bytes_per_param / gpus / (self.gpu.pcie_gbps * 1e9)

    def publish_d2h_s(self, learner_gpus: int) -> float:
        """The learner's visible publish cost: each GPU copies its 1/gpus shard to host over PCIe."""
        return self.model.weight_bytes / learner_gpus / (self.gpu.pcie_gbps * 1e9)

    # ---- relay ------------------------------------------------------------------------------
    def relay_chunk_s(self) -> float:
        """One chunk (32 MB, or the whole model if smaller) over one hop: chunk / (node NIC bandwidth·eff)
        + hop latency."""
        node_bw = self.gpu.nic_gbps * 1e9 * self.gpu.gpus_per_node * self.params.relay_efficiency
        return min(self.params.chunk_mb * 1e6, self.model.weight_bytes) / node_bw + self.params.relay_hop_latency_s

    def relay_arrival_s(self, hop: int) -> float:
        """Pipelined chain: the relay ``hop`` hops from the master holds all weights after
        (n_chunks + hop) · chunk_time (hop 0 = the master relay, fed by the learner's push)."""
        n_chunks = math.ceil(self.model.weight_bytes / (self.params.chunk_mb * 1e6))
        return (n_chunks + hop) * self.relay_chunk_s()
