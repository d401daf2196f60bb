"""The pure learner step: TrainState, optimizer, the per-batch prepare pass and `train_step`.

prepare(params, ref_params, batch) -> batch      once per Learner.step, before the update loop:
    proximal / reference log-probs, old values, token rewards, advantages (whole batch, so
    GRPO/RLOO groups are never split).
train_step(state, batch) -> (state, metrics)     one optimizer update on a (mini-)batch with
    gradient accumulation over `micro_batches` (lax.scan); a non-finite loss or gradient leaves
    params/opt_state unchanged and is counted.
Both are built by closures over static configuration (graphdefs, the LearnerSection) and are
jitted with shardings by `Learner` (learner/learner.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from laminar_jax.kernels import train_products
from laminar_jax.learner.advantages import AdvantageInputs, AdvantageParams, compute_advantages, terminal_token_rewards
from laminar_jax.learner.batch import TrainBatch
from laminar_jax.learner.config import SEQ_OFF_POLICY, LearnerSection
from laminar_jax.learner.logprobs import EntropyMode, chunk_positions, score_tokens
from laminar_jax.learner.losses import AggNorm, aggregate, agg_norm, kl_penalty, value_loss
from laminar_jax.learner.losses_seq import correction, policy_loss
from laminar_jax.learner.mesh import BATCH_AXES, gathered_lookup, rows_split
from laminar_jax.model.attention import AUTO, resolve_train_attention
from laminar_jax.model.lora import with_dropout
from laminar_jax.model.precision import cast_floating


class TrainState(NamedTuple):
    params: dict  # {'actor': nnx.State} (+ 'critic': nnx.State when critic == 'separate')
    opt_state: Any  # optax state over `params`
    step: jax.Array  # i32[] train_step calls so far (applied or skipped)
    rng: jax.Array  # u32[2] raw key data, split once per step
    consecutive_skips: jax.Array  # i32[] non-finite updates in a row
    total_skips: jax.Array  # i32[]
    # Untrained params beside `params` (same roles): under learner.lora the frozen base, {'actor':
    # nnx.State} in the serving dtype; no gradient, no optimizer state, never checkpointed. None otherwise.
    frozen: Any = None


def join(params: dict, frozen: Optional[dict]) -> dict:
    """The models' whole states: each role's trained params with its frozen ones (learner.lora's base)."""
    if not frozen:
        return params
    return {k: nnx.merge_state(frozen[k], v) if k in frozen else v for k, v in params.items()}


class Graphs(NamedTuple):
    """Static halves of nnx.split for the models the step uses (None when absent), and the
    compute dtype of each (its model's `dtype`; None: compute in the parameters' own dtype)."""

    actor: Any
    critic: Any
    ref: Any
    dtypes: Optional[dict] = None  # {'actor': dtype, 'critic': ..., 'ref': ...}

    def dtype(self, role: str) -> Any:
        return None if self.dtypes is None else self.dtypes.get(role)


class ForwardOut(NamedTuple):
    logp: jax.Array  # f32[B, T] log-prob of targets (zeros when not scored)
    entropy: jax.Array  # f32[B, T] (zeros unless asked for)
    values: Optional[jax.Array]  # f32[B, T] or None


def batch_shards(mesh: Optional[Mesh]) -> int:
    """Number of row shards of a batch: the product of the ('data', 'fsdp') mesh axes (1 without a mesh)."""
    if mesh is None:
        return 1
    shape = dict(mesh.shape)
    return int(shape["data"] * shape["fsdp"])


def _attention(name: str) -> str:
    """'auto' resolved for the backend the step is traced for (the Learner checked explicit names)."""
    return resolve_train_attention(name, jax.default_backend())[0] if name == AUTO else name


def forward(graphdef: Any, params: nnx.State, batch: TrainBatch, section: LearnerSection, shards: int = 1, *,
            score: bool = True, entropy: EntropyMode = "none", remat: Optional[str] = None,
            dtype: Any = None, mesh: Optional[Mesh] = None, dropout_key: Any = None) -> ForwardOut:
    """Merge the model inside the trace and score the batch's targets.

    dtype: the compute dtype. The (float32 master) params are cast to it here, once, before the
    model uses them: every weight product casts its weight to it anyway, and casting the sharded
    params first lets an FSDP all-gather move the compute dtype's bytes. The cast's gradient is
    the cotangent in the params' own dtype, so updates land on the master copy.

    Layers run under `remat` (default `section.remat`; passes without a gradient use 'none'); log-probs/entropy come from the final hidden states in chunks
    of `section.logits_chunk_tokens` tokens per device (`shards` row shards), never as full
    f32[B, T, V] logits when the chunk is smaller than the batch. score=False: values only.
    mesh: the learner's mesh; the embedding table is then read gathered over the batch axes
    (`mesh.gathered_lookup`), so the activations stay split by rows.
    dropout_key: the training forward's adapter dropout masks (learner.lora.dropout, model.lora
    `with_dropout`); None in every pass without a gradient.
    """
    params = gathered_lookup(params if dtype is None else cast_floating(params, dtype), mesh)
    model = nnx.merge(graphdef, params)
    if dropout_key is not None:
        with_dropout(model, section.lora.dropout, dropout_key)
    remat = section.remat if remat is None else remat
    products = train_products(jax.default_backend())  # the kernel seam's weight products for this platform
    out = model.forward(batch.tokens, batch.positions, batch.segment_ids, remat=remat, with_logits=False,
                        attention=_attention(section.attention_impl),
                        attention_chunk=section.attention_chunk, products=products, rows=rows_split(mesh))
    if not score:
        zeros = jnp.zeros(batch.tokens.shape, jnp.float32)
        return ForwardOut(zeros, zeros, out.values)
    rows, t = batch.tokens.shape
    chunk = chunk_positions(section.logits_chunk_tokens, rows // shards, t)
    project = functools.partial(model.logits_from_hidden, products=products)
    scores = score_tokens(project, out.hidden, batch.targets, section.temperature, chunk, entropy)
    return ForwardOut(scores.logp, scores.entropy, out.values)


def make_optimizer(section: LearnerSection) -> optax.GradientTransformation:
    """AdamW with linear warm-up then constant or cosine decay, after global-norm clipping."""
    if section.lr_schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(
            0.0, section.lr, section.warmup_steps, max(section.total_steps, section.warmup_steps + 1),
            end_value=section.lr * section.min_lr_ratio)
    elif section.warmup_steps > 0:
        sched = optax.linear_schedule(0.0, section.lr, section.warmup_steps)
    else:
        sched = optax.constant_schedule(section.lr)
    parts = [] if section.grad_clip is None else [optax.clip_by_global_norm(section.grad_clip)]
    parts.append(optax.adamw(sched, section.b1, section.b2, section.adam_eps, weight_decay=section.weight_decay))
    return optax.chain(*parts)


def _values(section: LearnerSection, graphs: Graphs, params: dict, batch: TrainBatch,
            actor_out: Optional[ForwardOut], shards: int, mesh: Optional[Mesh] = None) -> Optional[jax.Array]:
    if section.critic == "shared":
        return actor_out.values
    if section.critic == "separate":
        return forward(graphs.critic, params["critic"], batch, section, shards, score=False,
                       dtype=graphs.dtype("critic"), mesh=mesh).values
    return None


def make_prepare_fn(section: LearnerSection, graphs: Graphs,
                    mesh: Optional[Mesh] = None) -> Callable[[dict, Any, TrainBatch], TrainBatch]:
    """prepare(params, ref_params, batch) -> batch with the once-per-batch fields filled.

    proximal log-probs come from the actor params at batch start (only computed when off_policy
    needs them; with off_policy='none' they equal the behaviour log-probs). Token rewards are the
    terminal reward at the last response target, minus kl_coef * KL(old || ref) per token when
    kl_mode == 'reward'.
    """
    shards = batch_shards(mesh)

    def prepare(params: dict, ref_params: Any, batch: TrainBatch, frozen: Optional[dict] = None) -> TrainBatch:
        mask = batch.loss_mask
        if section.use_kl and ref_params is None:  # learner.lora without a reference model: the base is it
            ref_params = frozen["actor"]
        params = join(params, frozen)
        need_actor = section.off_policy != "none" or section.critic == "shared"
        actor_out = forward(graphs.actor, params["actor"], batch, section, shards, score=section.off_policy != "none",
                            remat="none", dtype=graphs.dtype("actor"), mesh=mesh) if need_actor else None
        prox = actor_out.logp if section.off_policy != "none" else batch.behaviour_logprobs
        old = correction(section, prox, batch.behaviour_logprobs, mask, batch.segment_ids).out.logp_old
        values = _values(section, graphs, params, batch, actor_out, shards, mesh)
        ref = jnp.zeros_like(mask)
        if section.use_kl:
            ref = forward(graphs.ref, ref_params, batch, section, shards, remat="none", dtype=graphs.dtype("ref"),
                          mesh=mesh).logp
        token_rewards = terminal_token_rewards(batch.rewards, mask, batch.seq_ids)
        if section.kl_mode == "reward" and section.kl_coef != 0.0:
            token_rewards = token_rewards - section.kl_coef * kl_penalty(section.kl_estimator, old, ref) * mask
        hp = AdvantageParams(section.gamma, section.lam, section.norm_adv_by_std, section.whiten_advantages,
                             section.adv_eps)
        adv = compute_advantages(section.adv_estimator,
                                 AdvantageInputs(batch.rewards, batch.group_ids, token_rewards, values, mask,
                                                 batch.seq_ids), hp)
        return batch._replace(
            old_logprobs=old * mask, prox_logprobs=prox * mask, ref_logprobs=ref * mask,
            old_values=(jnp.zeros_like(mask) if values is None else values * mask),
            advantages=adv.advantages, returns=adv.returns,
            seq_tokens=trajectory_tokens(batch.seq_ids, mask, batch.rewards.shape[0]))

    return prepare


def trajectory_tokens(seq_ids: jax.Array, mask: jax.Array, s: int) -> jax.Array:
    """f32[B, T]: the response-target count of each token's trajectory (0 off-mask; `s` slots), so
    that per-sequence aggregation survives packing and any row split (see losses.aggregate)."""
    slot = jnp.where(seq_ids >= 0, seq_ids, s)
    counts = jax.ops.segment_sum(mask.reshape(-1), slot.reshape(-1), num_segments=s + 1)
    return counts[slot] * mask


def make_loss_fn(section: LearnerSection, graphs: Graphs, shards: int = 1,
                 mesh: Optional[Mesh] = None) -> Callable[..., tuple]:
    """loss(params, micro_batch, norm, dropout_key=None) -> (scalar, metrics); norm spans the whole
    mini-batch; dropout_key: the actor's adapter dropout masks (learner.lora.dropout).

    shards: row shards of the batch (see `batch_shards`), for the per-device logits chunk size.
    mesh: the learner's mesh (see `forward`); None traces without sharding constraints.
    """
    agg = section.loss_agg
    # The entropy is always reported; it is differentiated only when it is in the loss.
    entropy_mode: EntropyMode = "grad" if section.entropy_coef != 0.0 else "value"

    def loss_fn(params: dict, mb: TrainBatch, norm: AggNorm, dropout_key: Any = None):
        mask = mb.loss_mask
        out = forward(graphs.actor, params["actor"], mb, section, shards, entropy=entropy_mode,
                      dtype=graphs.dtype("actor"), mesh=mesh, dropout_key=dropout_key)
        corr = correction(section, mb.prox_logprobs, mb.behaviour_logprobs, mask, mb.segment_ids)
        pg = policy_loss(section, out.logp, mb.old_logprobs, mb.advantages, mask, mb.segment_ids)
        tok_mean = lambda x: aggregate(x, mask, "token-mean", norm)
        seq_agg = lambda x: aggregate(x, mask, agg, norm, mb.seq_tokens)
        pg_loss = seq_agg(pg.loss * corr.out.weight)
        ent = seq_agg(out.entropy)
        total = pg_loss - section.entropy_coef * ent
        metrics = {"pg_loss": pg_loss, "entropy": tok_mean(out.entropy), "clipfrac": tok_mean(pg.clipped),
                   "dual_clipfrac": tok_mean(pg.dual_clipped), "ratio_mean": tok_mean(pg.ratio),
                   "is_weight_mean": tok_mean(corr.out.weight),
                   "approx_kl_old": tok_mean(jax.lax.stop_gradient(kl_penalty("k3", out.logp, mb.old_logprobs)))}
        if section.off_policy in SEQ_OFF_POLICY:  # share of trajectories capped / dropped
            name = "seq_capped_frac" if section.off_policy == "seq_tis" else "seq_masked_frac"
            metrics[name] = aggregate(corr.flagged, mask, "seq-mean-token-mean", norm, mb.seq_tokens)
        if section.use_kl:
            kl = kl_penalty(section.kl_estimator, out.logp, mb.ref_logprobs)
            metrics["kl_ref"] = tok_mean(kl)
            if section.kl_mode == "loss":
                total = total + section.kl_coef * seq_agg(kl)
        values = _values(section, graphs, params, mb, out, shards, mesh)
        if values is not None:
            vl, vclip = value_loss(values, mb.old_values, mb.returns, section.value_clip)
            vf = seq_agg(vl)
            total = total + section.vf_coef * vf
            metrics.update(vf_loss=vf, vf_clipfrac=tok_mean(vclip), value_mean=tok_mean(values))
        metrics["loss"] = total
        return total, metrics

    return loss_fn


def _tree_norm(tree: Any) -> jax.Array:
    """Global L2 norm (optax.tree.norm where available, optax.global_norm on older optax)."""
    tree_mod = getattr(optax, "tree", None)
    return tree_mod.norm(tree) if tree_mod is not None and hasattr(tree_mod, "norm") else optax.global_norm(tree)


class _Accum(NamedTuple):
    grads: Any
    metrics: dict


def split_micro(batch: TrainBatch, m: int, mesh: Optional[Mesh]) -> TrainBatch:
    """[B, ...] -> [m, B/m, ...] with micro-batch j = rows j, j+m, j+2m, ... (interleaved, so each
    device's contiguous row block feeds every micro-batch evenly)."""

    def one(x):
        y = x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1)
        if mesh is not None:
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, BATCH_AXES)))
        return y

    return jax.tree.map(one, batch)


def make_grad_fn(section: LearnerSection, graphs: Graphs, mesh: Optional[Mesh] = None):
    """grads(params, batch, frozen=None, key=None) -> (grads, metrics): summed over micro-batches
    (lax.scan); with the mini-batch-wide AggNorm the sum equals the gradient of the mini-batch loss.
    key: the update's dropout key (learner.lora.dropout > 0); micro-batch j draws from fold_in(key, j)."""
    loss_fn = make_loss_fn(section, graphs, batch_shards(mesh), mesh)
    m = section.micro_batches
    dropout = section.lora.enabled and section.lora.dropout > 0.0

    def grads(params: dict, batch: TrainBatch, frozen: Optional[dict] = None, key: Any = None):
        if batch.tokens.shape[0] % m:
            raise ValueError(f"batch of {batch.tokens.shape[0]} rows does not split into micro_batches={m}")
        norm = agg_norm(batch.loss_mask, batch.seq_tokens)
        micro_key = (lambda j: jax.random.fold_in(key, j)) if dropout and key is not None else (lambda j: None)
        # Differentiated by the trained params only: the frozen ones get no gradient.
        vg = jax.value_and_grad(lambda p, mb, n, k: loss_fn(join(p, frozen), mb, n, k), has_aux=True)
        if m == 1:
            (_, metrics), g = vg(params, batch, norm, micro_key(0))
            return g, metrics
        micro = split_micro(batch, m, mesh)
        first = jax.tree.map(lambda x: x[0], micro)
        zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                    jax.eval_shape(loss_fn, join(params, frozen), first, norm)[1])
        init = _Accum(jax.tree.map(jnp.zeros_like, params), zero_metrics)

        def body(acc: _Accum, xs):
            mb, j = xs
            (_, metrics), g = vg(params, mb, norm, micro_key(j))
            return _Accum(jax.tree.map(jnp.add, acc.grads, g), jax.tree.map(jnp.add, acc.metrics, metrics)), None

        acc, _ = jax.lax.scan(body, init, (micro, jnp.arange(m, dtype=jnp.int32)))
        return acc.grads, acc.metrics

    return grads


def make_train_step(section: LearnerSection, graphs: Graphs, optimizer: optax.GradientTransformation,
                    mesh: Optional[Mesh] = None) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict]]:
    grad_fn = make_grad_fn(section, graphs, mesh)

    def train_step(state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict]:
        # The update's key: split from the state's (learner.seed, advanced every update, checkpointed),
        # so a resumed run draws the same adapter dropout masks; the first half advances the state.
        next_key, dropout_key = jax.random.split(jax.random.wrap_key_data(state.rng))
        grads, metrics = grad_fn(state.params, batch, state.frozen, dropout_key)
        grad_norm = _tree_norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        def apply(params, opt_state):
            updates, new_opt = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt

        # A branch, not where(finite, new, old): a select reads the old moments after the update
        # has written the new ones into their donated buffers, so XLA keeps a copy of them (two
        # more parameter-sized arrays for the whole step); a cond updates them in place.
        new_params, new_opt = jax.lax.cond(finite, apply, lambda p, o: (p, o), state.params, state.opt_state)
        skipped = jnp.logical_not(finite).astype(jnp.int32)
        new_state = TrainState(
            params=new_params, opt_state=new_opt,
            step=state.step + 1, rng=jax.random.key_data(next_key),
            consecutive_skips=jnp.where(finite, 0, state.consecutive_skips + 1),
            total_skips=state.total_skips + skipped, frozen=state.frozen)
        metrics = dict(metrics, grad_norm=grad_norm, skipped=skipped,
                       consecutive_skips=new_state.consecutive_skips)
        return new_state, metrics

    return train_step


def make_updates(train_step: Callable[[TrainState, TrainBatch], tuple[TrainState, dict]],
                 batch_shardings: Optional[TrainBatch] = None):
    """A step's optimizer updates as one program: `train_step` over the mini-batches whose rows
    `perms[u]` selects from the prepared batch, in order (a scan). One call per learner step
    instead of a gather and an update per mini-batch: each call's host dispatch and program launch
    is paid once. Returns (state, metrics stacked over the updates)."""

    def updates(state: TrainState, batch: TrainBatch, perms: jax.Array) -> tuple[TrainState, dict]:
        def one(st, idx):
            mb = jax.tree.map(lambda x: x[idx], batch)
            if batch_shardings is not None:  # the rows of a mini-batch spread over the data ranks, as placed
                mb = TrainBatch(*(jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(mb, batch_shardings)))
            return train_step(st, mb)

        return jax.lax.scan(one, state, perms)

    return updates


def init_train_state(params: dict, optimizer: optax.GradientTransformation, seed: int,
                     frozen: Optional[dict] = None) -> TrainState:
    """Unjitted constructor (call under jit with shardings for placement); the optimizer sees `params` only."""
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                      rng=jax.random.key_data(jax.random.key(seed)),
                      consecutive_skips=jnp.zeros((), jnp.int32), total_skips=jnp.zeros((), jnp.int32),
                      frozen=frozen)
