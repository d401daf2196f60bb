"""The stateful learner shell: owns the TrainState, runs PPO epochs x mini-batches, checkpoints, publishes.

Version semantics: `learner.version` counts completed `Learner.step` calls (0 = the initial
weights). Each step publishes its resulting weights as the new version; staleness of a trajectory
is `learner.version - trajectory.version` measured when the step starts.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from laminar_jax.learner.balance import balance_ranks, epoch_rows as _epoch_rows, rank_imbalance  # noqa: F401
from laminar_jax.learner.batch import (TrainBatch, bucket_length, collate, row_bucket, stratified_order,
                                      version_figures)
from laminar_jax.learner.checkpoint import Checkpointer
from laminar_jax.learner.config import DEFAULT_RULES, LearnerSection, MeshSection
from laminar_jax.learner.lora import merged_fn
from laminar_jax.learner.models import collect_models, compute_dtype, load_onto
from laminar_jax.learner.mesh import (
    batch_sharding, build_mesh, param_shardings, place, replicated, state_shardings_like)
from laminar_jax.learner.publish import HostCopy, LoraVersions, Publisher, adapters_of, flatten_params
from laminar_jax.learner.publish import snapshot_fn as _snapshot_fn
from laminar_jax.model.attention import resolve_train_attention
from laminar_jax.learner.step import (
    init_train_state, make_optimizer, make_prepare_fn, make_train_step, make_updates)
from laminar_jax.model.precision import as_dtype, cast_floating
from laminar_jax.naming import host_arrays
from laminar_jax.types import Trajectory

log = logging.getLogger(__name__)


class SkippedUpdatesError(RuntimeError):
    """Too many consecutive non-finite updates."""


class PreparedBatch(NamedTuple):
    """A batch collated and placed for the step that starts at `version` (`Learner.prepare`)."""
    version: int
    n: int  # trajectories
    host: TrainBatch
    batch: TrainBatch  # on the mesh
    rng: np.random.Generator  # the step's draws, past the collation order


class InFlightStep(NamedTuple):
    """A dispatched step (`Learner.dispatch`) whose updates may still be computing."""
    version: int  # the version it makes
    per_update: dict  # the updates' metrics on the device (stacked over them, or one update's)
    optimizer_step: Any  # the optimizer's step count after it, on the device
    figures: dict  # the batch's host-side metrics
    publish: bool
    t0: float  # perf_counter at dispatch
    publish_wait_s: float  # spent in dispatch waiting for the previous version's host copy


class Learner:
    """Learner(section, model, mesh=...) -> .step(trajectories) -> metrics dict.

    `step` is `finish(dispatch(...))`; a caller with host work to overlap (the runtime's Driver)
    calls the two apart, and may `prepare` the next batch in between.

    model: the actor (an nnx Transformer; needs a value head when section.critic == 'shared').
    mesh: a jax Mesh with axes ('data','fsdp','tensor'), a MeshSection, or None (all devices on fsdp).
    critic_model: the value model when section.critic == 'separate' (built with value_head=True).
    ref_model: reference policy for the KL term; default: a frozen copy of the initial actor params
      (or section.ref_path). On resume the reference is rebuilt the same way, so construct the
      Learner from the same initial model before calling restore_latest().
    publish_dtype: the serving dtype (rollout.dtype) every published version is cast to, on the
      learner's devices before the host copy; default: the model's compute dtype (`model.dtype`).
    """

    def __init__(self, section: LearnerSection, model: nnx.Module, mesh: Mesh | MeshSection | None = None, *,
                 critic_model: Optional[nnx.Module] = None, ref_model: Optional[nnx.Module] = None,
                 rules: Optional[Sequence[str]] = None, publisher: Optional[Publisher] = None,
                 publish_dtype: Any = None):
        section.validate("learner")
        self.section = section
        if mesh is None or isinstance(mesh, MeshSection):
            ms = mesh or MeshSection()
            ms.validate("mesh")
            rules = ms.rules if rules is None else rules
            mesh = build_mesh(ms)
        self.mesh = mesh
        # An explicit kernel off its platform fails here, naming the field; 'auto' says what it chose.
        self.train_attention, why = resolve_train_attention(section.attention_impl, mesh.devices.flat[0].platform)
        log.info("learner.attention_impl=%r: %s (%s)", section.attention_impl, self.train_attention, why)
        self.rules = tuple(DEFAULT_RULES if rules is None else rules)
        self.publisher = publisher
        self.version = 0
        self.restore_report: Optional[dict] = None  # set by restore_latest: step restored, steps skipped
        self._pending: Optional[HostCopy] = None
        # One worker: publishes run in version order, and no thread is started per step.
        self._publish_worker = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._ckpt = Checkpointer(section.checkpoint_dir, section.keep_checkpoints, section.async_checkpoint) \
            if section.checkpoint_dir else None

        if ref_model is None and section.use_kl and section.ref_path:
            ref_model = load_onto(section.ref_path, mesh, self.rules)
        serving = as_dtype(publish_dtype if publish_dtype is not None else compute_dtype(model) or np.float32)
        models = collect_models(section, model, critic_model, ref_model, serving)
        self.graphs = models.graphs
        p_shard = {k: param_shardings(v, mesh, self.rules) for k, v in models.params.items()}
        params = place(models.params, p_shard)
        self.ref_params = None if models.ref is None else place(
            models.ref, param_shardings(models.ref, mesh, self.rules))
        f_shard = None if models.frozen is None else {
            k: param_shardings(v, mesh, self.rules) for k, v in models.frozen.items()}
        frozen = None if models.frozen is None else place(models.frozen, f_shard)
        self.optimizer = make_optimizer(section)
        rep = replicated(mesh)
        init_fn = lambda p, f: init_train_state(p, self.optimizer, section.seed, f)  # noqa: E731
        abstract = jax.eval_shape(init_fn, params, frozen)
        self.state_shardings = state_shardings_like(abstract, params, p_shard, mesh)._replace(
            params=p_shard, frozen=f_shard)
        init = jax.jit(init_fn, in_shardings=(p_shard, f_shard), out_shardings=self.state_shardings)
        self.state = init(params, frozen)
        bs = batch_sharding(mesh)
        self.batch_shardings = TrainBatch(*([bs] * len(TrainBatch._fields)))
        ref_shard = None if self.ref_params is None else jax.tree.map(lambda x: x.sharding, self.ref_params)
        self._prepare = jax.jit(make_prepare_fn(section, self.graphs, mesh),
                                in_shardings=(p_shard, ref_shard, self.batch_shardings) + self._frozen(f_shard),
                                out_shardings=self.batch_shardings)
        train_step = make_train_step(section, self.graphs, self.optimizer, mesh)
        # One update over the whole batch (mini_batches = ppo_epochs = 1), else every update of a step
        # in one program over its mini-batches' rows.
        self._train_step = jax.jit(train_step, in_shardings=(self.state_shardings, self.batch_shardings),
                                   out_shardings=(self.state_shardings, rep), donate_argnums=(0,))
        self._updates = jax.jit(make_updates(train_step, self.batch_shardings),
                                in_shardings=(self.state_shardings, self.batch_shardings, rep),
                                out_shardings=(self.state_shardings, rep), donate_argnums=(0,))
        shape = dict(mesh.shape)
        self.ranks = shape["data"] * shape["fsdp"]  # data-parallel ranks: each gets a contiguous block of rows
        self.row_multiple = self.ranks * section.micro_batches * section.mini_batches
        self._balance = section.balance_tokens and self.ranks > 1
        # Publishing from a snapshot: the host copy then reads buffers no train step donates.
        self.snapshot_publish = section.publish_snapshot if section.publish_snapshot is not None \
            else mesh.devices.flat[0].platform != "cpu"
        # Under learner.lora a version is the base with the adapters merged, in the serving dtype.
        self._merged = merged_fn(section.lora.scale, serving) if section.lora.enabled else None
        flat = self.policy_arrays()
        self.publish_dtype = as_dtype(publish_dtype if publish_dtype is not None
                                      else compute_dtype(model) or next(iter(flat.values())).dtype)
        # LoRA (learner.lora): a version carries only the adapters, in float32 as trained, with the
        # base's identity (AdapterPublisher); servers merge them into the base they hold.
        self.lora = LoraVersions.of(section, lambda: flatten_params(self.state.frozen["actor"]))
        flat = self._published_flat()
        # A cast writes new buffers, which no train step donates: the host copy reads those.
        self._casts = self.lora is None and any(np.dtype(x.dtype) != self.publish_dtype for x in flat.values())
        self._snapshot = _snapshot_fn(flat, self.publish_dtype if self.lora is None else np.float32)
        self._cast = jax.jit(lambda f: cast_floating(f, self.publish_dtype))
        self.publish_wait_s = 0.0  # the learner's total wait for host copies of its weights

    # ----------------------------------------------------------------------------------- step
    def collate(self, trajectories: Sequence[Trajectory], order: Optional[np.ndarray] = None) -> TrainBatch:
        s = self.section
        return collate(trajectories, s.seq_len_buckets, s.pad_token_id, self.row_multiple, s.pack_length,
                       s.mini_batches, order, s.pack_rows_per_doubling, self.pack_lengths)

    @property
    def pack_lengths(self) -> tuple[int, ...]:
        """The row lengths a packed step may take (learner.pack_shrink), shortest first; () unpacked."""
        s = self.section
        if not s.pack_length:
            return ()
        shorter = tuple(b for b in s.seq_len_buckets if b < s.pack_length) if s.pack_shrink else ()
        return shorter + (s.pack_length,)

    def _draw(self, rng: np.random.Generator, trajectories: Sequence[Trajectory]) -> np.ndarray:
        """The packed step's order: its mini-batches are consecutive parts of it (learner.mini_batch_draw)."""
        s = self.section
        if s.mini_batch_draw == "stratified" and s.mini_batches > 1:
            return stratified_order(rng, [t.num_tokens for t in trajectories], s.mini_batches)
        return rng.permutation(len(trajectories))

    def step(self, trajectories: Sequence[Trajectory], publish: bool = True) -> dict:
        """One learner step on a list of scored trajectories: prepare (proximal/ref log-probs, values,
        advantages) once, then ppo_epochs x mini_batches optimizer updates, then publish version+1
        through `self.publisher` (`publish=False`: a replayed step whose version is published already)."""
        return self.finish(self.dispatch(trajectories, publish=publish))

    def prepare(self, trajectories: Sequence[Trajectory], version: int) -> PreparedBatch:
        """The host half of the step that starts at `version`: the batch collated (in the order that
        version's step draws) and placed on the mesh. A caller does this while the step before is
        still computing, and hands the result to `dispatch`."""
        s = self.section
        rng = np.random.default_rng([s.seed, version])
        host = self.collate(trajectories, self._draw(rng, trajectories) if s.pack_length else None)
        return PreparedBatch(version, len(trajectories), host, place(host, self.batch_shardings), rng)

    def dispatch(self, trajectories: Sequence[Trajectory], prepared: Optional[PreparedBatch] = None,
                 publish: bool = True) -> InFlightStep:
        """Start a step: enqueue its log-prob pass and updates and return without waiting for them
        (XLA runs them while the caller does other host work). `finish` completes it; call it before
        the next `dispatch`. `prepared`: this batch from `prepare` at the learner's version."""
        t0 = time.perf_counter()
        s = self.section
        if self._pending is not None:
            self._pending.check()
        if prepared is None:
            prepared = self.prepare(trajectories, self.version)
        elif (prepared.version, prepared.n) != (self.version, len(trajectories)):
            raise ValueError(f"learner.dispatch: batch prepared for version {prepared.version} with {prepared.n} "
                             f"trajectories; the learner is at version {self.version} with {len(trajectories)}")
        host, rng = prepared.host, prepared.rng
        prep = self._prepare(self.state.params, self.ref_params, prepared.batch, *self._frozen(self.state.frozen))
        b = host.tokens.shape[0]
        rows = b // s.mini_batches
        wait0 = self.publish_wait_s
        if self._pending is not None and not (self.snapshot_publish or self._casts):
            self._wait_copied()  # donation below would free buffers the host copy still reads
        row_tokens = (host.segment_ids > 0).sum(axis=1)
        perms = []
        for _ in range(s.ppo_epochs):
            perm = _epoch_rows(rng, b, s.mini_batches, bool(s.pack_length)) \
                if s.mini_batches > 1 or s.ppo_epochs > 1 else None
            if self._balance:
                perm = balance_ranks(np.arange(b) if perm is None else perm, row_tokens, rows, self.ranks)
            perms.append(perm)
        if perm is None:
            self.state, per_update = self._train_step(self.state, prep)
        else:  # update u trains on rows perms[u] (epoch by epoch, its mini-batches in order)
            order = np.concatenate(perms).reshape(-1, rows).astype(np.int32)
            self.state, per_update = self._updates(self.state, prep, place(order, replicated(self.mesh)))
        n = len(trajectories)
        figures = dict(
            rank_token_imbalance=rank_imbalance(perm if perm is not None else np.arange(b), row_tokens, rows,
                                                self.ranks),
            **version_figures(host.versions, trajectories, self.version), num_trajectories=n,
            num_tokens=int((host.segment_ids > 0).sum()), response_tokens=int(host.loss_mask.sum()),
            seq_len=int(host.tokens.shape[1]), rows=int(host.tokens.shape[0]),
            pad_frac=float(1.0 - (host.segment_ids > 0).mean()), reward_mean=float(host.rewards[:n].mean()),
            updates=s.ppo_epochs * s.mini_batches if perm is not None else 1)
        return InFlightStep(self.version + 1, per_update, self.state.step, figures, publish, t0,
                            self.publish_wait_s - wait0)

    def finish(self, step: InFlightStep) -> dict:
        """Wait for a dispatched step's updates, check them, count the version and publish it; the
        step's metrics. `step_s` is the wall time from the step's dispatch to here."""
        s = self.section
        if step.version != self.version + 1:
            raise ValueError(f"learner.finish: step for version {step.version}; the learner is at {self.version}")
        per_update = {k: np.atleast_1d(_values(v)) for k, v in step.per_update.items()}
        metrics = {k: float(np.mean(v)) for k, v in per_update.items()}
        metrics["skipped"] = float(per_update["skipped"].sum())
        consecutive = int(per_update["consecutive_skips"][-1])
        if consecutive >= s.max_consecutive_skips:
            raise SkippedUpdatesError(
                f"learner step {step.version} (optimizer step {int(_scalar(step.optimizer_step))}): "
                f"{consecutive} consecutive updates skipped for a non-finite loss or gradient "
                f"(max_consecutive_skips={s.max_consecutive_skips})")
        self.version += 1
        wait0 = self.publish_wait_s
        self._start_publish(step.publish)
        metrics.update(step.figures, version=self.version, step_s=time.perf_counter() - step.t0,
                       publish_wait_s=step.publish_wait_s + self.publish_wait_s - wait0)
        return metrics

    def batch_shapes(self, num_trajectories: int, max_tokens: Optional[int] = None) -> list[tuple[int, int]]:
        """(rows, tokens per row) of every batch a step of ``num_trajectories`` trajectories of at
        most ``max_tokens`` tokens can take: each seq_len bucket; packed, each row bucket (up to a
        row per trajectory in each mini-batch) at each row length."""
        s = self.section
        slots = -(-num_trajectories // self.row_multiple) * self.row_multiple
        if s.pack_length:
            rows, unit, units = [], self.row_multiple // s.mini_batches, 1
            while True:  # every row bucket up to a row per trajectory in each mini-batch
                rows.append(unit * units * s.mini_batches)
                if unit * units >= -(-num_trajectories // s.mini_batches):
                    break
                units = row_bucket(units + 1, s.pack_rows_per_doubling)
            # Each row length up to the one collate picks for a trajectory of max_tokens.
            top = bucket_length(min(max_tokens or s.pack_length, s.pack_length), self.pack_lengths)
            return [(b, t) for t in self.pack_lengths if t <= top for b in rows]
        top = bucket_length(max_tokens, s.seq_len_buckets) if max_tokens else s.seq_len_buckets[-1]
        return [(slots, t) for t in s.seq_len_buckets if t <= top]

    def warmup(self, num_trajectories: int, max_tokens: Optional[int] = None) -> int:
        """Compile (ahead of time) the prepare pass and the update program for every batch shape
        (`batch_shapes`), so no training step pays XLA compilation. Returns how many shapes were
        compiled: none with learner.compile_ahead='none' (each compiles when a step first needs it)."""
        s = self.section
        slots = -(-num_trajectories // self.row_multiple) * self.row_multiple
        shapes = self.batch_shapes(num_trajectories, max_tokens) if s.compile_ahead == "all" else []
        for b, t in shapes:
            batch = self._abstract_batch(b, t, slots)
            frozen = self._frozen(self.state.frozen)
            self._prepare.lower(self.state.params, self.ref_params, batch, *frozen).compile()
            if s.mini_batches > 1 or s.ppo_epochs > 1 or self._balance:
                mb = b // s.mini_batches
                order = jax.ShapeDtypeStruct((s.ppo_epochs * s.mini_batches, mb), np.int32,
                                             sharding=replicated(self.mesh))
                self._updates.lower(self.state, batch, order).compile()
            else:
                self._train_step.lower(self.state, batch).compile()
        if self.snapshot_publish or self._casts:
            jax.block_until_ready(self._snapshot(self._published_flat()))
        return len(shapes)

    def _abstract_batch(self, rows: int, t: int, slots: int) -> TrainBatch:
        """ShapeDtypeStructs (with the batch shardings) of a collated TrainBatch."""
        per_slot = ("rewards", "group_ids", "versions")
        ints = {"tokens", "targets", "positions", "segment_ids", "group_ids", "versions", "seq_ids"}
        return TrainBatch(*(
            jax.ShapeDtypeStruct((slots,) if f in per_slot else (rows, t), np.int32 if f in ints else np.float32,
                                 sharding=sh)
            for f, sh in zip(TrainBatch._fields, self.batch_shardings)))

    # ------------------------------------------------------------------------------ publishing
    def _wait_copied(self) -> None:
        t0 = time.perf_counter()
        self._pending.wait_copied(self.section.publish_timeout_s)
        self.publish_wait_s += time.perf_counter() - t0

    def _frozen(self, frozen: Any) -> tuple:
        """The prepare pass's trailing frozen-params argument: (frozen,) under learner.lora, else ()."""
        return (frozen,) if self.section.lora.enabled else ()

    def policy_arrays(self) -> dict[str, jax.Array]:
        """The policy weights on the devices, flat: the actor's params, or under learner.lora the base
        with the adapters merged (model.lora.merge), in the serving dtype."""
        if self._merged is not None:
            return self._merged(self.state.params["actor"], self.state.frozen["actor"])
        return flatten_params(self.state.params["actor"])

    def adapter_params(self) -> dict[str, np.ndarray]:
        """Host copy of the float32 adapters (learner.lora), flat under the contract's names
        ('<module>.lora_a' / '.lora_b', model/lora.py)."""
        if not self.section.lora.enabled:
            raise ValueError("learner.adapter_params: learner.lora.rank is 0 (full fine-tuning has no adapters)")
        return host_arrays(flatten_params(self.state.params["actor"]))

    def _start_publish(self, publish: bool) -> None:
        flat = self._published_flat()
        across_processes = not all(x.is_fully_addressable for x in flat.values())
        if not publish or (self.publisher is None and not across_processes):
            self._pending = None
            return
        if (self.snapshot_publish or self._casts) and not across_processes:
            if self._pending is not None:
                self._wait_copied()  # at most one snapshot in device memory (usually copied a step ago)
            flat = self._snapshot(flat)
        elif self._casts:  # each process casts its shards before the gather: the serving dtype's bytes move
            flat = self._cast(flat)
        # Across processes every process joins the gather; the one holding a publisher publishes.
        publisher = self.publisher if self.lora is None or self.publisher is None else self.lora.wrap(self.publisher)
        self._pending = HostCopy(self.version, flat, publisher, self._publish_worker)

    def _published_flat(self) -> dict:
        """The tensors a version carries: the policy weights, or (LoRA) only the adapters."""
        return self.policy_arrays() if self.lora is None else adapters_of(flatten_params(self.state.params["actor"]))

    def published_params(self) -> dict[str, np.ndarray]:
        """Host copy of the current version as published (LoRA: the adapter version, model/lora_version.py)."""
        return self.policy_params() if self.lora is None else self.lora.version(host_arrays(self._published_flat()))

    def served_arrays(self) -> dict[str, jax.Array]:
        """The policy weights on the devices, flat, cast to the serving dtype (rollout.dtype) as a
        version carries them; each process casts its own shards, so a gather moves serving bytes."""
        flat = self.policy_arrays()
        return self._cast(flat) if self._casts else flat

    def policy_params(self) -> dict[str, np.ndarray]:
        """Host copy of the current policy weights (blocking), flat, in the serving dtype (under
        learner.lora the base with the adapters merged; what is published is `published_params`)."""
        return host_arrays(self.served_arrays())

    def master_params(self) -> dict[str, np.ndarray]:
        """Host copy of the trained policy weights (blocking), flat, in their own (master) dtype
        (under learner.lora: the adapters)."""
        return host_arrays(flatten_params(self.state.params["actor"]))

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait for the last publish (and checkpoint save) to finish; re-raise their errors."""
        if self._pending is not None:
            self._pending.wait_done(timeout or self.section.publish_timeout_s)
        if self._ckpt is not None:
            self._ckpt.wait()

    # ----------------------------------------------------------------------------- checkpoint
    def save(self, step: int, extra: Optional[dict] = None) -> None:
        """Async orbax save of the TrainState, version and caller JSON `extra` under `step`."""
        if self._ckpt is None:
            raise ValueError("learner.checkpoint_dir is None: checkpointing is disabled")
        # The frozen base (learner.lora) is not saved: it is rebuilt from the initial model, as the reference is.
        self._ckpt.save(step, self.state._replace(frozen=None), {"version": self.version, "extra": extra or {}})

    def restore_latest(self) -> Optional[dict]:
        """Restore the newest checkpoint that restores, if any; returns its `extra` (None when there
        is none). Damaged newer checkpoints are logged and moved aside; `restore_report` says which
        step was restored and which were moved where (for the run summary)."""
        if self._ckpt is None:
            return None
        got = self._ckpt.restore_newest(self.state._replace(frozen=None))
        if got is None:
            log.info("no checkpoint in %s: the learner starts from its initial weights", self._ckpt.directory)
            self.restore_report = {"step": None, "skipped": []}
            return None
        self.state, self.version = got.state._replace(frozen=self.state.frozen), int(got.meta["version"])
        self.restore_report = {"step": got.step, "skipped": [d._asdict() for d in got.skipped]}
        return got.meta["extra"]

    def close(self) -> None:
        self.flush()
        self._publish_worker.shutdown(wait=False)
        if self._ckpt is not None:
            self._ckpt.close()


def _values(x: Any) -> np.ndarray:
    """Replicated array -> numpy (works for arrays that span processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def _scalar(x: Any) -> float:
    """Replicated scalar -> float (works for arrays that span processes)."""
    return float(_values(x))
