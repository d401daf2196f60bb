"""Offline front door: an HF directory plus a KV memory budget gives a sized engine.

    from laminar_jax.rollout import LLM, SamplingParams
    llm = LLM("path/to/hf_dir", kv_memory_gb=1.0, dtype="bfloat16")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_new_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

The engine (and its compiled programs) lives as long as the LLM object, so repeated generate()
calls compile nothing new for shapes they have met. Requests stop at the EOS ids (config.json's
and the tokenizer's) unless their SamplingParams name other stop ids.

Like vLLM, decode batches follow the live sequences (``rollout.decode_row_buckets``): a long tail
of few live requests runs as a batch of 4, 8 or 16 rows, not all max_num_seqs slots. A request's
tokens can then depend on which others share its steps, in the last bits of fp32 (vLLM's default
behaves the same). Prompts admitted together are prefilled together, up to 8 per call
(``rollout.prefill_rows``), which also moves their KV by float rounding. Pass
``decode_row_buckets=(), prefill_rows=1`` for outputs that never depend on company.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax.matmul_precision import resolve_matmul_precision, scoped_matmul_precision
from laminar_jax.model.arch import TransformerConfig
from laminar_jax.rollout.kernels import Geometry, choose_products
from laminar_jax.rollout.config import RolloutSection
from laminar_jax.rollout.engine import MAX_STOP_IDS, make_engine
from laminar_jax.rollout.offline import complete, per_prompt
from laminar_jax.rollout.sampling import SamplingParams
from laminar_jax.rollout.server import RolloutServer
from laminar_jax.rollout.warmup import warmup as warmup_engine

_DTYPES = ("float32", "bfloat16")


class RequestOutput(NamedTuple):
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids (the stop token included when finish_reason == 'eos')
    logprobs: np.ndarray  # f32[R] behaviour log-probs
    finish_reason: str
    text: Optional[str]  # decoded tokens, None without a tokenizer


def kv_bytes_per_page(cfg: TransformerConfig, page_size: int, dtype: str) -> int:
    """Bytes one KV page takes over all layers (k and v)."""
    itemsize = 2 if dtype == "bfloat16" else 4
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def row_buckets(rows: int, smallest: int = 4, dtype: str = "float32", one_row: Optional[bool] = None) -> tuple[int, ...]:
    """Decode batches for a long tail of few live sequences: powers of two from ``smallest`` below
    ``rows`` (from 2 to 4 rows XLA:CPU's products cost about the same, so those buckets would only
    add programs), and for float32 a batch of 1 row too. One row is often live for many steps (the
    longest request alone), and at one row XLA:CPU runs float32 products as matrix-vector products
    that stream the weights about twice as fast as a 4-row product. bf16 products at one row take
    a slow path (several times the 4-row product), so bf16 buckets start at ``smallest`` unless
    ``one_row`` (the engine runs its few-row products on the native kernel, whose 1-row bf16 product is
    fast: rollout.weight_products)."""
    out, b = [], smallest
    while b < rows:
        out.append(b)
        b *= 2
    single = (dtype == "float32" if one_row is None else one_row) and 1 < rows and smallest > 1
    return ((1,) if single else ()) + tuple(out)


def size_section(cfg: TransformerConfig, kv_memory_gb: float, dtype: str, max_num_seqs: int,
                 max_model_len: Optional[int], max_prompt_len: Optional[int], page_size: int,
                 stop_token_ids: tuple[int, ...], one_row: Optional[bool] = None, **overrides) -> RolloutSection:
    """A RolloutSection whose KV pool fits ``kv_memory_gb`` (pure: config in, section out).

    Raises ValueError naming the argument when the budget cannot hold one full-length sequence.
    """
    if kv_memory_gb <= 0:
        raise ValueError(f"kv_memory_gb={kv_memory_gb}: must be > 0")
    total = int(max_model_len or min(cfg.max_position_embeddings, 4096))
    if total < 2:
        raise ValueError(f"max_model_len={total}: must be >= 2")
    prompt = int(max_prompt_len or total - 1)
    if not 1 <= prompt < total:
        raise ValueError(f"max_prompt_len={prompt}: must be in [1, max_model_len={total})")
    per_page = kv_bytes_per_page(cfg, page_size, dtype)
    pages = int(kv_memory_gb * (1 << 30)) // per_page
    one_seq = -(-total // page_size)
    if pages < one_seq:
        need = one_seq * per_page / (1 << 30)
        raise ValueError(f"kv_memory_gb={kv_memory_gb} holds {pages} KV pages of {page_size} tokens, fewer than one "
                         f"sequence of max_model_len={total} needs ({one_seq} pages, {need:.3f} GB); raise "
                         f"kv_memory_gb or lower max_model_len")
    if len(stop_token_ids) > MAX_STOP_IDS:
        raise ValueError(f"{len(stop_token_ids)} EOS/stop ids; at most {MAX_STOP_IDS} supported")
    # One call of every slot, and row buckets below it. Chunks (decode_chunk) loop over the slots in a
    # while loop, whose bf16 products XLA:CPU runs about half as fast as straight-line code.
    chunk = overrides.get("decode_chunk", 0)
    section = RolloutSection(num_slots=max_num_seqs, page_size=page_size, num_pages=pages + 1,
                             max_prompt_len=prompt, max_total_len=total, max_new_tokens=min(256, total - prompt),
                             stop_token_ids=stop_token_ids, queue_capacity=1 << 16, live_buckets="pow2",
                             decode_row_buckets=row_buckets(chunk or max_num_seqs, dtype=dtype, one_row=one_row),
                             prefill_rows=min(8, max_num_seqs))
    section = dataclasses.replace(section, **overrides)  # decode_chunk, when given, among them
    section.validate("LLM")
    return section


class LLM:
    """vLLM-like offline generation over this project's engine.

    model: a local HF directory (config.json + *.safetensors; tokenizer.json optional).
    kv_memory_gb: KV cache budget; sets the number of KV pages, allocated at the first generate() and
      held while the LLM lives (one server serves every call).
    dtype: 'float32' or 'bfloat16' (weights and KV cache).
    max_num_seqs: concurrent sequences (engine slots).
    max_model_len: cap on prompt + generated tokens (default: min(max_position_embeddings, 4096)).
    max_prompt_len: longest prompt (default: max_model_len - 1).
    page_size: tokens per KV page. 64 by default: decode attention then runs a quarter as many page
      entries, each a larger product, and a few large products cost less than many tiny ones. vLLM's
      CPU backend defaults to 128-token blocks.
    tokenizer: a tokenizer.json path or HF directory; default: the model directory's, if present.
    warmup: compile the prefill buckets and the live-page buckets now instead of on first use.
    matmul_precision: float32 products in float32 or the backend's rounding, as
      runtime.matmul_precision ('auto': float32 for a float32 model); applied to this object's
      compiles and calls only.
    host_malloc: this process's C allocator policy, applied when the LLM is built (process-wide, as
      runtime.host_malloc: 'keep' reuses freed host memory instead of faulting fresh pages in for
      every call's buffers; 'system' or None leaves the allocator as it is; laminar_jax/cpu/host_malloc.py).
    section_overrides: further RolloutSection fields (e.g. live_buckets, decode_chunk).
    """

    def __init__(self, model: str, *, kv_memory_gb: float = 1.0, dtype: str = "float32", max_num_seqs: int = 32,
                 max_model_len: Optional[int] = None, max_prompt_len: Optional[int] = None, page_size: int = 64,
                 tokenizer: Optional[str] = None, warmup: bool = False, matmul_precision: str = "auto",
                 host_malloc: Optional[str] = "keep", **section_overrides):
        from laminar_jax.model.hf import load_hf_config
        from laminar_jax.model.pretrained import from_pretrained
        from laminar_jax.process_settings import apply_host_malloc
        from laminar_jax.model.tokenizer import HFTokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: must be one of {list(_DTYPES)}")
        if host_malloc is not None:
            apply_host_malloc(host_malloc)
        self.matmul_precision = resolve_matmul_precision(matmul_precision, dtype, "matmul_precision")
        cfg = load_hf_config(model)
        tok_path = tokenizer or (model if os.path.exists(os.path.join(model, "tokenizer.json")) else None)
        self.tokenizer = HFTokenizer(tok_path) if tok_path else None
        eos = tuple(cfg.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_id not in eos:
            eos = eos + (self.tokenizer.eos_id,)
        # A 1-row decode batch where its products are fast: float32, or bf16 on the native kernel.
        one_row = dtype == "float32" or choose_products(
            section_overrides.get("weight_products", "auto"), jax.devices()[0].platform,
            Geometry(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size, jnp.dtype(dtype)),
            cfg.largest_weight())[0].kernel is not None
        self.section = size_section(cfg, kv_memory_gb, dtype, max_num_seqs, max_model_len, max_prompt_len,
                                    page_size, eos, one_row=one_row, **section_overrides)
        self.model = from_pretrained(model, dtype=dtype)
        self.engine, self.params = make_engine(self.model, self.section)
        # One server, and so one set of KV pools, for every generate() call: zeroing a fresh
        # decode state cost ~0.5 s per call at a 2 GB budget (vLLM also allocates its cache once).
        self._server: Optional[RolloutServer] = None
        if warmup:
            with scoped_matmul_precision(self.matmul_precision):
                warmup_engine(self.engine, self.params)

    def encode(self, prompt: Union[str, Sequence[int]], index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{index}] is a string but the model has no tokenizer.json; "
                                 f"pass token ids or LLM(..., tokenizer=path)")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: Sequence[Union[str, Sequence[int]]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None, *,
                 seeds: Optional[Sequence[int]] = None, timeout_s: float = 3600.0) -> list[RequestOutput]:
        """Complete every prompt (strings need a tokenizer; token-id lists always work); results in order."""
        ids = [self.encode(p, i) for i, p in enumerate(prompts)]
        if not ids:
            return []
        per = per_prompt(SamplingParams() if sampling_params is None else sampling_params, len(ids))
        with scoped_matmul_precision(self.matmul_precision):
            if self._server is None:
                self._server = RolloutServer(self.engine, self.params)
            try:
                done = complete(self._server, ids, per, seeds=seeds, timeout_s=timeout_s)
            except BaseException:
                self._server = None  # it may hold this call's leftovers: the next call starts afresh
                raise
        return [RequestOutput(p, c.tokens.tolist(), c.logprobs, c.finish_reason,
                              None if self.tokenizer is None else self.tokenizer.decode(c.tokens.tolist()))
                for p, c in zip(ids, done)]


__all__ = ["LLM", "RequestOutput", "kv_bytes_per_page", "row_buckets", "size_section"]
