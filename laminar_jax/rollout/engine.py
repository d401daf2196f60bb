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

Kernels: the engine runs one ``DecodeKernels`` (rollout/kernels.py: decode attention, weight
products, argmax), chosen once from the section, the platform, the geometry and the mesh (or passed
in), logged, and put in the programs' static spec (rollout/programs.py); the model gets its weight
products through each forward_cached call. The decode schedule (rollout/schedule.py: tokens per
call, compaction chunks, row buckets, live-page buckets) is one frozen object; warm-up is
rollout/warmup.py. Prefill computes the KV of ``prompt[:-1]``; the last prompt token is fed
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

import logging
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import PartitionSpec as P

from laminar_jax.model.arch import TransformerConfig
from laminar_jax.model.hf import is_stacked
from laminar_jax.model.precision import cast_floating
from laminar_jax.naming import path_name
from laminar_jax.rollout import programs as prg
from laminar_jax.rollout import tp as tpl
from laminar_jax.rollout.attention import pool_shape, storage_dtype
from laminar_jax.rollout.config import RolloutSection
from laminar_jax.rollout.kernels import DecodeKernels, Geometry, choose_decode_kernels
from laminar_jax.rollout.layered import refill_stacked
from laminar_jax.rollout.lora_merge import LoraDelta, layer_merger, merge_whole
from laminar_jax.rollout.paged import (
    DecodeState,
    OutOfPages,
    PageAllocator,
    Prefix,
    SlotInit,
    StepOutput,
    pages_needed,
)
from laminar_jax.rollout.schedule import DecodeSchedule
from laminar_jax.rollout.slot_inputs import MAX_STOP_IDS, init_arrays, init_columns, pack_prompts, page_row

_log = logging.getLogger(__name__)



class Engine:
    """Paged-KV decode engine for one model graph. Not thread-safe: one owner calls it."""

    def __init__(self, graphdef: Any, model_cfg: TransformerConfig, section: RolloutSection,
                 kv_dtype: Any = jnp.float32, attention_backends: Optional[dict] = None, mesh: Any = None,
                 kernels: Optional[DecodeKernels] = None):
        """``kernels``: the decode kernels to run (rollout/kernels.py); None chooses them from the
        section's attention_impl and weight_products for this engine's platform, geometry and mesh
        (``attention_backends``: extra decode attentions {name: fn} the section may name)."""
        section.validate_with_backends("rollout", tuple(attention_backends or ()))
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
        self.tp = 1 if mesh is None else tpl.tp_width(mesh)
        if mesh is not None:
            tpl.check_tp(model_cfg, self.tp)
        platform = self.devices[0].platform
        self.kernels = kernels or choose_decode_kernels(
            section.attention_impl, section.weight_products, platform=platform,
            geometry=Geometry(model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, self.page_size,
                              jnp.dtype(kv_dtype), self.tp, self.pages_per_seq),
            largest_weight=model_cfg.largest_weight(), extra_attention=attention_backends)
        if mesh is not None:  # a kernel XLA cannot partition runs once per shard (rollout/kernels.py)
            self.kernels = self.kernels.over_mesh(mesh, tpl.TP_AXIS)
        self.pool_layout = self.kernels.pool_layout  # the KV pools' layout: the one its attention reads
        self.schedule = DecodeSchedule.of(section, platform, self.kernels.needs_live_pages)
        _log.info("engine %s on %s: decode kernels %s, %d steps per call%s", section.server_id, platform,
                  self.kernels.summary(), self.schedule.steps_per_call,
                  f" (fallback: {self.kernels.reason})" if self.kernels.reason else "")
        self._cached_hi: dict[int, int] = {}  # slot -> upper bound of the device's lengths[slot]
        self._key_shape = jax.random.key_data(jax.random.key(0)).shape
        self.state_shardings = None if mesh is None else self._state_shardings(mesh)
        self._param_shardings: tuple = (None, None)  # (params treedef, [NamedSharding per leaf])
        # Hashable and equal for equal configs, so engines of the same model shape share compiled code.
        self._spec = prg.Spec(graphdef, model_cfg.num_layers, self.page_size, self.kernels,
                              self.schedule.steps_per_call, jnp.dtype(kv_dtype), self.schedule.chunk,
                              self.state_shardings, vocab_size=model_cfg.vocab_size, longest_prompt=self.buckets[-1],
                              layer_pages=section.num_pages)
        self._pools = prg.pool_geom(self._spec)  # the page copies' static view of the one K and V pool
        self._params_cache: tuple = (None, None, None, None)  # (params, leaves, programs, per row bucket) last seen

    @property
    def attention_impl(self) -> str:
        """The decode attention this engine runs (rollout.attention_impl resolved)."""
        return self.kernels.attention

    @property
    def steps_per_call(self) -> int:
        return self.schedule.steps_per_call

    @property
    def live_buckets(self) -> tuple[int, ...]:
        return self.schedule.live_buckets

    @property
    def packed_widths(self) -> tuple[int, ...]:
        return self.schedule.packed_widths

    def _bind(self, params) -> tuple[list, prg.Programs]:
        """Flattened params and the programs for their tree structure.

        Flattening an nnx.State (and hashing the graphdef for a jit cache lookup) costs
        milliseconds, so it happens once per params object, not once per call.
        """
        if self._params_cache[0] is not params:
            leaves, treedef = jax.tree.flatten(params)
            if self.mesh is not None:  # a no-op for params already in this engine's layout (place_params)
                leaves = tpl.place_leaves(leaves, self.param_shardings(params))
            self._params_cache = (params, leaves, prg.programs(self._spec, treedef),
                                  {b: prg.programs(self._spec._replace(chunk=b, one_chunk=True), treedef)
                                   for b in self.schedule.row_buckets})
        return self._params_cache[1], self._params_cache[2]

    def _generate_program(self, rows_per_call: int) -> Callable:
        """The generate program for a call of ``rows_per_call`` rows (the engine's own, or a row bucket's)."""
        return self._params_cache[3][rows_per_call].generate if rows_per_call in self.schedule.row_buckets \
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

    def swap_params(self, old, host, on_leaf: Optional[Callable[[int, jax.Array], None]] = None,
                    lora: Optional[LoraDelta] = None):
        """The weights ``old`` replaced by the host tree ``host`` (same structure) one tensor at a
        time: each old buffer is deleted before its replacement is placed, so the devices hold one
        version plus one tensor at any moment, never two versions. The caller owns ``old`` (no other
        server runs on those buffers) and has no program in flight on them. on_leaf(i, placed) is
        called after each placement (tests measure the devices' live bytes there). ``lora``: ``host``
        is the pristine base and these adapters are merged into it layer by layer; leaves they do
        not target are kept in place (rollout/lora_merge.py)."""
        old_leaves = jax.tree.leaves(old)
        host_leaves, treedef = jax.tree.flatten(host)
        if len(old_leaves) != len(host_leaves):
            raise ValueError(f"swap_params: {len(host_leaves)} new tensors for {len(old_leaves)} old ones")
        cached = self._params_cache[1] if self._params_cache[0] is old else None  # _bind's resharded copies
        self._params_cache = (None, None, None, None)
        shardings = self.param_shardings(host) if self.mesh is not None else None
        stacked = [is_stacked(tuple(getattr(k, "key", getattr(k, "name", k)) for k in p[:1]))
                   for p, _ in jax.tree_util.tree_flatten_with_path(host)[0]]
        names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(host)[0]] if lora else []
        put = (lambda x: jax.device_put(x, self.devices[0])) if self.mesh is None else \
            (lambda x: jax.device_put(x, jax.sharding.NamedSharding(self.mesh, P())))  # adapters: replicated
        new = []
        for i, (o, h) in enumerate(zip(old_leaves, host_leaves)):
            merge = lora is not None and names[i] in lora.pairs
            if lora is not None and not merge and _refillable(o, h):  # the base, unchanged by any adapter
                new.append(o)
                continue
            in_place = stacked[i] and _refillable(o, h)  # the layer stack: refilled a layer at a time
            for x in ([] if in_place else [o]) + ([] if cached is None or cached[i] is o else [cached[i]]):
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
            if in_place:
                layer = None if shardings is None else jax.sharding.NamedSharding(self.mesh, P(*o.sharding.spec[1:]))
                new.append(refill_stacked(o, h, lambda x: jax.device_put(x, self.devices[0]) if layer is None
                                          else tpl.place_leaf(x, layer),
                                          layer_merger(lora, names[i], put) if merge else None))
            else:
                new.append(jax.device_put(h, self.devices[0]) if shardings is None
                           else tpl.place_leaf(h, shardings[i]))
                if merge:
                    new[-1] = merge_whole(new[-1], lora, names[i], put)
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
        kv = tpl.pool_sharding(mesh, self.pool_layout)  # one pool of every layer's pages (rollout/layered.py)
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
        store = storage_dtype(self.kv_dtype, self.pool_layout)  # CPU bf16 pools live as uint16 bits (see storage_dtype)

        def zeros(key):  # every layer's pages in one pool, layer l's from l * num_pages (rollout/layered.py)
            shape = pool_shape(self.section.num_pages * c.num_layers, self.page_size, c.num_kv_heads, c.head_dim,
                               key=key, layout=self.pool_layout)
            return jnp.zeros(shape, store)
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
        return self._settle(prg.insert_jit(self._spec.page_size, self._pools, decode_state, prefix.k, prefix.v, np.int32(prompt_len),
                                        prefix.last_token, np.int32(slot), page_row(self.pages_per_seq, pages),
                                        *init_arrays(self._key_shape, init)))

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
        return progs.prefill_insert(leaves, decode_state, padded, np.int32(n), np.int32(slot),
                                    page_row(self.pages_per_seq, pages),
                                    *init_arrays(self._key_shape, init))

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
        return progs.prefill_insert_rows(leaves, decode_state, *pack_prompts(self.page_size, ids, taken, width),
                                         slot_ids, rows, last,
                                         cached, *init_columns(self._key_shape, inits, b))

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
        return self._settle(prg.share_prompt_jit(self._pools, decode_state, src.reshape(-1), dst.reshape(-1), slot_ids, rows,
                                              cached, last, *init_columns(self._key_shape, inits, b)))

    def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, StepOutput]:
        """Advance every active slot by ``steps_per_call`` tokens (one jitted call, state donated):
        sampling and stop checks run on the device, the host reads the call's tokens once."""
        leaves, _ = self._bind(params)
        rows, n_chunks = self._rows()
        bucket = self.live_bucket()
        for slot in self._cached_hi:
            self._cached_hi[slot] += self.schedule.steps_per_call
        # len(rows) names the program: row buckets are smaller than the engine's own call (validated).
        return self._generate_program(len(rows))(leaves, decode_state, rows, n_chunks, bucket)

    def _rows(self) -> tuple[np.ndarray, np.int32]:
        return self.schedule.rows(list(self._cached_hi))

    def live_bucket(self) -> int:
        """Static live-page count the next generate() compiles for (DecodeSchedule.live_bucket)."""
        return self.schedule.live_bucket(self._cached_hi, self.slot_pages)

    def live_pages_bound(self) -> int:
        """Upper bound on the KV pages one chunk of the next generate() call attends (summed over its slots)."""
        return self.schedule.live_pages_bound(self._cached_hi, self.slot_pages)

    def warmup(self, params: Any) -> None:
        """Compile every program the server runs now (rollout/warmup.py), on a throwaway state."""
        from laminar_jax.rollout.warmup import warmup

        warmup(self, params)

    def free_resource(self, slot: int) -> None:
        """Return the slot's pages to the pool. The device must already have it inactive (finished, or deactivate())."""
        self.allocator.free(self.slot_pages.pop(slot))
        self._cached_hi.pop(slot, None)

    def deactivate(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stop a live slot on the device (before export or abort)."""
        return self._settle(prg.deactivate_jit(decode_state, np.int32(slot)))

    # ---------------------------------------------------------------- export / import

    def read_slot(self, decode_state: DecodeState, slot: int, num_cached: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the slot's first ceil(num_cached/page) pages: (k, v) f[L, n, page, Hkv, D]."""
        n = pages_needed(num_cached, self.page_size)
        row = page_row(self.pages_per_seq, self.slot_pages[slot])
        k, v = jax.device_get(prg.read_pages_jit(self._pools, decode_state, row))
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
        row = page_row(self.pages_per_seq, pages)
        dst = np.where(np.arange(self.pages_per_seq) < n, row, 0).astype(np.int32)
        if self.mesh is None:
            kd, vd = (jnp.asarray(np.pad(x, pad)).astype(self.kv_dtype) for x in (k, v))
        else:  # each device receives only its KV heads of the imported pages
            kd, vd = (tpl.place_leaf(np.pad(np.asarray(x).astype(self.kv_dtype), pad), tpl.kv_sharding(self.mesh, 5))
                      for x in (k, v))
        return self._settle(prg.write_slot_jit(self._pools, decode_state, kd, vd, dst, np.int32(slot), row, np.int32(num_cached),
                                            np.int32(last_token), *init_arrays(self._key_shape, init)))

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
        return prg.deactivate_jit(decode_state, np.int32(slot)), self.slot_pages.pop(slot)

    def attach(self, decode_state: DecodeState, slot: int, pages: list[int], num_cached: int, last_token: int,
               init: SlotInit) -> DecodeState:
        """Give detached pages a free slot again, with the sequence's sampling state; the slot stays
        inactive (extend() feeds the observation and activates it)."""
        if slot in self.slot_pages:
            raise ValueError(f"slot {slot} is occupied")
        self.slot_pages[slot] = list(pages)
        return prg.attach_jit(decode_state, np.int32(slot), page_row(self.pages_per_seq, pages), np.int32(num_cached),
                           np.int32(last_token), *init_arrays(self._key_shape, init))

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
        program = ext.extend_program(self._spec, treedef, self.pages_per_seq if self.schedule.uses_live_pages else 0)
        return self._settle(program(leaves, decode_state, np.int32(slot), page_row(self.pages_per_seq, have), ids,
                                    np.int32(m),
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
            rows[i], slot_ids[i] = page_row(self.pages_per_seq, pages), slot
            self.slot_pages[slot] = pages
            self._cached_hi[slot] = len(x) - 1
        return rows, slot_ids


def _refillable(old: Any, host: Any) -> bool:
    """Whether a swap can write ``host`` into ``old``'s buffer in place (same shape and dtype, live)."""
    return (isinstance(old, jax.Array) and not old.is_deleted() and old.ndim >= 1
            and tuple(np.shape(host)) == old.shape and np.dtype(getattr(host, "dtype", None)) == old.dtype)


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
