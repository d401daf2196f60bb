"""CPU demo: tiny Llama-style model, synthetic task with heavily skewed response lengths.

python launch/run.py --config=configs/demo.py            # laminar mode, under a minute cold on 2 cores
python launch/run.py --config=configs/demo.py:short      # a short smoke variant (tests use it)
python launch/run.py --config=configs/demo.py:lora       # rank-32 LoRA adapters on the frozen base
python launch/run.py --config=configs/demo.py --config.runtime.mode=sync
"""

from laminar_jax.config import default_config


def get_config(variant: str = ""):
    c = default_config()
    c.model.preset = "tiny"
    c.model.tokenizer = "builtin"

    c.data.source = "synthetic_skew"
    c.data.max_prompt_tokens = 32  # = rollout.max_prompt_len; the task's prompts are < 24 tokens
    c.data.reward_workers = 1
    c.data.reward_mode = "thread"  # the synthetic reward is cheap; spare the 2 cores

    c.rollout.num_slots = 16
    c.rollout.page_size = 16
    c.rollout.num_pages = 16 * 10 + 1
    c.rollout.max_prompt_len = 32
    c.rollout.max_new_tokens = 144  # the task's longest response is 128 characters + EOS
    c.rollout.max_total_len = 192
    c.rollout.temperature = 1.0
    # 8 tokens per slot per generate() call: each call's Python (dispatch, reading outputs, admission)
    # is paid once per 8 tokens; laminar spent ~7% less CPU per trained token than at 4 (at 16, finished
    # sequences held their slots longer and the gain was gone).
    # docs/notes/2026-11-rl-loop-on-two-cores.md.
    c.rollout.decode_steps_per_call = 8

    c.learner.adv_estimator = "grpo"
    c.learner.lr = 1e-3
    c.learner.mini_batches = 4  # 4 optimizer updates per step
    c.learner.clip_eps_low = 0.2
    c.learner.clip_eps_high = 0.28  # clip-higher, as in Laminar's set-up
    c.learner.off_policy = "tis"
    c.learner.loss_agg = "seq-mean-token-mean"  # long responses do not drown short ones
    c.learner.seq_len_buckets = (64, 128, 192, 256)
    # learner.pack_length is left to default to rollout.max_total_len: the long-tail batch is packed, not padded
    c.learner.grad_clip = 1.0

    c.runtime.mode = "laminar"
    c.runtime.num_servers = 2
    c.runtime.prompts_per_step = 8
    c.runtime.samples_per_prompt = 8
    c.runtime.total_steps = 80
    # A brief supervised warm-start (60 steps) teaches the format; RL then does the rest.
    c.runtime.sft_warmup_steps = 60
    # Evaluation on 16 held-out prompts of the task (their own random stream) before the first step,
    # every 20 steps and at the end, on the rollout servers beside training: eval.jsonl, TensorBoard
    # eval/*, the summary. The figure that moves is `reward` (eval_reward: the greedy response's
    # graded reward, the one training uses); exact matches (acc, pass@4) stay rare for a model this
    # small in 80 steps. The round before training is the warm-started policy's, the baseline the
    # rise is read against: the greedy reward at step 20 already varies from run to run with how far
    # the first steps' samples took it.
    c.data.val_size = 16
    c.runtime.eval_every = 20
    c.runtime.eval_before_train = True
    c.runtime.eval_samples = 4
    c.runtime.eval_k = 4
    c.buffer.max_staleness = None  # laminar: unbounded, back-pressure via max_inflight_batches

    c.scheduler.max_batch = 16
    # The learner publishes every ~0.1-0.3 s here, faster than the long tail drains: a server keeps
    # admitting until it is 2 versions behind, and repack plans often enough to matter.
    c.scheduler.admit_lag = 1
    c.scheduler.repack_interval_s = 0.1
    if variant == "":
        # Compile each learner batch shape when a step first meets it: the long-tail task meets few
        # of the shapes compile_ahead='all' builds before the first step, so a cold start is shorter.
        c.learner.compile_ahead = "none"
    elif variant == "short":
        c.runtime.samples_per_prompt = 4
        c.runtime.total_steps = 4
        c.runtime.sft_warmup_steps = 20
        c.runtime.progress = False
        c.runtime.eval_every = 0  # tests that want eval rounds turn them on
        c.runtime.eval_before_train = False
    elif variant == "lora":
        _lora(c)
    elif variant:
        raise ValueError(f"configs/demo.py: unknown variant {variant!r} (known: '', 'short', 'lora')")
    return c


def _lora(c) -> None:
    """demo.py:lora: the same run training rank-32 adapters on every projection, attention and MLP,
    of the frozen (supervised warm-started) base; each version published carries only the adapters.

    Adapters take a larger learning rate than full fine-tuning (AdamW moves B and A by about lr per
    update, and their product, scaled by alpha / rank, moves the weight by less): 3e-3 against the
    demo's 1e-3 (1e-2 diverges within 30 steps). The tied embedding and the norms stay frozen, so
    the adapters carry the whole change: rank 32 (the k/v projections' full width) raised the
    held-out reward more than rank 8 did; alpha 16 keeps alpha * lr, the adapters' early pace, as
    at rank 8. On this 64-wide model a version is 311 KB of float32 adapters against the model's
    427 KB; on a 7B model rank 16 is about 1%.
    """
    c.learner.compile_ahead = "none"
    c.learner.lr = 3e-3
    c.learner.lora.rank = 32
    c.learner.lora.alpha = 16.0
