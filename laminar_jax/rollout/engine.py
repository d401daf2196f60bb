"""The engine: JetStream-shaped ``prefill / insert / generate / free_resource`` over a paged KV cache.

Weights are always passed in (``params`` = the nnx.State from ``nnx.split(model)``); only the
graphdef is fixed at construction, so a new weight version is just a different pytree of the same
shapes and needs no recompilation. Device state is a :class:`DecodeState` pytree, donated and
returned by every mutating call. The engine's only host state is the page allocator and which
pages each slot owns.

Compiled programs: one prefill per prompt bucket, one insert per bucket, one generate per
live-page bucket (backends with ``needs_live_pages``; one generate otherwise), plus the
export/import page copies and one shared-prompt copy (``share_prompt``) per padded batch size; with
``rollout.decode_row_buckets`` one generate per row bucket, with ``rollout.prefill_rows`` > 1 one
packed prefill per packed width (``packed_widths``).

Row buckets: a generate() call whose slots with a sequence fit a bucket runs just those rows
(gathered like a compaction chunk, as straight-line code), so a long tail of a few sequences pays
a small batch's step; its bits may depend on the bucket (see the config field), which is why
repack refuses it.

Batch compaction (``rollout.decode_chunk`` = c > 0): generate() takes the slots that hold a
sequence (host bookkeeping, no device read), lays them out as chunks of c rows (padding rows
point past the last slot and are inactive), and runs the model once per chunk in a loop whose
trip count is a runtime value, so one program serves every live count and the cost follows the
live slots, not num_slots. A row's result must not depend on the others: XLA:CPU (like GPU BLAS)
picks different matmul kernels for different row counts, so a [n, K] x [K, N] product is not
row-wise identical across n; every chunk is the same [c, K] shape instead, which is.

Live-page buckets: the engine keeps, per slot, an upper bound on the device's cached length
(set at insert/import, + decode_steps_per_call after every generate(), whether or not the slot
still runs), so it knows without reading the device how many pages the next call can attend;
it rounds the total up to a power of two (at most num_slots x pages_per_seq). The device also
counts the real live pages and reports ``StepOutput.overflow``; the server raises on it. Prefill computes the KV of ``prompt[:-1]``; the last prompt token is fed
by the first generate step, so every sampled token (including the first) goes through the one
sampling path in generate().

Tensor parallelism: ``Engine(..., mesh=...)`` (a Mesh with a 'tensor' axis) runs every program
over that mesh's devices in the Megatron layout of rollout/tp.py: weights split by heads, MLP
columns/rows and vocabulary, KV pages split on the KV-head axis, page table and sampling state
replicated. The calls keep their signatures; params in another layout (or on the host) are
placed once per params object. Export (read_slot) gathers to plain host arrays, so a sequence
moves between engines of any TP width.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from laminar_jax.model.arch import TransformerConfig
from laminar_jax.model.precision import cast_floating
from laminar_jax.native import ops as native_ops
from laminar_jax.rollout.attention import (
    BACKENDS,
    DecodeMeta,
    from_pool,
    live_page_list,
    native_argmax_here,
    pool_shape,
    prefill_dense,
    prefill_packed,
    resolve_backend,
    resolve_row_kernel,
    scatter_pages,
    scatter_tokens,
    storage_dtype,
    to_pool,
)
from laminar_jax.rollout.config import RolloutSection
from laminar_jax.rollout.extend import engine_model
from laminar_jax.rollout.paged import (
    DecodeState,
    OutOfPages,
    PageAllocator,
    Prefix,
    SlotInit,
    StepOutput,
    pages_needed,
)
from laminar_jax.rollout.sampling import first_argmax, gumbel_noise, sample_tokens, token_keys
from laminar_jax.rollout import tp as tpl

MAX_STOP_IDS = 8


class Engine:
    """Paged-KV decode engine for one model graph. Not thread-safe: one owner calls it."""

    def __init__(self, graphdef: Any, model_cfg: TransformerConfig, section: RolloutSection,
                 kv_dtype: Any = jnp.float32, attention_backends: Optional[dict] = None, mesh: Any = None):
        backends = {**BACKENDS, **(attention_backends or {})}
        section.validate_with_backends("rollout", tuple(backends))  # caller-supplied backends are valid names too
        self.graphdef = graphdef
        self.model_cfg = model_cfg
        self.section = section
        self.kv_dtype = kv_dtype
        self.num_slots = section.num_slots
        self.page_size = section.page_size
        self.pages_per_seq = section.pages_per_seq
        self.buckets = section.buckets()
        # share_prompt() copies this many pages: the most a prompt's KV (all but its last token) fills.
        self._prompt_pages = max(1, min(pages_needed(self.buckets[-1] - 1, self.page_size), self.pages_per_seq))
        self.allocator = PageAllocator(section.num_pages)
        self.slot_pages: dict[int, list[int]] = {}
        # Tensor parallelism (rollout/tp.py): mesh=None keeps everything on the default device.
        self.mesh = mesh
        self.attention_impl = resolve_backend(section.attention_impl, platform=self.devices[0].platform,
                                              tensor_parallel=mesh is not None, page_size=self.page_size,
                                              head_dim=model_cfg.head_dim,
                                              group=model_cfg.num_heads // model_cfg.num_kv_heads)
        self._attend = backends[self.attention_impl]
        self.steps_per_call = section.decode_steps_per_call
        self.uses_live_pages = bool(getattr(self._attend, "needs_live_pages", False))
        self.chunk = section.decode_chunk  # 0 = no compaction (one batch of num_slots rows)
        rows_per_call = self.chunk or self.num_slots
        self.live_buckets = (_live_buckets(rows_per_call * self.pages_per_seq, section.live_buckets)
                             if self.uses_live_pages else (0,))
        self._num_rows = -(-self.num_slots // rows_per_call) * rows_per_call  # length of the rows array
        self.row_buckets = tuple(section.decode_row_buckets)  # smaller batches for few live slots
        # Token counts prefill_insert_rows() pads its packed prompts to (one program each).
        self.packed_widths = _packed_widths(self.buckets[0], self.buckets[-1], section.prefill_rows)
        self._cached_hi: dict[int, int] = {}  # slot -> upper bound of the device's lengths[slot]
        self._key_shape = jax.random.key_data(jax.random.key(0)).shape
        self.tp = 1 if mesh is None else tpl.tp_width(mesh)
        if mesh is not None:
            tpl.check_tp(model_cfg, self.tp)
        self.state_shardings = None if mesh is None else self._state_shardings(mesh)
        self._param_shardings: tuple = (None, None)  # (params treedef, [NamedSharding per leaf])
        self.row_kernel_rows, self.row_kernel_min_weights = resolve_row_kernel(
            section.weight_products, kv_dtype, platform=self.devices[0].platform, tensor_parallel=mesh is not None,
            largest_weight=model_cfg.largest_weight())
        # Hashable and equal for equal configs, so engines of the same model shape share compiled code.
        self._spec = _Spec(graphdef, model_cfg.num_layers, self.page_size, self._attend,
                           section.decode_steps_per_call, jnp.dtype(kv_dtype), self.chunk, self.state_shardings,
                           vocab_size=model_cfg.vocab_size, row_kernel_rows=self.row_kernel_rows,
                           row_kernel_min_weights=self.row_kernel_min_weights, longest_prompt=self.buckets[-1],
                           native_argmax=native_argmax_here(self.devices[0].platform, mesh is not None))
        self._params_cache: tuple = (None, None, None, None)  # (params, leaves, programs, per row bucket) last seen

    def _bind(self, params) -> tuple[list, "_Programs"]:
        """Flattened params and the programs for their tree structure.

        Flattening an nnx.State (and hashing the graphdef for a jit cache lookup) costs
        milliseconds, so it happens once per params object, not once per call.
        """
        if self._params_cache[0] is not params:
            leaves, treedef = jax.tree.flatten(params)
            if self.mesh is not None:  # a no-op for params already in this engine's layout (place_params)
                leaves = tpl.place_leaves(leaves, self.param_shardings(params))
            self._params_cache = (params, leaves, _programs(self._spec, treedef),
                                  {b: _programs(self._spec._replace(chunk=b, one_chunk=True), treedef)
                                   for b in self.row_buckets})
        return self._params_cache[1], self._params_cache[2]

    def _generate_program(self, rows_per_call: int) -> Callable:
        """The generate program for a call of ``rows_per_call`` rows (the engine's own, or a row bucket's)."""
        return self._params_cache[3][rows_per_call].generate if rows_per_call in self.row_buckets \
            else self._params_cache[2].generate

    # ---------------------------------------------------------------- layout (rollout/tp.py)

    def param_shardings(self, params) -> list:
        """NamedSharding per leaf of ``jax.tree.leaves(params)`` in this engine's TP layout."""
        if self.mesh is None:
            raise ValueError("param_shardings: this engine has no mesh")
        treedef = jax.tree.structure(params)
        if self._param_shardings[0] is None or self._param_shardings[0] != treedef:
            self._param_shardings = (treedef, tpl.param_shardings_list(params, self.mesh))
        return self._param_shardings[1]

    def place_params(self, params):
        """params (host numpy or device arrays) -> the same tree in this engine's layout.

        A host leaf sends each device only its own shard (make_array_from_callback). Without a
        mesh: one device_put onto the default device.
        """
        if self.mesh is None:
            return jax.device_put(params)
        leaves, treedef = jax.tree.flatten(params)
        return jax.tree.unflatten(treedef, tpl.place_leaves(leaves, self.param_shardings(params)))

    def swap_params(self, old, host, on_leaf: Optional[Callable[[int, jax.Array], None]] = None):
        """The weights ``old`` replaced by the host tree ``host`` (same structure) one tensor at a
        time: each old buffer is deleted before its replacement is placed, so the devices hold one
        version plus one tensor at any moment, never two versions. The caller owns ``old`` (no other
        server runs on those buffers) and has no program in flight on them. on_leaf(i, placed) is
        called after each placement (tests measure the devices' live bytes there)."""
        old_leaves = jax.tree.leaves(old)
        host_leaves, treedef = jax.tree.flatten(host)
        if len(old_leaves) != len(host_leaves):
            raise ValueError(f"swap_params: {len(host_leaves)} new tensors for {len(old_leaves)} old ones")
        cached = self._params_cache[1] if self._params_cache[0] is old else None  # _bind's resharded copies
        self._params_cache = (None, None, None, None)
        shardings = self.param_shardings(host) if self.mesh is not None else None
        new = []
        for i, (o, h) in enumerate(zip(old_leaves, host_leaves)):
            for x in (o, None if cached is None else cached[i]):
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
            new.append(jax.device_put(h, self.devices[0]) if shardings is None else tpl.place_leaf(h, shardings[i]))
            if on_leaf is not None:
                on_leaf(i, new[-1])
        return jax.tree.unflatten(treedef, new)

    def release_params(self, params) -> None:
        """Delete every buffer of ``params`` (and any resharded copy _bind keeps) now; the caller
        owns them and will not run on them again."""
        cached = self._params_cache[1] if self._params_cache[0] is params else []
        self._params_cache = (None, None, None, None)
        for x in [*jax.tree.leaves(params), *cached]:
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()

    @property
    def devices(self) -> list:
        """The devices this engine's weights and KV pages live on."""
        return list(self.mesh.devices.flat) if self.mesh is not None else [jax.devices()[0]]

    def _state_shardings(self, mesh) -> DecodeState:
        kv = tuple(tpl.pool_sharding(mesh) for _ in range(self.model_cfg.num_layers))
        rep = tpl.replicated(mesh)
        return DecodeState(kv, kv, *([rep] * (len(DecodeState._fields) - 2)))

    def _settle(self, state: DecodeState) -> DecodeState:
        """Keep the state in its layout after a program that does not constrain it (free when it already is)."""
        return state if self.mesh is None else jax.device_put(state, self.state_shardings)

    # ---------------------------------------------------------------- state

    def init_decode_state(self) -> DecodeState:
        if self.mesh is not None:  # built in place: each device allocates only its KV-head shard
            return jax.jit(self._zero_state, out_shardings=self.state_shardings)()
        return self._zero_state()

    def _zero_state(self) -> DecodeState:
        c, s, n = self.model_cfg, self.num_slots, self.pages_per_seq
        store = storage_dtype(self.kv_dtype)  # bf16 pools live as uint16 bits (see storage_dtype)

        def zeros(key):
            shape = pool_shape(self.section.num_pages, self.page_size, c.num_kv_heads, c.head_dim, key=key)
            return tuple(jnp.zeros(shape, store) for _ in range(c.num_layers))
        return DecodeState(
            k_pages=zeros(True), v_pages=zeros(False),
            page_table=jnp.zeros((s, n), jnp.int32), lengths=jnp.zeros((s,), jnp.int32),
            last_token=jnp.zeros((s,), jnp.int32), num_generated=jnp.zeros((s,), jnp.int32),
            max_new=jnp.zeros((s,), jnp.int32), active=jnp.zeros((s,), bool),
            keys=jnp.zeros((s, *self._key_shape), jnp.uint32), temperature=jnp.zeros((s,), jnp.float32),
            top_k=jnp.zeros((s,), jnp.int32), top_p=jnp.ones((s,), jnp.float32),
            stop_ids=jnp.full((s, MAX_STOP_IDS), -1, jnp.int32))

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"prompt of {n} tokens exceeds the largest prefill bucket {self.buckets[-1]}")

    def pad_prompt(self, prompt_ids) -> tuple[np.ndarray, int]:
        """i32[1, bucket] right-padded with 0, and the true length."""
        ids = np.asarray(prompt_ids, np.int32).reshape(-1)
        out = np.zeros((1, self.bucket_for(len(ids))), np.int32)
        out[0, :len(ids)] = ids
        return out, len(ids)

    def reserve_pages(self, prompt_len: int, max_new: int) -> int:
        """Pages a sequence needs for its whole life: KV of prompt + max_new - 1 tokens (the last sampled token is never fed)."""
        return pages_needed(prompt_len + max_new - 1, self.page_size)

    # ---------------------------------------------------------------- JetStream API

    def prefill(self, params: Any, padded_tokens: np.ndarray, true_length: int) -> Prefix:
        """KV of ``padded_tokens[0, :true_length-1]``. padded_tokens: i32[1, bucket]."""
        if not 1 <= true_length <= padded_tokens.shape[-1]:
            raise ValueError(f"true_length={true_length}: must be in [1, {padded_tokens.shape[-1]}]")
        leaves, progs = self._bind(params)
        k, v, last = progs.prefill(leaves, np.asarray(padded_tokens, np.int32).reshape(1, -1), np.int32(true_length))
        return Prefix(k, v, np.int32(true_length), last)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, init: SlotInit) -> DecodeState:
        """Allocate the slot's pages (for its whole life), page in the prefix KV, activate the slot.

        Raises OutOfPages (state untouched) when the pool cannot hold the sequence.
        """
        if slot in self.slot_pages:
            raise ValueError(f"slot {slot} is occupied; free_resource({slot}) first")
        prompt_len = int(prefix.true_length)
        pages = self.allocator.allocate(self.reserve_pages(prompt_len, init.max_new))
        self.slot_pages[slot] = pages
        self._cached_hi[slot] = prompt_len - 1
        return self._settle(_insert_jit(self._spec.page_size, decode_state, prefix.k, prefix.v, np.int32(prompt_len),
                                        prefix.last_token, np.int32(slot), self._page_row(pages),
                                        *self._init_arrays(init)))

    def prefill_insert(self, params: Any, decode_state: DecodeState, slot: int, prompt_ids,
                       init: SlotInit) -> DecodeState:
        """prefill() + insert() of one prompt in one jitted call (half the dispatches; the Prefix stays on device).

        Same pages and state as the two calls, the KV up to float rounding (XLA fuses one program
        differently from two), so the server admits every sequence through this one path; raises
        OutOfPages (state untouched) like insert().
        """
        if slot in self.slot_pages:
            raise ValueError(f"slot {slot} is occupied; free_resource({slot}) first")
        padded, n = self.pad_prompt(prompt_ids)
        leaves, progs = self._bind(params)
        pages = self.allocator.allocate(self.reserve_pages(n, init.max_new))
        self.slot_pages[slot] = pages
        self._cached_hi[slot] = n - 1
        return progs.prefill_insert(leaves, decode_state, padded, np.int32(n), np.int32(slot), self._page_row(pages),
                                    *self._init_arrays(init))

    def prefill_insert_rows(self, params: Any, decode_state: DecodeState, slots: list[int], prompts: list,
                            inits: list[SlotInit]) -> DecodeState:
        """prefill_insert() of several prompts (at most rollout.prefill_rows) in one call: one forward,
        one weight read.

        The prompts are packed end to end in one row, each attending only its own tokens, padded to
        the smallest of ``packed_widths`` that holds them, so the call costs about their tokens, not
        their count times the longest one's bucket (a [B, T] batch of prompts of 8-31 tokens was ~40%
        padding). The KV equals the one-prompt path's to float rounding (products of other shapes),
        not bit for bit. Raises OutOfPages (state and allocator untouched) when the pool cannot hold
        them all.
        """
        if len(set(slots)) != len(slots) or any(s in self.slot_pages for s in slots):
            raise ValueError(f"slots {slots}: must be distinct and free")
        if not (len(slots) == len(prompts) == len(inits) >= 1):
            raise ValueError(f"got {len(slots)} slots, {len(prompts)} prompts, {len(inits)} inits")
        b = self.section.prefill_rows
        if len(slots) > b:
            raise ValueError(f"{len(slots)} prompts in one call: rollout.prefill_rows={b} at most")
        ids = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        for x in ids:
            self.bucket_for(len(x))  # a prompt over the largest bucket is refused, as prefill_insert() does
        width = next(w for w in self.packed_widths if w >= sum(len(x) - 1 for x in ids))
        taken = self._allocate_all(ids, inits)
        rows, slot_ids = self._claim_rows(b, slots, taken, ids)
        last, cached = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        for i, x in enumerate(ids):
            last[i], cached[i] = x[-1], len(x) - 1
        leaves, progs = self._bind(params)
        return progs.prefill_insert_rows(leaves, decode_state, *self._pack(ids, taken, width), slot_ids, rows, last,
                                         cached, *self._init_columns(inits, b))

    def _pack(self, ids: list, taken: list[list[int]], width: int) -> tuple[np.ndarray, ...]:
        """Packed prefill inputs, i32[width] each: every prompt's tokens but its last, end to end, as
        (token, position in its prompt, prompt index, KV page, offset in the page). Padding tokens form
        a prompt of their own (index len(ids)) whose KV goes to the null page."""
        tokens, positions, page = (np.zeros((width,), np.int32) for _ in range(3))
        segment = np.full((width,), len(ids), np.int32)
        offset = np.arange(width, dtype=np.int32) % self.page_size
        at = 0
        for i, (x, pages) in enumerate(zip(ids, taken)):
            p = np.arange(len(x) - 1, dtype=np.int32)
            span = slice(at, at + len(p))
            tokens[span], positions[span], segment[span] = x[:-1], p, i
            page[span], offset[span] = np.asarray(pages, np.int32)[p // self.page_size], p % self.page_size
            at += len(p)
        return tokens, positions, segment, page, offset

    def share_prompt(self, decode_state: DecodeState, src_slots: list[int], slots: list[int], prompts: list,
                     inits: list[SlotInit]) -> DecodeState:
        """Admit prompts that other slots already hold without prefilling them again: copy each
        source's prompt KV pages into the new slot's own pages, activate the slots; one call for all.

        A GRPO group's samples share one prompt, so all but one of its prefills become page copies.
        The KV is the source's bit for bit (prefill is deterministic, so also what the slot's own
        prefill_insert() would write); the copied pages may carry the source's later tokens past the
        prompt, which the new slot never attends (its length is the prompt's) and overwrites as it
        decodes. Each source must hold its prompt with the prompt KV in place (a live single-turn
        sequence does, finished or not, until free_resource()), and be none of ``slots``. The batch
        is padded to a power of two (padding rows copy the null page onto itself and set no slot).
        Raises OutOfPages (state and allocator untouched) when the pool cannot hold them all.
        """
        if not (len(src_slots) == len(slots) == len(prompts) == len(inits) >= 1):
            raise ValueError(f"got {len(src_slots)} sources, {len(slots)} slots, {len(prompts)} prompts, "
                             f"{len(inits)} inits")
        if len(set(slots)) != len(slots) or any(s in self.slot_pages for s in slots):
            raise ValueError(f"slots {slots}: must be distinct and free")
        for src in src_slots:
            if src not in self.slot_pages:
                raise ValueError(f"share_prompt: source slot {src} holds no sequence")
        ids = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        for x in ids:
            if not 1 <= len(x) <= self.buckets[-1]:
                raise ValueError(f"share_prompt: prompt of {len(x)} tokens; must be in [1, {self.buckets[-1]}]")
        b = 1 << (len(ids) - 1).bit_length()
        taken = self._allocate_all(ids, inits)
        src, dst = np.zeros((2, b, self._prompt_pages), np.int32)  # padding: the null page onto itself
        cached, last = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        for i, (source, x, pages) in enumerate(zip(src_slots, ids, taken)):
            m = pages_needed(len(x) - 1, self.page_size)  # pages holding the prompt's KV (the last token is fed later)
            src[i, :m], dst[i, :m] = self.slot_pages[source][:m], pages[:m]
            cached[i], last[i] = len(x) - 1, x[-1]
        rows, slot_ids = self._claim_rows(b, slots, taken, ids)
        return self._settle(_share_prompt_jit(decode_state, src.reshape(-1), dst.reshape(-1), slot_ids, rows,
                                              cached, last, *self._init_columns(inits, b)))

    def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, StepOutput]:
        """Advance every active slot by ``decode_steps_per_call`` tokens (one jitted call, state donated)."""
        leaves, _ = self._bind(params)
        rows, n_chunks = self._rows()
        bucket = self.live_bucket()
        for slot in self._cached_hi:
            self._cached_hi[slot] += self.steps_per_call
        # len(rows) names the program: row buckets are smaller than the engine's own call (validated).
        return self._generate_program(len(rows))(leaves, decode_state, rows, n_chunks, bucket)

    def _row_bucket(self) -> int:
        """The smallest row bucket that holds every slot with a sequence; 0 = the engine's own call shape."""
        return next((b for b in self.row_buckets if b >= len(self._cached_hi)), 0)

    def _rows(self) -> tuple[np.ndarray, np.int32]:
        """(i32[R] slots in chunk order, padded with num_slots; number of chunks to run).

        Without compaction every slot is a row and there is one chunk (R = num_slots). With it,
        the slots that hold a sequence (some may have finished on the device since; they compute
        masked rows), in slot order. When they fit a row bucket, R is that bucket and one chunk runs.
        """
        small = self._row_bucket()
        rows = np.full((small or self._num_rows,), self.num_slots, np.int32)
        if not (small or self.chunk):
            rows[:self.num_slots] = np.arange(self.num_slots)
            return rows, np.int32(1)
        live = sorted(self._cached_hi)
        rows[:len(live)] = live
        return rows, np.int32(-(-len(live) // (small or self.chunk)))

    def live_bucket(self) -> int:
        """Static live-page count the next generate() compiles for (0 when the backend does not use it).

        A slot with cached-length bound c attends, in the next k-step call, positions <= c + k - 1,
        i.e. its logical pages 0 .. (c + k - 1) // page, never more than it reserved.
        """
        if not self.uses_live_pages:
            return 0
        small = self._row_bucket()
        if small:  # a row bucket's one program: room for all its rows' pages (see _row_cover)
            return self._row_cover(small)
        need = self.live_pages_bound()
        return next(b for b in self.live_buckets if b >= need)

    def _row_cover(self, rows: int) -> int:
        """The live-page bucket that holds every page ``rows`` slots can attend (rows * pages_per_seq).

        Row-bucket calls always use it: one program per row bucket instead of one per live-page
        bucket (~2.7 s of compile each at ~100M), for attention over a few more pages in steps whose
        cost is the weight read.
        """
        return next(b for b in self.live_buckets if b >= min(rows * self.pages_per_seq, self.live_buckets[-1]))

    def live_pages_bound(self) -> int:
        """Upper bound on the KV pages one chunk of the next generate() call attends (summed over its slots)."""
        k, ps = self.steps_per_call, self.page_size
        per_slot = [min(len(self.slot_pages[s]), (self._cached_hi[s] + k - 1) // ps + 1)
                    for s in sorted(self._cached_hi)]
        chunk = self._row_bucket() or self.chunk
        if not chunk:
            return sum(per_slot)
        return max((sum(per_slot[i:i + chunk]) for i in range(0, len(per_slot), chunk)), default=0)

    def warmup(self, params: Any) -> None:
        """Compile every prefill_insert bucket (what the server admits with), the share_prompt batch
        sizes and every generate variant now.

        Runs on a throwaway state; a busy engine (no free slot or pages) compiles prefill() instead.
        """
        state = self.init_decode_state()
        free_slot = next((s for s in range(self.num_slots) if s not in self.slot_pages), None)
        init = SlotInit(np.zeros(self._key_shape, np.uint32), 0.0, 0, 1.0, 1, np.zeros(0, np.int32))
        shared = False  # share_prompt()'s programs serve every prompt bucket: compiled from the first
        for b in self.buckets:
            if free_slot is None or self.allocator.num_free < self.reserve_pages(b, 1):
                jax.block_until_ready(self.prefill(params, np.zeros((1, b), np.int32), 1))
                continue
            state = self.prefill_insert(params, state, free_slot, np.zeros(b, np.int32), init)  # a b-token prompt
            if not shared:
                state, shared = self._warmup_share_prompt(state, free_slot, b, init)
                state = self._warmup_move(state, free_slot, b, init)
            state = self.deactivate(state, free_slot)
            self.free_resource(free_slot)
        state = self._warmup_prefill_rows(params, state, init)
        leaves, _ = self._bind(params)
        n = self.section.warmup_live_buckets or len(self.live_buckets)
        rows = np.full((self._num_rows,), self.num_slots, np.int32)
        for bucket in self.live_buckets[:n]:
            state, out = self._generate_program(self._num_rows)(leaves, state, rows, np.int32(1), bucket)
        for small in self.row_buckets:
            bucket = self._row_cover(small) if self.uses_live_pages else 0
            state, out = self._generate_program(small)(leaves, state, rows[:small], np.int32(1), bucket)
        jax.block_until_ready(out)

    def _warmup_share_prompt(self, state: DecodeState, src_slot: int, bucket: int,
                             init: SlotInit) -> tuple[DecodeState, bool]:
        """Compile share_prompt() at every padded batch size (one program each, for every prompt)
        from src_slot's prompt, as far as free slots and pages allow; (state, compiled)."""
        b, compiled = 1, False
        while b // 2 + 1 < self.num_slots:  # the fewest rows that pad to b, besides the source
            free = [s for s in range(self.num_slots) if s not in self.slot_pages][:b // 2 + 1]
            if len(free) < b // 2 + 1 or self.allocator.num_free < len(free) * self.reserve_pages(bucket, 1):
                break
            state = self.share_prompt(state, [src_slot] * len(free), free, [np.zeros(bucket, np.int32)] * len(free),
                                      [init] * len(free))
            for slot in free:
                state = self.deactivate(state, slot)
                self.free_resource(slot)
            b, compiled = b * 2, True
        return state, compiled

    def _warmup_move(self, state: DecodeState, slot: int, prompt_len: int, init: SlotInit) -> DecodeState:
        """Compile the export/import page copies (one program each, every sequence's pages padded to
        pages_per_seq): the first repack of a run would otherwise lower and compile them mid-tail,
        holding the GIL, on the thread that moves the sequence. slot holds a prompt_len-token prompt
        and holds it again on return."""
        num_cached = prompt_len - 1
        k, v = self.read_slot(state, slot, num_cached)
        state = self.deactivate(state, slot)
        self.free_resource(slot)
        return self.write_slot(state, slot, k, v, num_cached, 0, prompt_len, init)

    def _warmup_prefill_rows(self, params: Any, state: DecodeState, init: SlotInit) -> DecodeState:
        """Compile prefill_insert_rows at every packed width: calls of padding alone, which write
        only the null page and no slot (so they need no free slot or page)."""
        b = self.section.prefill_rows
        leaves, progs = self._bind(params)
        none, rows = np.full((b,), self.num_slots, np.int32), np.zeros((b, self.pages_per_seq), np.int32)
        for width in self.packed_widths:
            state = progs.prefill_insert_rows(leaves, state, *self._pack([], [], width), none, rows,
                                              np.zeros((b,), np.int32), np.zeros((b,), np.int32),
                                              *self._init_columns([init], b))
        return state

    def free_resource(self, slot: int) -> None:
        """Return the slot's pages to the pool. The device must already have it inactive (finished, or deactivate())."""
        self.allocator.free(self.slot_pages.pop(slot))
        self._cached_hi.pop(slot, None)

    def deactivate(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stop a live slot on the device (before export or abort)."""
        return self._settle(_deactivate_jit(decode_state, np.int32(slot)))

    # ---------------------------------------------------------------- export / import

    def read_slot(self, decode_state: DecodeState, slot: int, num_cached: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the slot's first ceil(num_cached/page) pages: (k, v) f[L, n, page, Hkv, D]."""
        n = pages_needed(num_cached, self.page_size)
        row = self._page_row(self.slot_pages[slot])
        k, v = jax.device_get(_read_pages_jit(decode_state, row))
        kv = np.dtype(self.kv_dtype)  # stored bits -> values (a view, no copy)
        return np.asarray(k)[:, :n].view(kv), np.asarray(v)[:, :n].view(kv)

    def write_slot(self, decode_state: DecodeState, slot: int, k: np.ndarray, v: np.ndarray, num_cached: int,
                   last_token: int, prompt_len: int, init: SlotInit) -> DecodeState:
        """Import: allocate the slot's pages, copy in k/v (f[L, n, page, Hkv, D]), activate it."""
        if slot in self.slot_pages:
            raise ValueError(f"slot {slot} is occupied")
        n = k.shape[1]
        if n != pages_needed(num_cached, self.page_size):
            raise ValueError(f"got {n} KV pages for {num_cached} cached tokens at page_size={self.page_size}")
        pages = self.allocator.allocate(self.reserve_pages(prompt_len, init.max_new))
        self.slot_pages[slot] = pages
        self._cached_hi[slot] = int(num_cached)
        pad = [(0, 0), (0, self.pages_per_seq - n)] + [(0, 0)] * (k.ndim - 2)
        row = self._page_row(pages)
        dst = np.where(np.arange(self.pages_per_seq) < n, row, 0).astype(np.int32)
        if self.mesh is None:
            kd, vd = (jnp.asarray(np.pad(x, pad)).astype(self.kv_dtype) for x in (k, v))
        else:  # each device receives only its KV heads of the imported pages
            kd, vd = (tpl.place_leaf(np.pad(np.asarray(x).astype(self.kv_dtype), pad), tpl.kv_sharding(self.mesh, 5))
                      for x in (k, v))
        return self._settle(_write_slot_jit(decode_state, kd, vd, dst, np.int32(slot), row, np.int32(num_cached),
                                            np.int32(last_token), *self._init_arrays(init)))

    # ---------------------------------------------------------------- multi-turn (rollout/extend.py)

    def park(self, slot: int) -> None:
        """A stopped sequence waits on its environment: its pages stay, decode calls skip it."""
        if slot not in self.slot_pages:
            raise ValueError(f"slot {slot} holds no sequence to park")
        self._cached_hi.pop(slot, None)

    def detach(self, decode_state: DecodeState, slot: int) -> tuple[DecodeState, list[int]]:
        """A parked sequence gives its slot up and keeps its KV pages (returned; still allocated):
        the slot is free for another sequence, attach() puts the pages in a slot again."""
        if slot not in self.slot_pages:
            raise ValueError(f"slot {slot} holds no sequence to detach")
        self._cached_hi.pop(slot, None)
        return _deactivate_jit(decode_state, np.int32(slot)), self.slot_pages.pop(slot)

    def attach(self, decode_state: DecodeState, slot: int, pages: list[int], num_cached: int, last_token: int,
               init: SlotInit) -> DecodeState:
        """Give detached pages a free slot again, with the sequence's sampling state; the slot stays
        inactive (extend() feeds the observation and activates it)."""
        if slot in self.slot_pages:
            raise ValueError(f"slot {slot} is occupied")
        self.slot_pages[slot] = list(pages)
        return _attach_jit(decode_state, np.int32(slot), self._page_row(pages), np.int32(num_cached),
                           np.int32(last_token), *self._init_arrays(init))

    def extend(self, params: Any, decode_state: DecodeState, slot: int, observation_ids, num_cached: int,
               last_token: int, num_generated: int, max_new: int) -> DecodeState:
        """Feed a parked slot's observation over its cached context (see rollout/extend.py), reactivate it.

        num_cached: tokens whose KV the slot holds (prompt - 1 + response so far, the last sampled
        token excluded); last_token: that last sampled token; num_generated: policy tokens sampled
        so far (the sampling key's counter); max_new: the next turn's token budget. Pages for the observation and the
        next turn are added to the slot's own; raises ValueError past pages_per_seq, OutOfPages
        (state untouched) when the pool is short.
        """
        from laminar_jax.rollout import extend as ext

        if slot not in self.slot_pages:
            raise ValueError(f"slot {slot} holds no sequence to extend")
        ids, m = ext.padded_ids(observation_ids)
        # KV written from here: m fed now (last_token + m - 1 observation ids), the last observation
        # id fed by the next generate(), then max_new - 1 sampled tokens: num_cached + m + max_new in all.
        need = pages_needed(num_cached + m + max_new, self.page_size)
        if need > self.pages_per_seq:
            raise ValueError(f"extend: {num_cached + m + max_new} tokens need {need} pages, more than "
                             f"rollout.pages_per_seq={self.pages_per_seq}")
        have = self.slot_pages[slot]
        if need > len(have):
            have.extend(self.allocator.allocate(need - len(have)))
        self._cached_hi[slot] = num_cached + m
        leaves, _ = self._bind(params)
        treedef = jax.tree.structure(params)
        # One row attends at most its own pages_per_seq pages.
        program = ext.extend_program(self._spec, treedef, self.pages_per_seq if self.uses_live_pages else 0)
        return self._settle(program(leaves, decode_state, np.int32(slot), self._page_row(have), ids, np.int32(m),
                                    np.int32(num_cached), np.int32(last_token), np.int32(num_generated),
                                    np.int32(max_new)))

    # ---------------------------------------------------------------- helpers

    def _allocate_all(self, ids: list, inits: list[SlotInit]) -> list[list[int]]:
        """Each prompt's pages for its whole life, or none: OutOfPages leaves the allocator as it was."""
        taken: list[list[int]] = []
        try:
            for x, init in zip(ids, inits):
                taken.append(self.allocator.allocate(self.reserve_pages(len(x), init.max_new)))
        except OutOfPages:
            for pages in taken:
                self.allocator.free(pages)
            raise
        return taken

    def _claim_rows(self, b: int, slots: list[int], taken: list[list[int]], ids: list) -> tuple[np.ndarray, np.ndarray]:
        """Give each slot its pages (prompt KV cached up to its last token); the batch's page rows
        i32[b, pages_per_seq] and slot ids i32[b], padding rows naming no slot (num_slots) and the null page."""
        rows, slot_ids = np.zeros((b, self.pages_per_seq), np.int32), np.full((b,), self.num_slots, np.int32)
        for i, (slot, pages, x) in enumerate(zip(slots, taken, ids)):
            rows[i], slot_ids[i] = self._page_row(pages), slot
            self.slot_pages[slot] = pages
            self._cached_hi[slot] = len(x) - 1
        return rows, slot_ids

    def _init_columns(self, inits: list[SlotInit], b: int) -> list[np.ndarray]:
        """The inits' arrays stacked per field over b rows (padding rows repeat the first: their slot is dropped)."""
        per_row = [self._init_arrays(init) for init in inits]
        per_row += [per_row[0]] * (b - len(per_row))
        return [np.stack(col) for col in zip(*per_row)]

    def _page_row(self, pages: list[int]) -> np.ndarray:
        row = np.zeros((self.pages_per_seq,), np.int32)
        row[:len(pages)] = pages
        return row

    def _init_arrays(self, init: SlotInit) -> tuple:
        stop = np.full((MAX_STOP_IDS,), -1, np.int32)
        ids = np.asarray(init.stop_ids, np.int32).reshape(-1)
        if len(ids) > MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_IDS} supported")
        stop[:len(ids)] = ids
        key = np.asarray(init.key_data, np.uint32).reshape(self._key_shape)
        # numpy, not jnp: jit takes host values without a dispatch each.
        return (key, np.float32(init.temperature), np.int32(init.top_k), np.float32(init.top_p),
                np.int32(init.max_new), stop, np.int32(init.num_generated))


class _Spec(NamedTuple):
    """Static (hashable) description of the compiled programs."""

    graphdef: Any
    num_layers: int
    page_size: int
    attend: Callable
    steps_per_call: int
    kv_dtype: Any
    chunk: int  # rows per decode chunk; 0 = no compaction
    state_shardings: Any = None  # DecodeState of NamedShardings (TP layout), None = one device
    one_chunk: bool = False  # a row bucket's program: exactly one chunk, no loop
    vocab_size: int = 0  # the logits' width (sizes _call_noise)
    row_kernel_rows: int = 0  # decode weight products of at most this many rows run the native kernel
    row_kernel_min_weights: int = 0  # ... of weights of at least this many elements
    longest_prompt: int = 0  # the largest prefill bucket: packed prefill attends in windows of it
    native_argmax: bool = False  # sampling's argmax on the native kernel (the same index as first_argmax)


def _prefill_impl(spec: _Spec, params, tokens, true_length):
    """One prompt (tokens i32[1, T]): its KV (f[T, Hkv, D] per layer) and last token."""
    k, v = _prefill_rows_impl(spec, params, tokens, jnp.reshape(true_length, (1,)))
    return tuple(x[0] for x in k), tuple(x[0] for x in v), tokens[0, true_length - 1]


def _set_slot(state: DecodeState, slot, page_row, num_cached, last_token,
              key, temperature, top_k, top_p, max_new, stop_ids, num_generated) -> DecodeState:
    """One slot's state (slot a scalar), or several (slot i32[B], every other argument with a leading
    B axis); a slot index >= num_slots (a padding row) writes nothing."""
    def put(x, value):
        return x.at[slot].set(value, mode="drop")
    return state._replace(
        page_table=put(state.page_table, page_row), lengths=put(state.lengths, num_cached),
        last_token=put(state.last_token, last_token), num_generated=put(state.num_generated, num_generated),
        max_new=put(state.max_new, max_new), active=put(state.active, jnp.ones_like(num_cached, bool)),
        keys=put(state.keys, key), temperature=put(state.temperature, temperature), top_k=put(state.top_k, top_k),
        top_p=put(state.top_p, top_p), stop_ids=put(state.stop_ids, stop_ids))


def _prompt_positions(page_size: int, page_rows, lengths, t: int):
    """(page, offset) i32[B, T] where each row's prompt KV goes: row b's first lengths[b] - 1 tokens
    on its pages; padding positions (and the last prompt token, fed by generate) on the null page."""
    pos = jnp.arange(t)[None, :]
    logical = jnp.minimum(pos // page_size, page_rows.shape[1] - 1)
    page = jnp.where(pos < lengths[:, None] - 1, jnp.take_along_axis(page_rows, logical, axis=1), 0)
    return page, jnp.broadcast_to(pos % page_size, page.shape)


def _insert_impl(page_size: int, state, k, v, prompt_len, last_token, slot, page_row, *init):
    page, off = _prompt_positions(page_size, page_row[None], jnp.reshape(prompt_len, (1,)), k[0].shape[0])
    page, off = page[0], off[0]
    state = _scatter_prompt_kv(state, k, v, page, off)
    return _set_slot(state, slot, page_row, prompt_len - 1, last_token, *init)


def _scatter_prompt_kv(state, k, v, page, off):
    """Prompt KV (per layer f[..., T, Hkv, D] in kv_dtype) into the pools at (page, off) i32[..., T]."""
    kp = tuple(scatter_tokens(p, page, off, x, x.dtype, key=True) for p, x in zip(state.k_pages, k))
    vp = tuple(scatter_tokens(p, page, off, x, x.dtype, key=False) for p, x in zip(state.v_pages, v))
    return state._replace(k_pages=kp, v_pages=vp)


def _prefill_rows_impl(spec: _Spec, params, tokens, lengths):
    """KV of every row's ``tokens[b, :lengths[b] - 1]`` (tokens i32[B, T]) in one forward."""
    model = engine_model(spec, params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    backend = functools.partial(prefill_dense, valid_len=lengths - 1)
    _, cache = model.forward_cached(tokens, positions, [None] * spec.num_layers, backend)
    return tuple(c[0].astype(spec.kv_dtype) for c in cache), tuple(c[1].astype(spec.kv_dtype) for c in cache)


def _insert_packed_impl(spec: _Spec, params, state, tokens, positions, segments, page, offset, slots, page_rows,
                        last_token, num_cached, *init):
    """_insert_impl for B prompts packed in one row (Engine._pack: i32[N] each): one forward, each
    token's KV into the pools at (page, offset), then each slot set (padding rows: slot >= num_slots,
    page row of zeros, so no slot changes; padding tokens' KV goes to the null page)."""
    model = engine_model(spec, params)
    backend = functools.partial(prefill_packed, segments=segments, window=spec.longest_prompt)
    _, cache = model.forward_cached(tokens[None], positions[None], [None] * spec.num_layers, backend)
    k = tuple(c[0][0].astype(spec.kv_dtype) for c in cache)
    v = tuple(c[1][0].astype(spec.kv_dtype) for c in cache)
    state = _scatter_prompt_kv(state, k, v, page, offset)
    return _set_slot(state, slots, page_rows, num_cached, last_token, *init)


def _share_prompt_impl(state, src, dst, slot, page_row, num_cached, last_token, *init):
    """Copy pages src[i] -> dst[i] in every layer's K and V pools, then set the slot."""
    kp = tuple(p.at[dst].set(p[src]) for p in state.k_pages)
    vp = tuple(p.at[dst].set(p[src]) for p in state.v_pages)
    return _set_slot(state._replace(k_pages=kp, v_pages=vp), slot, page_row, num_cached, last_token, *init)


def _deactivate_impl(state, slot):
    return state._replace(active=state.active.at[slot].set(False))


def _read_pages_impl(state, page_row):
    """The pages of page_row in every layer, f[L, n, page, Hkv, D] each (the pool layouts undone)."""
    return (from_pool(jnp.stack([p[page_row] for p in state.k_pages]), key=True),
            from_pool(jnp.stack([p[page_row] for p in state.v_pages]), key=False))


def _write_slot_impl(state, k, v, dst, slot, page_row, num_cached, last_token, *init):
    kp = tuple(scatter_pages(p, dst, to_pool(x, key=True), x.dtype) for p, x in zip(state.k_pages, k))  # kv_dtype
    vp = tuple(scatter_pages(p, dst, to_pool(x, key=False), x.dtype) for p, x in zip(state.v_pages, v))
    state = state._replace(k_pages=kp, v_pages=vp)
    return _set_slot(state, slot, page_row, num_cached, last_token, *init)


def _step(spec: _Spec, model, state: DecodeState, live_bucket: int,
          noise: Optional[jax.Array] = None) -> tuple[DecodeState, StepOutput]:
    """One token for every active slot: feed last_token at position lengths, sample, retire finished slots.

    ``noise``: f32[S, V], this step's Gumbel draws (``_call_noise``); None draws them here.
    """
    meta = DecodeMeta(state.page_table, state.lengths, state.active, spec.page_size, kv_dtype=spec.kv_dtype)
    overflow = jnp.zeros((), bool)
    if live_bucket:
        meta = meta._replace(live=live_page_list(meta, live_bucket))
        overflow = meta.live.count > live_bucket
    backend = functools.partial(spec.attend, meta=meta)
    cache = list(zip(state.k_pages, state.v_pages))
    logits, new_cache = model.forward_cached(state.last_token[:, None], state.lengths[:, None], cache, backend)
    keys = None if noise is not None else token_keys(state.keys, state.num_generated)
    argmax = native_ops.first_argmax if spec.native_argmax else first_argmax
    tok, lp = sample_tokens(logits[:, 0], keys, state.temperature, state.top_k, state.top_p, noise, argmax)
    emitted = state.active
    stopped = emitted & jnp.any(tok[:, None] == state.stop_ids, axis=-1)
    n_gen = state.num_generated + emitted.astype(jnp.int32)
    done = emitted & (stopped | (n_gen >= state.max_new))
    state = state._replace(
        k_pages=tuple(c[0] for c in new_cache), v_pages=tuple(c[1] for c in new_cache),
        lengths=state.lengths + emitted.astype(jnp.int32),
        last_token=jnp.where(emitted, tok, state.last_token),
        num_generated=n_gen, active=state.active & ~done)
    return state, StepOutput(tok, lp, emitted, done, stopped, overflow)


# Per-slot fields _step changes (the rest of a slot's state is read-only during decode).
_STEPPED = ("lengths", "last_token", "num_generated", "active")
_PER_SLOT = _STEPPED + ("page_table", "max_new", "keys", "temperature", "top_k", "top_p", "stop_ids")


def _chunked_step(spec: _Spec, model, state: DecodeState, rows, n_chunks, live_bucket: int):
    """_step over the slots ``rows`` (i32[R], R a multiple of spec.chunk; entries >= num_slots are
    padding), one chunk of spec.chunk rows at a time, for the first ``n_chunks`` chunks (traced).

    Each chunk gathers its slots' state into a batch of spec.chunk rows (padding rows inactive:
    their KV writes go to the null page), runs _step, and scatters the results back (padding rows
    dropped). Chunks hold distinct slots, so their order does not matter; every chunk is the
    same program on the same shapes, so a row's result does not depend on the other rows.
    """
    c = spec.chunk
    s = state.lengths.shape[0]

    def body(i, carry):
        state, out = carry
        r = jax.lax.dynamic_slice_in_dim(rows, i * c, c)  # i32[c]
        safe = jnp.minimum(r, s - 1)
        sub = state._replace(**{f: getattr(state, f)[safe] for f in _PER_SLOT})
        sub, o = _step(spec, model, sub._replace(active=sub.active & (r < s)), live_bucket)
        state = state._replace(k_pages=sub.k_pages, v_pages=sub.v_pages,
                               **{f: getattr(state, f).at[r].set(getattr(sub, f), mode="drop") for f in _STEPPED})
        out = StepOutput(*(x.at[r].set(y, mode="drop") for x, y in zip(out[:-1], o[:-1])), out.overflow | o.overflow)
        return state, out

    zeros = StepOutput(jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.float32), jnp.zeros((s,), bool),
                       jnp.zeros((s,), bool), jnp.zeros((s,), bool), jnp.zeros((), bool))
    if spec.one_chunk:  # straight-line code: XLA:CPU runs bf16 products inside a loop body ~2x slower
        return body(0, (state, zeros))
    return jax.lax.fori_loop(0, n_chunks, body, (state, zeros))


# Largest f32[steps, slots, vocab] of Gumbel draws a generate call makes up front (_call_noise).
_CALL_NOISE_BYTES = 32 << 20


def _call_noise(spec: _Spec, state: DecodeState) -> Optional[jax.Array]:
    """f32[steps, S, V]: every Gumbel draw a multi-step call can use, drawn before its first step; or None.

    Why: drawn inside the scan, each step runs threefry's loop twice (the key's fold_in and the
    bits, ~160 small ops beside the demo model's ~146 fusions) over a handful of rows; drawing
    them once per call took 13-18% off the CPU of a call of the demo's engine (docs/BENCHMARKS.md).
    A slot active at step t of the call has generated num_generated + t tokens before it
    (admission happens between calls), so its key there is fold_in(key_s, num_generated + t): the
    same draw as in-step, since threefry is elementwise in the keys. Rows that are inactive at a
    step ignore theirs. Calls whose draws would exceed _CALL_NOISE_BYTES (large vocabularies) and
    all-greedy batches draw in-step as before (the latter draw nothing).
    """
    k, s = spec.steps_per_call, state.lengths.shape[0]
    vocab = spec.vocab_size
    if spec.chunk or not 0 < k * s * vocab * 4 <= _CALL_NOISE_BYTES:
        return None
    counts = state.num_generated[None, :] + jnp.arange(k, dtype=state.num_generated.dtype)[:, None]  # [k, S]
    keys = token_keys(state.keys, counts)
    return jax.lax.cond(jnp.any(state.temperature > 0.0), lambda: gumbel_noise(keys, vocab),
                        lambda: jnp.zeros((k, s, vocab), jnp.float32))


def _generate_impl(spec: _Spec, params, state, rows, n_chunks, live_bucket: int):
    model = engine_model(spec, params)
    if spec.chunk:
        step = lambda s, _: _chunked_step(spec, model, s, rows, n_chunks, live_bucket)  # noqa: E731
    else:
        step = lambda s, noise: _step(spec, model, s, live_bucket, noise)  # noqa: E731
    if spec.steps_per_call == 1:
        state, out = step(state, None)
        return tpl.constrain(state, spec.state_shardings), jax.tree.map(lambda x: x[None], out)
    state, out = jax.lax.scan(step, state, _call_noise(spec, state), length=spec.steps_per_call)
    return tpl.constrain(state, spec.state_shardings), out


class _Programs(NamedTuple):
    prefill: Callable  # (param leaves, tokens i32[1, T], true_length) -> (k, v, last_token)
    prefill_insert: Callable  # (leaves, state, tokens, true_length, slot, page_row, *init) -> state; state donated
    generate: Callable  # (leaves, state, rows, n_chunks, live bucket: static) -> (state, StepOutput); state donated
    prefill_insert_rows: Callable  # (leaves, state, Engine._pack's 5 i32[N], slots, page rows, last, cached, *init) -> state


@functools.lru_cache(maxsize=32)
def _programs(spec: _Spec, params_treedef) -> _Programs:
    """Jitted programs for one (model graph, engine geometry, params structure); shared by equal engines."""
    def unflatten(leaves):
        return jax.tree.unflatten(params_treedef, leaves)

    return _Programs(
        prefill=jax.jit(lambda leaves, tokens, n: _prefill_impl(spec, unflatten(leaves), tokens, n)),
        prefill_insert=jax.jit(lambda leaves, state, tokens, n, slot, row, *init: tpl.constrain(_insert_impl(
            spec.page_size, state, *_prefill_impl(spec, unflatten(leaves), tokens, n)[:2], n,
            tokens[0, n - 1], slot, row, *init), spec.state_shardings), donate_argnums=(1,)),
        generate=jax.jit(lambda leaves, state, rows, n, bucket: _generate_impl(spec, unflatten(leaves), state, rows, n,
                                                                               bucket),
                         static_argnums=(4,), donate_argnums=(1,)),
        prefill_insert_rows=jax.jit(lambda leaves, state, *args: tpl.constrain(
            _insert_packed_impl(spec, unflatten(leaves), state, *args), spec.state_shardings), donate_argnums=(1,)))


def _live_buckets(max_entries: int, policy: str = "fine", smallest: int = 16, halves_from: int = 64) -> tuple[int, ...]:
    """Live-page buckets, capped by (and ending at) max_entries.

    'fine': powers of two from ``smallest``, plus 1.5x midpoints from ``halves_from`` up (96, 192, 384, ...).
    'pow2': powers of two from ``smallest``. 'pow4': powers of four from ``smallest``.

    Attention work follows the bucket, not the live count: with powers of two alone a typical
    engine run attended ~1.45x the live pages (measured on the engine bench); the midpoints cut
    that to ~1.2x for a few more compiled programs (only where a bucket is large enough to matter).
    Every bucket is one compiled generate() program, so the coarser policies trade attention
    padding for compile time.
    """
    growth = {"fine": 2, "pow2": 2, "pow4": 4}[policy]
    out, b = [], smallest
    while b < max_entries:
        out.append(b)
        if policy == "fine" and b >= halves_from and b + b // 2 < max_entries:
            out.append(b + b // 2)
        b *= growth
    return tuple(out) + (max_entries,)


def _packed_widths(smallest: int, window: int, rows: int) -> tuple[int, ...]:
    """Packed prefill widths for calls of up to ``rows`` prompts of at most ``window`` tokens: powers
    of two from ``smallest`` up to the window, then every multiple of it up to rows x window (none
    for rows = 1). A call pads to the next width, so above the window it wastes less than one
    prompt's worth: powers of two alone padded the first admissions of 32 prompts of 8-31 tokens
    (4 calls of 124-154 tokens) to 704 tokens, multiples of 32 pad them to 608."""
    if rows < 2:
        return ()
    out, b = [], smallest
    while b < window:
        out.append(b)
        b *= 2
    return tuple(out) + tuple(window * i for i in range(1, rows + 1))


_insert_jit = jax.jit(_insert_impl, static_argnums=(0,), donate_argnums=(1,))
_deactivate_jit = jax.jit(_deactivate_impl, donate_argnums=(0,))
_read_pages_jit = jax.jit(_read_pages_impl)
_write_slot_jit = jax.jit(_write_slot_impl, donate_argnums=(0,))
_share_prompt_jit = jax.jit(_share_prompt_impl, donate_argnums=(0,))
_attach_jit = jax.jit(lambda state, slot, *rest: _deactivate_impl(_set_slot(state, slot, *rest), slot),
                      donate_argnums=(0,))


def make_engine(model: nnx.Module, section: RolloutSection, **kwargs) -> tuple[Engine, Any]:
    """(engine, params) for a Transformer; params is the pytree every engine call takes, in the
    serving dtype ``section.dtype`` (None: the model's own).

    With ``mesh=`` (a Mesh with a 'tensor' axis, see rollout/tp.py) the params come back placed
    in the engine's tensor-parallel layout on that mesh's devices. An abstract model (leaves
    jax.ShapeDtypeStruct, model.sharded.abstract_model) gives its abstract params back: servers
    build engines from shapes and place only the version they pull.
    """
    graphdef, params = nnx.split(model)
    if section.dtype is not None:  # the serving dtype (the engine computes in the model's dtype either way)
        params = cast_floating(params, section.dtype)
    engine = Engine(graphdef, model.cfg, section, kv_dtype=getattr(model, "dtype", jnp.float32), **kwargs)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return engine, params  # an abstract model (nnx.eval_shape): the caller places the weights it pulls
    return engine, (params if engine.mesh is None else engine.place_params(params))


__all__ = ["Engine", "make_engine", "OutOfPages", "MAX_STOP_IDS"]
