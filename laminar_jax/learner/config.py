"""Config sections for the learner plane: the algorithm/optimiser (`LearnerSection`) and the mesh."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from laminar_jax.configlib import expect
from laminar_jax.model.lora import LoRASection

AdvEstimator = Literal["gae", "grpo", "rloo"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
OffPolicy = Literal["none", "tis", "decoupled", "seq_tis", "seq_mask"]
RatioLevel = Literal["token", "sequence"]
SEQ_OFF_POLICY = ("seq_tis", "seq_mask")


@dataclasses.dataclass(frozen=True)
class LearnerSection:
    """Algorithm, optimiser, batching and checkpointing of the learner.

    Log-prob names used below: *behaviour* = per-token log-probs the rollout recorded while
    sampling; *proximal* (= *old*) = learner params at the start of a `Learner.step`, computed once
    before the update loop; *current* = the params being differentiated.

    Attributes:
      lr: Peak learning rate of AdamW.
      master_weights: Train float32 master parameters with float32 AdamW state, whatever model.param_dtype is; the forward and backward compute in model.dtype (a bfloat16 copy cast inside the step, whose gradient flows back to the float32 master), and each version is published in rollout.dtype. False trains the parameters in model.param_dtype directly: with bfloat16 parameters every update smaller than half a bfloat16 step of its weight (2^-9 relative: 2e-3 at 1.0) rounds to nothing and is lost.
      warmup_steps: Linear warm-up from 0 to `lr` over this many optimizer updates.
      lr_schedule: 'constant' (after warm-up) or 'cosine' (decay to lr*min_lr_ratio at total_steps).
      total_steps: Optimizer updates over which the cosine schedule decays; in a run, finalize derives it (runtime.total_steps x ppo_epochs x mini_batches).
      min_lr_ratio: Final learning rate of the cosine schedule as a fraction of `lr`.
      weight_decay: AdamW decoupled weight decay.
      grad_clip: Global-norm gradient clip; None disables clipping.
      b1: AdamW beta1.
      b2: AdamW beta2.
      adam_eps: AdamW epsilon.
      adv_estimator: 'gae' (token-level GAE, needs a critic), 'grpo' (group-normalised) or 'rloo' (leave-one-out).
      norm_adv_by_std: GRPO: divide by the group std (False gives Dr.GRPO's mean-centred advantages).
      whiten_advantages: GAE: normalise advantages to zero mean / unit std over the batch's response tokens.
      adv_eps: Epsilon added to standard deviations when normalising advantages.
      gamma: GAE discount per token.
      lam: GAE lambda.
      clip_eps_low: PPO ratio lower bound is 1 - clip_eps_low.
      clip_eps_high: PPO ratio upper bound is 1 + clip_eps_high (> clip_eps_low gives clip-higher / DAPO).
      dual_clip_c: Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c*A; None = off.
      vf_coef: Weight of the value loss (critic != 'none').
      value_clip: Clip the new value to old_value +- value_clip in the clipped value loss; None = unclipped.
      entropy_coef: Weight of the entropy bonus (subtracted from the loss).
      kl_coef: Weight of the KL to the reference policy.
      kl_estimator: 'k1' (log r), 'k2' (0.5 log^2 r) or 'k3' (r - 1 - log r, r = pi_ref/pi), per token.
      kl_mode: 'loss' (KL term in the loss), 'reward' (-kl_coef*KL folded into per-token rewards) or 'none'.
      off_policy: 'none' (behaviour log-probs act as the old policy), 'tis' (proximal as old policy, loss times min(pi_prox/pi_behav, tis_cap)) or 'decoupled' (proximal for clipping, weight pi_prox/pi_behav, tokens with weight > tis_cap dropped).
      tis_cap: Cap of the behaviour importance weight ('tis' truncates at it, 'decoupled' masks tokens above it).
      ratio_level: 'token' (PPO: one ratio pi/pi_old per token, clipped per token) or 'sequence' (GSPO: one ratio per trajectory, s_i = exp(mean over its response tokens of log pi/pi_old), the geometric mean of its token ratios, clipped as a whole to [1 - clip_eps_low, 1 + clip_eps_high]; needs loss_agg='seq-mean-token-mean' and a critic-free estimator, 'grpo' or 'rloo'). Formulas: learner/losses_seq.py.
      seq_is_ratio: How off_policy='seq_tis' / 'seq_mask' measure a trajectory's behaviour-to-proximal ratio rho_i from its token ratios pi_prox/pi_behav: 'product' (their product, the sequence likelihood ratio: verl's rollout_is='sequence' and its seq_sum_k1 rejection) or 'geometric' (their geometric mean, the product to the power 1/|y_i|: verl's seq_mean_k1 rejection; a per-token scale, so one band suits short and long responses).
      seq_is_high: Upper end of the sequence band: off_policy='seq_tis' weights each trajectory's loss by min(rho_i, seq_is_high) (truncated sequence-level IS); 'seq_mask' drops trajectories with rho_i > seq_is_high. With seq_is_ratio='geometric' a useful band is narrow (e.g. 1.01).
      seq_is_low: Lower end of the band for off_policy='seq_mask' (trajectories with rho_i < seq_is_low are dropped); None = 1/seq_is_high. Only with 'seq_mask' ('seq_tis' truncates from above only).
      dynamic_sampling: DAPO's dynamic sampling: a complete group whose rewards are all equal (no advantage signal for 'grpo'/'rloo') is dropped before training and its prompt marked filtered in the ledger (consumed without training); fresh prompts are dispatched in its place until the batch is full.
      dynamic_sampling_max_retries: Bound on dynamic sampling's refills: while one batch fills, at most this many batches' worth (x runtime.prompts_per_step) of zero-signal groups are dropped (verl's max_num_gen_batches); past it, zero-signal groups fill the batch as they come (they train with advantage 0) and are counted as zero_signal_groups_kept.
      temperature: Sampling temperature the rollout used; log-probs are computed from logits / temperature.
      loss_agg: 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum' over a mini-batch.
      micro_batches: Gradient-accumulation micro-batches per optimizer update (lax.scan).
      remat: Activation rematerialization per decoder layer in the training forward: 'none' (keep all activations), 'full' (keep each layer's input, recompute the layer in the backward pass), 'dots_saveable' (keep all matmul outputs, attention scores included) or 'dots_with_no_batch_dims_saveable' (keep the weight matmuls' outputs, recompute attention). Same values and gradients; less memory for more FLOPs.
      logits_chunk_tokens: Tokens per device whose logits exist at once when the learner scores targets: log-probs/entropy are computed from the final hidden states in chunks of positions (all rows of a micro-batch) with the lm_head recomputed in the backward pass, so peak logits memory is ~ logits_chunk_tokens x vocab x 4 bytes (x3 in the backward) instead of rows x seq_len x vocab x 4. 0 = one chunk (full f32[B, T, V] logits).
      attention_impl: Training attention: 'dense' (f32[B, H, T, T] scores; fine up to a few K tokens per row), 'chunked' (portable: attention_chunk query rows at a time, each rematerialised, so f32[B, H, attention_chunk, T] at most; needed for 16K-token rows), 'flash' (portable blockwise attention with a hand-written backward: blocks of attention_chunk tokens, masked future blocks skipped, about half of chunked's attention FLOPs), 'pallas_gpu' (JAX's Pallas flash-attention kernel with segment ids; GPU only), 'tokamax' (tokamax's flash attention: Mosaic GPU on Hopper/Blackwell, Triton on other GPUs; pip install tokamax) or 'splash' (JAX's TPU splash attention; TPU only); 'auto' = 'splash' on TPU, 'tokamax' on GPU when installed (else 'pallas_gpu'), 'dense' on CPU. Same values to float rounding.
      attention_chunk: Query rows per chunk for attention_impl='chunked'; block size for 'flash'.
      mini_batches: Optimizer updates per epoch over one `Learner.step` batch.
      ppo_epochs: Passes over one `Learner.step` batch.
      critic: 'none', 'shared' (value head on the actor trunk) or 'separate' (its own model).
      ref_path: HF directory of a separate reference model; None = frozen copy of the initial actor params.
      max_consecutive_skips: This many consecutive non-finite (skipped) updates raise an error.
      checkpoint_dir: Orbax checkpoint directory; None disables checkpointing (in a run, finalize defaults it to <runtime.run_dir>/checkpoints).
      keep_checkpoints: Number of checkpoints kept on disk.
      async_checkpoint: Write checkpoints in the background (orbax async).
      seq_len_buckets: Allowed padded sequence lengths (sorted); a batch is padded to the smallest that fits.
      pad_token_id: Token id used for padding.
      balance_tokens: Order each mini-batch's rows so the data-parallel ranks get near-equal token counts (equal row counts; balanced greedily, Karmarkar-Karp style); acts only on meshes with more than one data-parallel rank.
      pack_length: None (default): set at finalize to rollout.max_total_len, the longest possible trajectory (a LearnerSection used without the whole config treats None as 0). 0: one trajectory per row, padded to a seq_len_bucket. > 0: rows of exactly this many tokens, each holding several trajectories back to back (first-fit decreasing; attention stays within a trajectory), so a long-tail batch does not pay for padding every row to its longest response. Must be >= the longest trajectory (prompt + response).
      pack_shrink: Packed rows as short as the step allows: the smallest seq_len_bucket below pack_length that holds the step's longest trajectory, else pack_length. Row attention costs the square of the row's length, so a long-tail task's common steps, whose longest trajectory is short, train on many short rows instead of a few long ones (the demo: 20-33% off a learner step whose trajectories fit 64 tokens, rows of 64 against 192). Each such length is one more set of row-count shapes for learner warm-up to compile. False (default: end to end on the demo, sync trained 10% faster and laminar no faster, for a cold start ~90 s longer): rows of exactly pack_length.
      pack_rows_per_doubling: Row-count buckets of a packed batch per doubling: 1 = powers of two (each mini-batch 1, 2, 4, 8, ... rows, times row_multiple / mini_batches), 2 = those and the midpoints (3, 6, 12, ...), more = finer. A batch takes the smallest bucket its fullest mini-batch fits, so finer buckets pad fewer rows and give learner warm-up more shapes to compile (one prepare pass and one update program each).
      mini_batch_draw: How a packed step's trajectories are drawn into its mini-batches. 'stratified': longest first, each run of mini_batches trajectories is dealt one to each mini-batch at random, so every mini-batch is still a random draw and all need about the same number of rows (fewer padded rows). 'random': consecutive parts of a random permutation. Unpacked batches shuffle rows freely either way.
      compile_ahead: 'all': learner warm-up compiles the prepare pass and the update program for every batch shape a step can take (each seq_len_bucket; packed: each row bucket at each row length), so no training step pays XLA compilation. 'none': each shape compiles when a step first needs it, so a start compiles only the shapes the run meets (a long-tail task's rare large row buckets never), and that step waits for its compile (with the persistent compilation cache holding it: tracing, lowering and the cache read).
      publish_timeout_s: Longest wait for the previous weight copy to reach host memory.
      publish_snapshot: Publish from a snapshot of the policy weights that a small program writes into the devices' pinned host memory (a DMA at the link's speed, where copying device arrays into unpinned numpy memory is staged by the host and many times slower), so the next step's donating update need not wait and the publish only wraps host memory. Devices without pinned host memory snapshot into device memory (one more copy of the actor weights) and the host copy reads that. None = on where the learner's devices are accelerators, off on CPU (there the host copy is a view).
      seed: Seed of the learner RNG and of the mini-batch shuffles.
      lora: Low-rank adapters on a frozen base (rank 0 = full fine-tuning); see laminar_jax.model.lora.
    """

    lr: float = 1e-6
    master_weights: bool = True
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: Optional[float] = 1.0
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    adv_estimator: AdvEstimator = "grpo"
    norm_adv_by_std: bool = True
    whiten_advantages: bool = True
    adv_eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 1.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: Optional[float] = None
    vf_coef: float = 0.5
    value_clip: Optional[float] = 0.2
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_mode: Literal["loss", "reward", "none"] = "none"
    off_policy: OffPolicy = "none"
    tis_cap: float = 2.0
    ratio_level: RatioLevel = "token"
    seq_is_ratio: Literal["geometric", "product"] = "product"
    seq_is_high: float = 2.0
    seq_is_low: Optional[float] = None
    dynamic_sampling: bool = False
    dynamic_sampling_max_retries: int = 10
    temperature: float = 1.0
    loss_agg: LossAgg = "token-mean"
    micro_batches: int = 1
    remat: Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"] = "none"
    logits_chunk_tokens: int = 2048
    attention_impl: Literal["auto", "dense", "chunked", "flash", "pallas_gpu", "tokamax", "splash"] = "dense"
    attention_chunk: int = 1024
    mini_batches: int = 1
    ppo_epochs: int = 1
    critic: Literal["none", "shared", "separate"] = "none"
    ref_path: Optional[str] = None
    max_consecutive_skips: int = 3
    checkpoint_dir: Optional[str] = None
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    seq_len_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    pad_token_id: int = 0
    pack_length: Optional[int] = None
    balance_tokens: bool = True
    pack_shrink: bool = False
    pack_rows_per_doubling: int = 2
    mini_batch_draw: Literal["stratified", "random"] = "stratified"
    compile_ahead: Literal["all", "none"] = "all"
    publish_timeout_s: float = 300.0
    publish_snapshot: Optional[bool] = None
    seed: int = 0
    lora: LoRASection = LoRASection()

    @property
    def use_kl(self) -> bool:
        return self.kl_mode != "none" and self.kl_coef != 0.0

    def validate(self, prefix: str) -> None:
        expect(self.lr > 0, f"{prefix}.lr", self.lr, "> 0")
        expect(self.warmup_steps >= 0, f"{prefix}.warmup_steps", self.warmup_steps, ">= 0")
        expect(self.total_steps > 0, f"{prefix}.total_steps", self.total_steps, "> 0")
        expect(0.0 <= self.min_lr_ratio <= 1.0, f"{prefix}.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        expect(self.grad_clip is None or self.grad_clip > 0, f"{prefix}.grad_clip", self.grad_clip, "> 0 or None")
        expect(0.0 <= self.b1 < 1.0, f"{prefix}.b1", self.b1, "in [0, 1)")
        expect(0.0 <= self.b2 < 1.0, f"{prefix}.b2", self.b2, "in [0, 1)")
        expect(self.adv_estimator != "gae" or self.critic != "none", f"{prefix}.adv_estimator",
               self.adv_estimator, "'grpo' or 'rloo' when critic='none' (GAE needs a value model)")
        expect(0.0 <= self.gamma <= 1.0, f"{prefix}.gamma", self.gamma, "in [0, 1]")
        expect(0.0 <= self.lam <= 1.0, f"{prefix}.lam", self.lam, "in [0, 1]")
        expect(0.0 <= self.clip_eps_low < 1.0, f"{prefix}.clip_eps_low", self.clip_eps_low, "in [0, 1)")
        expect(self.clip_eps_high >= 0.0, f"{prefix}.clip_eps_high", self.clip_eps_high, ">= 0")
        expect(self.dual_clip_c is None or self.dual_clip_c > 1.0, f"{prefix}.dual_clip_c",
               self.dual_clip_c, "> 1 or None")
        expect(self.value_clip is None or self.value_clip > 0, f"{prefix}.value_clip", self.value_clip, "> 0 or None")
        expect(self.kl_coef >= 0.0, f"{prefix}.kl_coef", self.kl_coef, ">= 0")
        expect(self.tis_cap >= 1.0, f"{prefix}.tis_cap", self.tis_cap, ">= 1")
        self._validate_corrections(prefix)
        expect(self.temperature > 0, f"{prefix}.temperature", self.temperature, "> 0")
        for name in ("micro_batches", "mini_batches", "ppo_epochs", "max_consecutive_skips", "keep_checkpoints"):
            v = getattr(self, name)
            expect(v >= 1, f"{prefix}.{name}", v, ">= 1")
        expect(self.logits_chunk_tokens >= 0, f"{prefix}.logits_chunk_tokens", self.logits_chunk_tokens,
               ">= 0 (0 = unchunked)")
        remats = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
        expect(self.remat in remats, f"{prefix}.remat", self.remat, f"one of {list(remats)}")
        impls = ("auto", "dense", "chunked", "flash", "pallas_gpu", "tokamax", "splash")
        expect(self.attention_impl in impls, f"{prefix}.attention_impl", self.attention_impl, f"one of {list(impls)}")
        expect(self.attention_chunk >= 1, f"{prefix}.attention_chunk", self.attention_chunk, ">= 1")
        expect(self.pack_length is None or self.pack_length >= 0, f"{prefix}.pack_length", self.pack_length,
               "None (= rollout.max_total_len) or >= 0 (0 disables packing)")
        expect(self.pack_rows_per_doubling >= 1, f"{prefix}.pack_rows_per_doubling", self.pack_rows_per_doubling,
               ">= 1 (1 = powers of two)")
        draws = ("stratified", "random")
        expect(self.mini_batch_draw in draws, f"{prefix}.mini_batch_draw", self.mini_batch_draw,
               f"one of {list(draws)}")
        expect(self.compile_ahead in ("all", "none"), f"{prefix}.compile_ahead", self.compile_ahead,
               "one of ['all', 'none']")
        b = self.seq_len_buckets
        expect(len(b) > 0 and all(x > 1 for x in b) and list(b) == sorted(set(b)), f"{prefix}.seq_len_buckets",
               b, "a non-empty strictly increasing list of lengths > 1")
        expect(self.publish_timeout_s > 0, f"{prefix}.publish_timeout_s", self.publish_timeout_s, "> 0")
        expect(not self.lora.enabled or self.critic != "shared", f"{prefix}.lora.rank", self.lora.rank,
               f"0 with {prefix}.critic='shared' (the shared value head would stay frozen with the base)")


    def _validate_corrections(self, prefix: str) -> None:
        """Sequence-level corrections and dynamic sampling, and the settings they cannot combine with."""
        p = prefix
        offs = ("none", "tis", "decoupled") + SEQ_OFF_POLICY
        expect(self.off_policy in offs, f"{p}.off_policy", self.off_policy, f"one of {list(offs)}")
        expect(self.ratio_level in ("token", "sequence"), f"{p}.ratio_level", self.ratio_level,
               "one of ['token', 'sequence']")
        expect(self.seq_is_ratio in ("geometric", "product"), f"{p}.seq_is_ratio", self.seq_is_ratio,
               "one of ['geometric', 'product']")
        expect(self.seq_is_high >= 1.0, f"{p}.seq_is_high", self.seq_is_high, ">= 1")
        if self.seq_is_low is not None:
            expect(0.0 < self.seq_is_low <= 1.0, f"{p}.seq_is_low", self.seq_is_low, "in (0, 1] or None")
            expect(self.off_policy == "seq_mask", f"{p}.seq_is_low", self.seq_is_low,
                   f"None with {p}.off_policy={self.off_policy!r} (a lower band end acts only with 'seq_mask'; "
                   "'seq_tis' truncates from above)")
        if self.ratio_level == "sequence":
            # GSPO's ratio is one number per trajectory: it needs one advantage per trajectory, and its
            # objective averages over sequences.
            expect(self.adv_estimator in ("grpo", "rloo"), f"{p}.ratio_level", self.ratio_level,
                   f"'token' with {p}.adv_estimator={self.adv_estimator!r} (a sequence-level ratio needs one "
                   "advantage per trajectory; GAE's differ per token)")
            expect(self.critic == "none", f"{p}.ratio_level", self.ratio_level,
                   f"'token' with {p}.critic={self.critic!r} (GSPO is critic-free: the value model would be "
                   "trained and never used)")
            expect(self.loss_agg == "seq-mean-token-mean", f"{p}.ratio_level", self.ratio_level,
                   f"'token' with {p}.loss_agg={self.loss_agg!r} (GSPO's objective is the mean over sequences: "
                   "set loss_agg='seq-mean-token-mean')")
        expect(self.dynamic_sampling_max_retries >= 1, f"{p}.dynamic_sampling_max_retries",
               self.dynamic_sampling_max_retries, ">= 1")
        if self.dynamic_sampling:
            expect(self.adv_estimator in ("grpo", "rloo"), f"{p}.dynamic_sampling", self.dynamic_sampling,
                   f"False with {p}.adv_estimator={self.adv_estimator!r} (equal rewards leave a group without "
                   "signal only for the group estimators 'grpo' and 'rloo'; GAE's critic still learns from it)")


DEFAULT_RULES: tuple[str, ...] = (
    "vocab=tensor", "embed=fsdp", "heads=tensor", "kv_heads=tensor", "mlp=tensor", "norm=", "head_dim=")


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device mesh of the learner, axes ('data', 'fsdp', 'tensor').

    Attributes:
      data: Size of the pure data-parallel axis (-1 = fill with the remaining devices).
      fsdp: Size of the fully-sharded data-parallel axis (params sharded, batch split) (-1 = fill).
      tensor: Size of the tensor-parallel axis (-1 = fill).
      rules: Logical-axis rules 'logical=mesh_axis' ('logical=' replicates); a logical name without a rule is replicated.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rules: tuple[str, ...] = DEFAULT_RULES

    def validate(self, prefix: str) -> None:
        sizes = (self.data, self.fsdp, self.tensor)
        for name, v in zip(("data", "fsdp", "tensor"), sizes):
            expect(v == -1 or v >= 1, f"{prefix}.{name}", v, ">= 1 or -1 (fill)")
        expect(sum(v == -1 for v in sizes) <= 1, f"{prefix}.fsdp", sizes, "at most one axis set to -1")
        for i, r in enumerate(self.rules):
            name, sep, axis = r.partition("=")
            expect(bool(sep) and name.strip() != "" and axis.strip() in ("", "data", "fsdp", "tensor"),
                   f"{prefix}.rules[{i}]", r, "'logical=data|fsdp|tensor' or 'logical='")
