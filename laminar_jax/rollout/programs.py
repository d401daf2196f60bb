"""The engine's compiled programs: pure functions of a static spec, the params and the decode state.

``Spec`` describes one engine geometry (hashable, so equal engines share compiled code); it carries
the engine's kernels (rollout/kernels.py: decode attention, weight products, argmax), which the
programs pass to the model's cached forward explicitly. ``programs(spec, treedef)`` jits prefill,
prefill_insert, generate and packed prefill for a params structure (``Bound``: those programs with
the params' leaves, as an engine hands them out); the page copies (insert,
export/import, shared prompts) are jitted once here for every engine.

generate() runs ``spec.steps_per_call`` decode steps in one device call (a lax.scan): sampling and
the stop checks (stop ids, token budget) run on the device inside every step, so the host reads
the call's tokens once per k steps.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from laminar_jax.rollout import tp as tpl
from laminar_jax.rollout.attention import (
    DecodeMeta,
    from_pool,
    live_page_list,
    prefill_dense,
    prefill_packed,
    copy_pages,
    scatter_pages,
    scatter_tokens,
    take_pages,
    to_pool,
)
from laminar_jax.rollout.kernels import DecodeKernels
from laminar_jax.rollout.layered import PoolGeom, every_layer, kv_buffer_backend, layered_backend
from laminar_jax.rollout.paged import DecodeState, StepOutput
from laminar_jax.rollout.sampling import gumbel_noise, sample_tokens, token_keys


class Spec(NamedTuple):
    """Static (hashable) description of the compiled programs."""

    graphdef: Any
    num_layers: int
    page_size: int
    kernels: DecodeKernels  # decode attention, weight products, argmax (rollout/kernels.py)
    steps_per_call: int
    kv_dtype: Any
    chunk: int  # rows per decode chunk; 0 = no compaction
    state_shardings: Any = None  # DecodeState of NamedShardings (TP layout), None = one device
    one_chunk: bool = False  # a row bucket's program: exactly one chunk, no loop
    vocab_size: int = 0  # the logits' width (sizes call_noise)
    longest_prompt: int = 0  # the largest prefill bucket: packed prefill attends in windows of it
    layer_pages: int = 0  # pages per layer in the one pool of all layers (rollout/layered.py)


def pool_geom(spec: Spec) -> PoolGeom:
    """The spec's pools: its kernels' layout, every layer's pages, ``layer_pages`` each."""
    return PoolGeom(spec.kernels.pool_layout, spec.num_layers, spec.layer_pages)


def engine_model(spec: Spec, params):
    """The model an engine program (generate, extend, prefill) runs: merged from params. Its weight
    products run as ``spec.kernels.products`` says, passed to each forward_cached call."""
    return nnx.merge(spec.graphdef, params)


def _prefill_impl(spec: Spec, params, tokens, true_length):
    """One prompt (tokens i32[1, T]): its KV (f[L, T, Hkv, D] each) and last token."""
    k, v = _prefill_rows_impl(spec, params, tokens, jnp.reshape(true_length, (1,)))
    return k[:, 0], v[:, 0], tokens[0, true_length - 1]


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


def _insert_impl(page_size: int, pools: PoolGeom, state, k, v, prompt_len, last_token, slot, page_row, *init):
    """A prompt's KV (f[L, T, Hkv, D] each) into the slot's pages of every layer, then set the slot."""
    page, off = _prompt_positions(page_size, page_row[None], jnp.reshape(prompt_len, (1,)), k.shape[1])
    state = _scatter_prompt_kv(pools, state, k, v, page[0], off[0])
    return _set_slot(state, slot, page_row, prompt_len - 1, last_token, *init)


def _scatter_prompt_kv(pools: PoolGeom, state, k, v, page, off):
    """Prompt KV (f[L, ..., T, Hkv, D] in kv_dtype) into the pools at one layer's (page, off) i32[..., T]."""
    pages = every_layer(page, pools.num_layers, pools.layer_pages)
    off = jnp.broadcast_to(off, pages.shape)
    return state._replace(
        k_pages=scatter_tokens(state.k_pages, pages, off, k, k.dtype, key=True, layout=pools.layout),
        v_pages=scatter_tokens(state.v_pages, pages, off, v, v.dtype, key=False, layout=pools.layout))


def _prefill_kv(spec: Spec, model, tokens, positions, prefill):
    """Every layer's k/v (f[L, B, T, Hkv, D] each, kv_dtype) of one forward through ``prefill``."""
    c = model.cfg
    shape = (spec.num_layers, *tokens.shape, c.num_kv_heads, c.head_dim)
    buffers = (jnp.zeros(shape, spec.kv_dtype), jnp.zeros(shape, spec.kv_dtype))
    _, (k, v) = model.forward_cached(tokens, positions, buffers, kv_buffer_backend(prefill, spec.kv_dtype),
                                     spec.kernels.products)
    return k, v


def _prefill_rows_impl(spec: Spec, params, tokens, lengths):
    """KV of every row's ``tokens[b, :lengths[b] - 1]`` (tokens i32[B, T]) in one forward: f[L, B, T, Hkv, D] each."""
    model = engine_model(spec, params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    return _prefill_kv(spec, model, tokens, positions, functools.partial(prefill_dense, valid_len=lengths - 1))


def _insert_packed_impl(spec: Spec, params, state, tokens, positions, segments, page, offset, slots, page_rows,
                        last_token, num_cached, *init):
    """_insert_impl for B prompts packed in one row (slot_inputs.pack_prompts: i32[N] each): one forward, each
    token's KV into the pools at (page, offset), then each slot set (padding rows: slot >= num_slots,
    page row of zeros, so no slot changes; padding tokens' KV goes to the null page)."""
    model = engine_model(spec, params)
    backend = functools.partial(prefill_packed, segments=segments, window=spec.longest_prompt)
    k, v = _prefill_kv(spec, model, tokens[None], positions[None], backend)
    state = _scatter_prompt_kv(pool_geom(spec), state, k[:, 0], v[:, 0], page, offset)
    return _set_slot(state, slots, page_rows, num_cached, last_token, *init)


def _share_prompt_impl(pools: PoolGeom, state, src, dst, slot, page_row, num_cached, last_token, *init):
    """Copy pages src[i] -> dst[i] of every layer in the K and V pools, then set the slot."""
    src, dst = (every_layer(x, pools.num_layers, pools.layer_pages).reshape(-1) for x in (src, dst))
    kp = copy_pages(state.k_pages, src, dst, key=True, layout=pools.layout)
    vp = copy_pages(state.v_pages, src, dst, key=False, layout=pools.layout)
    return _set_slot(state._replace(k_pages=kp, v_pages=vp), slot, page_row, num_cached, last_token, *init)


def _deactivate_impl(state, slot):
    return state._replace(active=state.active.at[slot].set(False))


def _read_pages_impl(pools: PoolGeom, state, page_row):
    """The pages of page_row in every layer, f[L, n, page, Hkv, D] each (the wire layout, whatever the
    pools' layout), still stored (the caller views the bits as the KV dtype)."""
    idx = every_layer(page_row, pools.num_layers, pools.layer_pages).reshape(-1)

    def read(pool, key):
        x = from_pool(take_pages(pool, idx, key=key, layout=pools.layout), key=key, layout=pools.layout)
        return x.reshape(pools.num_layers, -1, *x.shape[1:])
    return read(state.k_pages, True), read(state.v_pages, False)


def _write_slot_impl(pools: PoolGeom, state, k, v, dst, slot, page_row, num_cached, last_token, *init):
    """Pages k, v (f[L, n, page, Hkv, D] in the KV dtype: the wire layout) into pages dst of every layer."""
    idx = every_layer(dst, pools.num_layers, pools.layer_pages).reshape(-1)

    def write(pool, x, key):
        x = to_pool(x.reshape(-1, *x.shape[2:]), key=key, layout=pools.layout)
        return scatter_pages(pool, idx, x, k.dtype, key=key, layout=pools.layout)
    state = state._replace(k_pages=write(state.k_pages, k, True), v_pages=write(state.v_pages, v, False))
    return _set_slot(state, slot, page_row, num_cached, last_token, *init)


def _step(spec: Spec, model, state: DecodeState, live_bucket: int,
          noise: Optional[jax.Array] = None) -> tuple[DecodeState, StepOutput]:
    """One token for every active slot: feed last_token at position lengths, sample, retire finished slots.

    ``noise``: f32[S, V], this step's Gumbel draws (``call_noise``); None draws them here.
    """
    meta = DecodeMeta(state.page_table, state.lengths, state.active, spec.page_size, kv_dtype=spec.kv_dtype)
    overflow = jnp.zeros((), bool)
    if live_bucket:
        meta = meta._replace(live=live_page_list(meta, live_bucket))
        overflow = meta.live.count > live_bucket
    backend = layered_backend(spec.kernels.attend, meta, spec.layer_pages)
    logits, (k_pages, v_pages) = model.forward_cached(state.last_token[:, None], state.lengths[:, None],
                                                      (state.k_pages, state.v_pages), backend, spec.kernels.products,
                                                      spec.kernels.unroll_layers)
    keys = None if noise is not None else token_keys(state.keys, state.num_generated)
    tok, lp = sample_tokens(logits[:, 0], keys, state.temperature, state.top_k, state.top_p, noise,
                            spec.kernels.argmax)
    emitted = state.active
    stopped = emitted & jnp.any(tok[:, None] == state.stop_ids, axis=-1)
    n_gen = state.num_generated + emitted.astype(jnp.int32)
    done = emitted & (stopped | (n_gen >= state.max_new))
    state = state._replace(
        k_pages=k_pages, v_pages=v_pages,
        lengths=state.lengths + emitted.astype(jnp.int32),
        last_token=jnp.where(emitted, tok, state.last_token),
        num_generated=n_gen, active=state.active & ~done)
    return state, StepOutput(tok, lp, emitted, done, stopped, overflow)


# Per-slot fields _step changes (the rest of a slot's state is read-only during decode).
_STEPPED = ("lengths", "last_token", "num_generated", "active")
_PER_SLOT = _STEPPED + ("page_table", "max_new", "keys", "temperature", "top_k", "top_p", "stop_ids")


def _chunked_step(spec: Spec, model, state: DecodeState, rows, n_chunks, live_bucket: int):
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


# Largest f32[steps, slots, vocab] of Gumbel draws a generate call makes up front (call_noise).
CALL_NOISE_BYTES = 32 << 20


def call_noise(spec: Spec, state: DecodeState) -> Optional[jax.Array]:
    """f32[steps, S, V]: every Gumbel draw a multi-step call can use, drawn before its first step; or None.

    Why: drawn inside the scan, each step runs threefry's loop twice (the key's fold_in and the
    bits, ~160 small ops beside the demo model's ~146 fusions) over a handful of rows, where a
    small model's step costs its op count; drawn once per call, they are a few ops per call.
    A slot active at step t of the call has generated num_generated + t tokens before it
    (admission happens between calls), so its key there is fold_in(key_s, num_generated + t): the
    same draw as in-step, since threefry is elementwise in the keys. Rows that are inactive at a
    step ignore theirs. Calls whose draws would exceed CALL_NOISE_BYTES (large vocabularies) and
    all-greedy batches draw in-step as before (the latter draw nothing).
    """
    k, s = spec.steps_per_call, state.lengths.shape[0]
    vocab = spec.vocab_size
    if spec.chunk or not 0 < k * s * vocab * 4 <= CALL_NOISE_BYTES:
        return None
    counts = state.num_generated[None, :] + jnp.arange(k, dtype=state.num_generated.dtype)[:, None]  # [k, S]
    keys = token_keys(state.keys, counts)
    return jax.lax.cond(jnp.any(state.temperature > 0.0), lambda: gumbel_noise(keys, vocab),
                        lambda: jnp.zeros((k, s, vocab), jnp.float32))


def _generate_impl(spec: Spec, params, state, rows, n_chunks, live_bucket: int):
    model = engine_model(spec, params)
    if spec.chunk:
        step = lambda s, _: _chunked_step(spec, model, s, rows, n_chunks, live_bucket)  # noqa: E731
    else:
        step = lambda s, noise: _step(spec, model, s, live_bucket, noise)  # noqa: E731
    if spec.steps_per_call == 1:
        state, out = step(state, None)
        return tpl.constrain(state, spec.state_shardings), jax.tree.map(lambda x: x[None], out)
    state, out = jax.lax.scan(step, state, call_noise(spec, state), length=spec.steps_per_call)
    return tpl.constrain(state, spec.state_shardings), out


class Programs(NamedTuple):
    prefill: Callable  # (param leaves, tokens i32[1, T], true_length) -> (k, v, last_token)
    prefill_insert: Callable  # (leaves, state, tokens, true_length, slot, page_row, *init) -> state; state donated
    generate: Callable  # (leaves, state, rows, n_chunks, live bucket: static) -> (state, StepOutput); state donated
    prefill_insert_rows: Callable  # (leaves, state, pack_prompts's 5 i32[N], slots, page rows, last, cached, *init) -> state


class Bound(NamedTuple):
    """Params flattened in an engine's layout and the programs for their tree structure (what
    ``Engine.bound(params)`` returns, once per params object); unpacks as (leaves, programs, row_programs)."""

    leaves: list
    programs: Programs
    row_programs: dict  # row bucket -> the Programs of a call of that many rows (rollout.decode_row_buckets)

    def generate_program(self, rows_per_call: int) -> Callable:
        """The generate program for a call of ``rows_per_call`` rows (a row bucket's, or the engine's own)."""
        small = self.row_programs.get(rows_per_call)
        return (small or self.programs).generate


def settle(spec: Spec, state: DecodeState) -> DecodeState:
    """Keep the state in the spec's layout after a program that does not constrain it (the page
    copies below); free when it already is, and a no-op on one device."""
    return state if spec.state_shardings is None else jax.device_put(state, spec.state_shardings)


@functools.lru_cache(maxsize=32)
def programs(spec: Spec, params_treedef) -> Programs:
    """Jitted programs for one (model graph, engine geometry, params structure); shared by equal engines."""
    def unflatten(leaves):
        return jax.tree.unflatten(params_treedef, leaves)

    return Programs(
        prefill=jax.jit(lambda leaves, tokens, n: _prefill_impl(spec, unflatten(leaves), tokens, n)),
        prefill_insert=jax.jit(lambda leaves, state, tokens, n, slot, row, *init: tpl.constrain(_insert_impl(
            spec.page_size, pool_geom(spec), state, *_prefill_impl(spec, unflatten(leaves), tokens, n)[:2], n,
            tokens[0, n - 1], slot, row, *init), spec.state_shardings), donate_argnums=(1,)),
        generate=jax.jit(lambda leaves, state, rows, n, bucket: _generate_impl(spec, unflatten(leaves), state, rows, n,
                                                                               bucket),
                         static_argnums=(4,), donate_argnums=(1,)),
        prefill_insert_rows=jax.jit(lambda leaves, state, *args: tpl.constrain(
            _insert_packed_impl(spec, unflatten(leaves), state, *args), spec.state_shardings), donate_argnums=(1,)))


# The page copies take the pools' geometry (layout, layers, pages per layer; static) first.
insert_jit = jax.jit(_insert_impl, static_argnums=(0, 1), donate_argnums=(2,))
deactivate_jit = jax.jit(_deactivate_impl, donate_argnums=(0,))
read_pages_jit = jax.jit(_read_pages_impl, static_argnums=(0,))
write_slot_jit = jax.jit(_write_slot_impl, static_argnums=(0,), donate_argnums=(1,))
share_prompt_jit = jax.jit(_share_prompt_impl, static_argnums=(0,), donate_argnums=(1,))
attach_jit = jax.jit(lambda state, slot, *rest: _deactivate_impl(_set_slot(state, slot, *rest), slot),
                     donate_argnums=(0,))


