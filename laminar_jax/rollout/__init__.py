"""Rollout plane: paged-KV engine (JetStream-shaped API), sampling, and the continuous-batching server.

Public API:
  RolloutSection                         -- config section (laminar_jax.rollout.config)
  Engine, make_engine                    -- prefill / insert / generate / free over a paged KV cache,
                                            read_slot / write_slot (export / import of a live sequence)
  DecodeSchedule                         -- the decode schedule's knobs, one frozen object (schedule.py)
  DecodeKernels, choose_decode_kernels   -- the kernel seam: decode attention, weight products, argmax (kernels.py)
  SamplingParams, sample_tokens          -- greedy / temperature / top-k / top-p, keyed fold_in(key_s, t)
  RolloutServer, Request, ServerStats    -- step-driven continuous batching, weight swaps, stats
  HostWeights                            -- a version on the host, streamed into place at a swap
  SequenceState                          -- a live sequence as plain data (export / import, to_bytes)
  generate, Completion                   -- offline generation through the real engine
  LLM, RequestOutput                     -- offline front door: HF directory + KV memory budget -> sized engine
"""

from laminar_jax.rollout.config import RolloutSection
from laminar_jax.rollout.engine import Engine, make_engine
from laminar_jax.rollout.kernels import DecodeKernels, choose_decode_kernels
from laminar_jax.rollout.llm import LLM, RequestOutput
from laminar_jax.rollout.offline import Completion, generate
from laminar_jax.rollout.paged import DecodeState, OutOfPages, PageAllocator, Prefix, SlotInit, StepOutput
from laminar_jax.rollout.schedule import DecodeSchedule
from laminar_jax.rollout.records import (NoFreeSlotError, OverlongPromptError, QueueFullError, Request,
                                         SequenceState, ServerStats, VersionMismatchError)
from laminar_jax.rollout.sampling import SamplingParams, sample_tokens
from laminar_jax.rollout.server import HostWeights, RolloutServer

__all__ = [
    "RolloutSection", "Engine", "make_engine", "DecodeSchedule", "DecodeKernels", "choose_decode_kernels", "Completion", "generate", "LLM", "RequestOutput", "DecodeState", "OutOfPages",
    "PageAllocator", "Prefix", "SlotInit", "StepOutput", "NoFreeSlotError", "OverlongPromptError",
    "QueueFullError", "Request", "SequenceState", "ServerStats", "VersionMismatchError", "SamplingParams",
    "sample_tokens", "RolloutServer", "HostWeights",
]
