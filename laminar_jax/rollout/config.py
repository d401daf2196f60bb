"""Config section for the rollout plane (paged-KV engine + server loop)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from laminar_jax.configlib import expect


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """One rollout server: KV-cache geometry, prompt/response limits, default sampling, loop knobs.

    Attributes:
      num_slots: Concurrent sequences (decode batch size).
      page_size: Tokens per KV page.
      num_pages: KV pages in the pool, page 0 (the null page) included.
      prefill_buckets: Padded prompt lengths that prefill compiles for; () means powers of two from 16 up to max_prompt_len.
      max_prompt_len: Longest accepted prompt, in tokens.
      max_new_tokens: Default cap on generated tokens per request.
      max_total_len: Cap on prompt + response tokens; sets the page-table width.
      temperature: Default sampling temperature; 0 means greedy (argmax).
      top_k: Default top-k truncation; 0 disables it.
      top_p: Default nucleus mass in (0, 1]; 1 disables it.
      stop_token_ids: Default stop ids; None means the model's eos ids.
      overlong_prompt: 'error' rejects prompts longer than max_prompt_len, 'truncate' keeps their last max_prompt_len tokens.
      queue_capacity: Bound of the request queue; submit() blocks (with a timeout) when it is full.
      attention_impl: Decode attention kernel name (the kernel seam's registry, laminar_jax.rollout.kernels; the engine logs its choice and the run summary reports it as decode_kernel); 'auto' = the fastest registered kernel that serves the platform and geometry, with the reason for any fallback logged: 'pallas_gpu_paged' on GPUs (JAX's Pallas paged attention, Triton: head_dim and page_size powers of two) and 'pallas_tpu_paged' on TPUs (Mosaic: bfloat16 KV, head_dim a multiple of 128), both over head-major KV pools and per KV-head shard under TP; 'cpu_kernel' on one CPU device when its native kernel builds here (a C++ compiler is needed; a paged attention that reads live pages in place; page_size and head_dim multiples of 16, 1 to 8 query heads per KV head), else 'live_pages'; 'cpu_kernel' insists on the native kernel; 'live_pages' attends only the pages live slots have filled (cost follows the live context), 'gather_dense' every page of every slot's table, 'pool_scan' every page of the pool.
      weight_products: The engine's weight products of few rows (decode steps, and prefills of few tokens): 'auto' runs some through a native CPU kernel that reads the weights in their stored layout (XLA:CPU's GEMM re-packs them per call), on one CPU device when it builds here, where it is faster than XLA's dot: on CPUs with AVX-512 those of up to 64 rows (float32, and bfloat16 where it has AVX-512 BF16; a GEMM micro-kernel from 4 rows, 8 for bfloat16); on AVX2 CPUs those of weights of at least 65,536 elements, float32 up to 64 rows and bfloat16 up to 16 (8-float vectors, and a GEMM micro-kernel from 32 float32 rows; the tiny model's products are too short for the call and stay on XLA's dot); elsewhere none. 'native' insists (every weight, also where 'auto' would not: up to 16 rows where it has no faster form); 'xla' always XLA's dot. Longer prefills and training always use XLA's dot.
      decode_steps_per_call: Tokens per slot per generate() call (a lax.scan; sampling and stop checks run on the device, the host reads the tokens once per call), to amortise the host round trip; 0 = auto: 8 on accelerators, 1 on the CPU (where the host's cores compute and admissions follow every token).
      decode_chunk: Rows per decode chunk; 0 = off (every slot goes through the model on every step). With c > 0, generate() gathers only the slots that hold a sequence into chunks of c rows and loops over as many chunks as needed (a dynamic trip count), so decode cost follows the live slots; every chunk has the same shape, so a sequence's tokens and log-probs do not depend on how many others are live (or on num_slots). Small c suits CPUs; accelerators want 0 or a large c.
      decode_row_buckets: Smaller decode batches for calls with few live slots; () = off. With buckets (e.g. (4, 8, 16) for 32 slots), a generate() call whose slots holding a sequence fit a bucket gathers just those into a batch of that many rows (one compiled program per bucket), so a long-tail step costs what its live rows cost, with one weight read. XLA's matmuls may give a row different bits at different row counts (fp32 on CPU below 32 rows), so a sequence's tokens can then depend on how many others are live: moves between servers are no longer output-identical, and the runtime refuses it with scheduler repack in laminar mode. Offline generation (LLM) uses it; every bucket must be < the rows of one call (decode_chunk, or num_slots).
      prefill_rows: Most prompts one prefill call takes; 1 = one prompt per call. With n > 1, the prompts a server admits in one step are prefilled together, up to n per call (one forward of their tokens packed end to end, each attending only its own prompt: one weight read for all, padded to the next of a few widths, not to n times the longest prompt), so a batch of admissions costs far less than one call each. Their KV then equals the one-prompt path's to float rounding, not bit for bit. Offline generation (LLM) uses it.
      share_prompt_kv: Admit a prompt that a live sequence on this server already holds (the samples of a GRPO group) by copying that sequence's prompt KV pages instead of prefilling it again. The KV is the same bits the prompt's own prefill writes (with prefill_rows=1), so outputs do not change; False prefills every sequence.
      live_buckets: Live-page bucket policy (attention_impl='live_pages' compiles one generate() per bucket): 'fine' = powers of two from 16 plus 1.5x midpoints from 64 (least padded attention), 'pow2' = powers of two, 'pow4' = powers of four (fewest programs; up to 4x the live pages attended).
      warmup_live_buckets: How many of the smallest live-page buckets warmup() compiles; 0 = all. The others compile on first use (a one-off pause mid-run).
      batching: 'continuous' admits into any free slot; 'static' waits for the whole batch to finish (baseline).
      inflight_kv: runtime.mode='inflight' only: what live sequences do with their KV when their server takes a new version between decode steps. 'keep' (PipelineRL) goes on over the KV the old weights wrote (no extra work; the next tokens are sampled from new weights over old-weight context). 'reprefill' (AReaL's partial rollout) recomputes every live sequence's KV (prompt and tokens so far) under the new weights first, so its next tokens are exactly what the new weights give that context; it costs one pass over each live sequence's tokens per swap.
      seed: Base seed for requests that carry neither a seed nor a key.
      server_id: Name reported in stats and stamped into trajectories' extra.
      prefetch: Stage the next version while draining: as soon as a server's board shows a newer version, a thread of its own pulls it (relay, hand-off or store, signatures checked) and builds its host tree (cast to the serving dtype) while the server's last sequences finish, so the swap after the drain only copies it onto the devices. At most one version is staged (a newer one replaces it); a failed prefetch is logged and the swap pulls as without it. The run summary reports swap_stall_p50_s/p99_s (drained and ready -> serving the new version, per swap) and swap_staged_frac. False pulls only once drained.
      prefetch_device: With prefetch: also place the staged version on the server's devices before the drain ends, so the swap is a pointer switch; the devices then hold two versions for a while, which the memory plan counts (its swap_staging term becomes a whole version instead of one tensor). Default False: on accelerators with room to spare only.
      dtype: Serving dtype: the dtype of the weights a server holds and of every published version (the learner casts its master weights to it on its devices before the host copy, so a bfloat16 version is half a float32 one's bytes in the store and on the relays). None (default): model.dtype, set at finalize. A server given a version in another dtype refuses it, naming both.
    """

    num_slots: int = 8
    page_size: int = 16
    num_pages: int = 257
    prefill_buckets: tuple[int, ...] = ()
    max_prompt_len: int = 256
    max_new_tokens: int = 256
    max_total_len: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: Optional[tuple[int, ...]] = None
    overlong_prompt: Literal["error", "truncate"] = "error"
    queue_capacity: int = 1024
    attention_impl: str = "auto"
    weight_products: Literal["auto", "native", "xla"] = "auto"
    decode_steps_per_call: int = 0
    decode_chunk: int = 0
    decode_row_buckets: tuple[int, ...] = ()
    prefill_rows: int = 1
    share_prompt_kv: bool = True
    live_buckets: Literal["fine", "pow2", "pow4"] = "fine"
    warmup_live_buckets: int = 0
    batching: Literal["continuous", "static"] = "continuous"
    inflight_kv: Literal["keep", "reprefill"] = "keep"
    seed: int = 0
    server_id: str = "rollout-0"
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    prefetch: bool = True
    prefetch_device: bool = False

    def validate(self, prefix: str = "rollout") -> None:
        self.validate_with_backends(prefix, ())

    def validate_with_backends(self, prefix: str, extra: tuple[str, ...]) -> None:
        """validate(), also accepting the attention_impl names ``extra`` (Engine's caller-supplied backends)."""
        from laminar_jax.rollout.kernels import attention_names
        from laminar_jax.rollout.sampling import validate_sampling

        backends = (*attention_names(), *extra)
        expect(self.num_slots >= 1, f"{prefix}.num_slots", self.num_slots, ">= 1")
        expect(self.dtype in (None, "float32", "bfloat16", "float16"), f"{prefix}.dtype", self.dtype,
               "None (= model.dtype) or one of ['float32', 'bfloat16', 'float16']")
        expect(isinstance(self.prefetch, bool), f"{prefix}.prefetch", self.prefetch, "True or False")
        expect(isinstance(self.prefetch_device, bool) and (self.prefetch or not self.prefetch_device),
               f"{prefix}.prefetch_device", self.prefetch_device, "True or False (True needs rollout.prefetch=True)")
        expect(self.page_size >= 1, f"{prefix}.page_size", self.page_size, ">= 1")
        expect(self.max_prompt_len >= 1, f"{prefix}.max_prompt_len", self.max_prompt_len, ">= 1")
        expect(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", self.max_new_tokens, ">= 1")
        expect(self.max_total_len > self.max_prompt_len, f"{prefix}.max_total_len", self.max_total_len,
               f"> max_prompt_len={self.max_prompt_len}")
        one_seq = -(-self.max_total_len // self.page_size)
        expect(self.num_pages >= one_seq + 1, f"{prefix}.num_pages", self.num_pages,
               f">= {one_seq + 1} (one full-length sequence of max_total_len={self.max_total_len} "
               f"at page_size={self.page_size}, plus the null page)")
        for i, b in enumerate(self.prefill_buckets):
            expect(b >= 1, f"{prefix}.prefill_buckets[{i}]", b, ">= 1")
        if self.prefill_buckets:
            expect(list(self.prefill_buckets) == sorted(set(self.prefill_buckets)), f"{prefix}.prefill_buckets",
                   self.prefill_buckets, "strictly increasing")
            expect(self.prefill_buckets[-1] >= self.max_prompt_len, f"{prefix}.prefill_buckets",
                   self.prefill_buckets, f"to end at >= max_prompt_len={self.max_prompt_len}")
        validate_sampling(prefix, self.temperature, self.top_k, self.top_p, self.max_new_tokens)
        expect(self.queue_capacity >= 1, f"{prefix}.queue_capacity", self.queue_capacity, ">= 1")
        expect(self.attention_impl in ("auto", *backends), f"{prefix}.attention_impl", self.attention_impl,
               f"one of {sorted(('auto', *backends))}")
        expect(self.weight_products in ("auto", "native", "xla"), f"{prefix}.weight_products", self.weight_products,
               "one of ['auto', 'native', 'xla']")
        expect(self.decode_steps_per_call >= 0, f"{prefix}.decode_steps_per_call", self.decode_steps_per_call,
               ">= 0 (0 = auto)")
        expect(self.live_buckets in ("fine", "pow2", "pow4"), f"{prefix}.live_buckets", self.live_buckets,
               "one of ['fine', 'pow2', 'pow4']")
        expect(self.inflight_kv in ("keep", "reprefill"), f"{prefix}.inflight_kv", self.inflight_kv,
               "one of ['keep', 'reprefill']")
        expect(self.warmup_live_buckets >= 0, f"{prefix}.warmup_live_buckets", self.warmup_live_buckets,
               ">= 0 (0 = all)")
        expect(0 <= self.decode_chunk <= self.num_slots, f"{prefix}.decode_chunk", self.decode_chunk,
               f"in [0, num_slots={self.num_slots}] (0 = no compaction)")
        expect(1 <= self.prefill_rows <= self.num_slots, f"{prefix}.prefill_rows", self.prefill_rows,
               f"in [1, num_slots={self.num_slots}]")
        rows = self.decode_chunk or self.num_slots
        buckets = tuple(self.decode_row_buckets)
        expect(list(buckets) == sorted(set(buckets)) and all(1 <= b < rows for b in buckets),
               f"{prefix}.decode_row_buckets", self.decode_row_buckets,
               f"strictly increasing, each in [1, {rows}) (the rows of one decode call: decode_chunk or num_slots)")

    def buckets(self) -> tuple[int, ...]:
        """The prefill buckets in use (explicit, or powers of two 16, 32, ... >= max_prompt_len)."""
        if self.prefill_buckets:
            return tuple(self.prefill_buckets)
        out, b = [], 16
        while True:
            out.append(b)
            if b >= self.max_prompt_len:
                return tuple(out)
            b *= 2

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_total_len // self.page_size)
