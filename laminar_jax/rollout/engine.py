"""The engine: JetStream's ``prefill / insert / generate / free`` over a paged KV cache, plus the
export and import of a live sequence's pages (``read_slot`` / ``write_slot``).

Weights are always passed in (``params`` = the nnx.State from ``nnx.split(model)``); only the
graphdef is fixed at construction, so a new weight version is just a different pytree of the same
shapes and needs no recompilation. Device state is a :class:`DecodeState` pytree, donated and
returned by every mutating call. The engine's only host state is its page book
(rollout/page_book.py ``PageBook``, ``engine.page_book``): the page allocator, which pages each
slot owns and an upper bound of each decoding slot's cached length.

Around the contract, each in its own room and each taking the engine:
- the decode schedule (rollout/schedule.py: prompt buckets, tokens per call, compaction chunks,
  row buckets, live-page buckets, packed prefill widths): one frozen ``DecodeSchedule`` the engine
  receives (or derives from its section);
- the weights on the engine's devices (rollout/placement.py: place, swap in place, release);
- batched admission (rollout/batch_admit.py: ``prefill_insert_rows``, ``share_prompt``);
- multi-turn waits (rollout/extend.py: ``park``, ``detach``, ``attach``, ``extend``);
- warm-up (rollout/warmup.py) and the programs themselves (rollout/programs.py), which the rooms
  above run through the engine's public handles: ``bound(params)`` (a ``programs.Bound``: the
  params' leaves in this layout and their programs), ``spec``, ``pools``, ``key_shape``,
  ``page_book`` and ``abstract_state()``.

Compiled programs: one prefill per prompt bucket, one insert per bucket, one generate per
live-page bucket (backends with ``needs_live_pages``; one generate otherwise), plus the
export/import page copies and one shared-prompt copy per padded batch size; with
``rollout.decode_row_buckets`` one generate per row bucket, with ``rollout.prefill_rows`` > 1 one
packed prefill per packed width.

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
products through each forward_cached call. Prefill computes the KV of ``prompt[:-1]``; the last
prompt token is fed by the first generate step, so every sampled token (including the first) goes
through the one sampling path in generate().

Tensor parallelism: ``Engine(..., mesh=...)`` (a Mesh with a 'tensor' axis) runs every program
over that mesh's devices in the Megatron layout of rollout/tp.py: weights split by heads, MLP
columns/rows and vocabulary, KV pages split on the KV-head axis, page table and sampling state
replicated. The calls keep their signatures; params in another layout (or on the host) are
placed once per params object. Export (read_slot) gathers to plain host arrays, so a sequence
moves between engines of any TP width.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from laminar_jax.model.arch import TransformerConfig
from laminar_jax.model.precision import cast_floating
from laminar_jax.rollout import programs as prg
from laminar_jax.rollout import tp as tpl
from laminar_jax.rollout.attention import pool_shape, storage_dtype
from laminar_jax.rollout.config import RolloutSection
from laminar_jax.rollout.kernels import DecodeKernels, Geometry, choose_decode_kernels
from laminar_jax.rollout.page_book import PageBook
from laminar_jax.rollout.paged import DecodeState, OutOfPages, Prefix, SlotInit, StepOutput, pages_needed
from laminar_jax.rollout.placement import ParamPlacement
from laminar_jax.rollout.schedule import DecodeSchedule
from laminar_jax.rollout.slot_inputs import MAX_STOP_IDS, init_arrays, page_row

_log = logging.getLogger(__name__)


class Engine:
    """Paged-KV decode engine for one model graph. Not thread-safe: one owner calls it.

    Public attributes besides the calls: ``page_book`` (the host page book, rollout/page_book.py),
    ``placement`` (the weights on its devices), ``schedule``, ``kernels``, ``spec`` (the programs'
    static spec), ``pools`` (the page copies' view of the K and V pools), ``key_shape`` (a sampling
    key's data shape), ``state_shardings`` (None on one device).
    """

    def __init__(self, graphdef: Any, model_cfg: TransformerConfig, section: RolloutSection,
                 kv_dtype: Any = jnp.float32, attention_backends: Optional[dict] = None, mesh: Any = None,
                 kernels: Optional[DecodeKernels] = None, schedule: Optional[DecodeSchedule] = None):
        """``kernels``: the decode kernels to run (rollout/kernels.py); None chooses them from the
        section's attention_impl and weight_products for this engine's platform, geometry and mesh
        (``attention_backends``: extra decode attentions {name: fn} the section may name).
        ``schedule``: the decode schedule (rollout/schedule.py); None derives it from the section."""
        section.validate_with_backends("rollout", tuple(attention_backends or ()))
        self.graphdef = graphdef
        self.model_cfg = model_cfg
        self.section = section
        self.kv_dtype = kv_dtype
        self.num_slots = section.num_slots
        self.page_size = section.page_size
        self.pages_per_seq = section.pages_per_seq
        # Tensor parallelism (rollout/tp.py): mesh=None keeps everything on the default device.
        self.mesh = mesh
        self.placement = ParamPlacement(mesh)  # the weights on this engine's devices (rollout/placement.py)
        self.devices = self.placement.devices  # where its weights and KV pages live
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
        self.schedule = schedule or DecodeSchedule.of(section, platform, self.kernels.needs_live_pages)
        _check_schedule(self.schedule, section, self.kernels.needs_live_pages)
        _log.info("engine %s on %s: decode kernels %s, %d steps per call%s", section.server_id, platform,
                  self.kernels.summary(), self.schedule.steps_per_call,
                  f" (fallback: {self.kernels.reason})" if self.kernels.reason else "")
        self.page_book = PageBook(section.num_pages, self.schedule)  # the engine's only host state
        self.key_shape = jax.random.key_data(jax.random.key(0)).shape
        self.state_shardings = None if mesh is None else _state_shardings(mesh, self.pool_layout)
        # Hashable and equal for equal configs, so engines of the same model shape share compiled code.
        self.spec = prg.Spec(graphdef, model_cfg.num_layers, self.page_size, self.kernels,
                             self.schedule.steps_per_call, jnp.dtype(kv_dtype), self.schedule.chunk,
                             self.state_shardings, vocab_size=model_cfg.vocab_size,
                             longest_prompt=self.schedule.buckets[-1],
                             layer_pages=section.num_pages)
        self.pools = prg.pool_geom(self.spec)  # the page copies' static view of the one K and V pool
        self._build_programs = functools.partial(_programs_for, self.spec, self.schedule.row_buckets)
        self._zeros = functools.partial(_zero_state, model_cfg, section, kv_dtype, self.pool_layout, self.key_shape)

    @property
    def attention_impl(self) -> str:
        """The decode attention this engine runs (rollout.attention_impl resolved)."""
        return self.kernels.attention

    def bound(self, params) -> prg.Bound:
        """``params`` flattened in this engine's layout with the programs for their tree structure
        (computed once per params object: ParamPlacement.bind); what every call below runs."""
        leaves, (progs, per_bucket) = self.placement.bind(params, self._build_programs)
        return prg.Bound(leaves, progs, per_bucket)

    # ---------------------------------------------------------------- state

    def init_decode_state(self) -> DecodeState:
        """Empty decode state (zero pools, every slot inactive) on this engine's devices."""
        if self.mesh is not None:  # built in place: each device allocates only its KV-head shard
            return jax.jit(self._zeros, out_shardings=self.state_shardings)()
        return self._zeros()

    def abstract_state(self) -> DecodeState:
        """The decode state's shapes and dtypes (with their shardings on a mesh), allocating nothing:
        for lowering and compiling the programs from shapes."""
        state = jax.eval_shape(self._zeros)
        if self.state_shardings is None:
            return state
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                            self.state_shardings)

    # ---------------------------------------------------------------- JetStream API

    def prefill(self, params: Any, padded_tokens: np.ndarray, true_length: int) -> Prefix:
        """KV of ``padded_tokens[0, :true_length-1]``. padded_tokens: i32[1, bucket]."""
        if not 1 <= true_length <= padded_tokens.shape[-1]:
            raise ValueError(f"true_length={true_length}: must be in [1, {padded_tokens.shape[-1]}]")
        b = self.bound(params)
        k, v, last = b.programs.prefill(b.leaves, np.asarray(padded_tokens, np.int32).reshape(1, -1),
                                        np.int32(true_length))
        return Prefix(k, v, np.int32(true_length), last)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, init: SlotInit) -> DecodeState:
        """Allocate the slot's pages (for its whole life), page in the prefix KV, activate the slot.

        Raises OutOfPages (state untouched) when the pool cannot hold the sequence.
        """
        prompt_len = int(prefix.true_length)
        pages = self.page_book.admit(slot, prompt_len, init.max_new, prompt_len - 1)
        return prg.settle(self.spec, prg.insert_jit(
            self.page_size, self.pools, decode_state, prefix.k, prefix.v, np.int32(prompt_len), prefix.last_token,
            np.int32(slot), page_row(self.pages_per_seq, pages), *init_arrays(self.key_shape, init)))

    def prefill_insert(self, params: Any, decode_state: DecodeState, slot: int, prompt_ids,
                       init: SlotInit) -> DecodeState:
        """prefill() + insert() of one prompt in one jitted call (half the dispatches; the Prefix stays on device).

        Same pages and state as the two calls, the KV up to float rounding (XLA fuses one program
        differently from two), so the server admits every sequence through this one path; raises
        OutOfPages (state untouched) like insert().
        """
        if slot in self.page_book.slot_pages:
            raise ValueError(f"slot {slot} is occupied; free({slot}) first")
        padded, n = self.schedule.pad_prompt(prompt_ids)
        b = self.bound(params)
        pages = self.page_book.admit(slot, n, init.max_new, n - 1)
        return b.programs.prefill_insert(b.leaves, decode_state, padded, np.int32(n), np.int32(slot),
                                         page_row(self.pages_per_seq, pages), *init_arrays(self.key_shape, init))

    def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, StepOutput]:
        """Advance every active slot by ``steps_per_call`` tokens (one jitted call, state donated):
        sampling and stop checks run on the device, the host reads the call's tokens once."""
        b = self.bound(params)
        rows, n_chunks = self.page_book.rows()
        bucket = self.page_book.live_bucket()
        self.page_book.advance()
        # len(rows) names the program: row buckets are smaller than the engine's own call (validated).
        return b.generate_program(len(rows))(b.leaves, decode_state, rows, n_chunks, bucket)

    def free(self, slot: int) -> None:
        """Return the slot's pages to the pool (JetStream's free_resource). The device must already
        have it inactive (finished, or deactivate())."""
        self.page_book.release(slot)

    def deactivate(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stop a live slot on the device (before export or abort)."""
        return prg.settle(self.spec, prg.deactivate_jit(decode_state, np.int32(slot)))

    # ---------------------------------------------------------------- export / import

    def read_slot(self, decode_state: DecodeState, slot: int, num_cached: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the slot's first ceil(num_cached/page) pages: (k, v) f[L, n, page, Hkv, D]."""
        n = pages_needed(num_cached, self.page_size)
        k, v = jax.device_get(prg.read_pages_jit(self.pools, decode_state, self.page_book.page_row(slot)))
        kv = np.dtype(self.kv_dtype)  # stored bits -> values (a view, no copy)
        return np.asarray(k)[:, :n].view(kv), np.asarray(v)[:, :n].view(kv)

    def write_slot(self, decode_state: DecodeState, slot: int, k: np.ndarray, v: np.ndarray, num_cached: int,
                   last_token: int, prompt_len: int, init: SlotInit) -> DecodeState:
        """Import: allocate the slot's pages, copy in k/v (f[L, n, page, Hkv, D]), activate it."""
        if slot in self.page_book.slot_pages:
            raise ValueError(f"slot {slot} is occupied")
        n = k.shape[1]
        if n != pages_needed(num_cached, self.page_size):
            raise ValueError(f"got {n} KV pages for {num_cached} cached tokens at page_size={self.page_size}")
        pages = self.page_book.admit(slot, prompt_len, init.max_new, int(num_cached))
        pad = [(0, 0), (0, self.pages_per_seq - n)] + [(0, 0)] * (k.ndim - 2)
        row = page_row(self.pages_per_seq, pages)
        dst = np.where(np.arange(self.pages_per_seq) < n, row, 0).astype(np.int32)
        if self.mesh is None:
            kd, vd = (jnp.asarray(np.pad(x, pad)).astype(self.kv_dtype) for x in (k, v))
        else:  # each device receives only its KV heads of the imported pages
            kd, vd = (tpl.place_leaf(np.pad(np.asarray(x).astype(self.kv_dtype), pad), tpl.kv_sharding(self.mesh, 5))
                      for x in (k, v))
        return prg.settle(self.spec, prg.write_slot_jit(
            self.pools, decode_state, kd, vd, dst, np.int32(slot), row, np.int32(num_cached), np.int32(last_token),
            *init_arrays(self.key_shape, init)))


def _zero_state(cfg: TransformerConfig, section: RolloutSection, kv_dtype: Any, pool_layout: str,
                key_shape: tuple) -> DecodeState:
    """A zero decode state: every layer's pages in one K and one V pool (layer l's from l * num_pages,
    rollout/layered.py), every slot inactive."""
    s, n = section.num_slots, section.pages_per_seq
    store = storage_dtype(kv_dtype, pool_layout)  # CPU bf16 pools live as uint16 bits (see storage_dtype)

    def zeros(key):
        shape = pool_shape(section.num_pages * cfg.num_layers, section.page_size, cfg.num_kv_heads, cfg.head_dim,
                           key=key, layout=pool_layout)
        return jnp.zeros(shape, store)
    return DecodeState(
        k_pages=zeros(True), v_pages=zeros(False),
        page_table=jnp.zeros((s, n), jnp.int32), lengths=jnp.zeros((s,), jnp.int32),
        last_token=jnp.zeros((s,), jnp.int32), num_generated=jnp.zeros((s,), jnp.int32),
        max_new=jnp.zeros((s,), jnp.int32), active=jnp.zeros((s,), bool),
        keys=jnp.zeros((s, *key_shape), jnp.uint32), temperature=jnp.zeros((s,), jnp.float32),
        top_k=jnp.zeros((s,), jnp.int32), top_p=jnp.ones((s,), jnp.float32),
        stop_ids=jnp.full((s, MAX_STOP_IDS), -1, jnp.int32))


def _programs_for(spec: prg.Spec, row_buckets: tuple[int, ...], treedef) -> tuple[prg.Programs, dict]:
    """An engine's programs and each row bucket's, for one params tree structure."""
    return (prg.programs(spec, treedef),
            {b: prg.programs(spec._replace(chunk=b, one_chunk=True), treedef) for b in row_buckets})


def _state_shardings(mesh, pool_layout: str) -> DecodeState:
    kv = tpl.pool_sharding(mesh, pool_layout)  # one pool of every layer's pages (rollout/layered.py)
    rep = tpl.replicated(mesh)
    return DecodeState(kv, kv, *([rep] * (len(DecodeState._fields) - 2)))


def _check_schedule(schedule: DecodeSchedule, section: RolloutSection, needs_live_pages: bool) -> None:
    """A schedule passed in must describe this engine's slots and pages and its attention's needs."""
    for name in ("num_slots", "page_size", "pages_per_seq"):
        if getattr(schedule, name) != getattr(section, name):
            raise ValueError(f"schedule.{name}={getattr(schedule, name)} differs from rollout.{name}="
                             f"{getattr(section, name)}")
    if schedule.uses_live_pages != needs_live_pages:
        raise ValueError(f"schedule.live_buckets={schedule.live_buckets}: the decode attention "
                         f"{'needs' if needs_live_pages else 'takes no'} live-page buckets")


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
    return engine, (params if engine.mesh is None else engine.placement.place(params))


__all__ = ["Engine", "make_engine", "OutOfPages", "MAX_STOP_IDS"]
