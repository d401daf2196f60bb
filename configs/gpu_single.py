"""One GPU: Qwen2.5-0.5B(-Instruct) GRPO on a math parquet set (verl layout), laminar mode.

python launch/run.py --config=configs/gpu_single.py \
    --config.model.path=/models/Qwen2.5-0.5B-Instruct --config.model.tokenizer=/models/Qwen2.5-0.5B-Instruct \
    --config.data.path=/data/gsm8k/train.parquet

Without model.path it builds the Qwen2.5-0.5B shapes with random weights (a systems smoke test).
"""

from laminar_jax.config import default_config


def get_config(variant: str = ""):
    c = default_config()
    c.model.preset = "qwen2.5-0.5b"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.rollout.dtype = "bfloat16"  # served and published in bfloat16; the learner trains float32 master weights

    c.data.source = "file"
    c.data.path = "data/math/train.parquet"
    c.data.max_prompt_tokens = 1024
    c.data.overlong = "filter"
    c.data.reward_workers = 4

    c.rollout.num_slots = 64
    c.rollout.page_size = 16
    c.rollout.num_pages = 64 * 160 + 1
    c.rollout.max_prompt_len = 1024
    c.rollout.max_new_tokens = 1536
    c.rollout.max_total_len = 2560
    # A decode step of this model is launch- and dispatch-bound on one GPU (3-4 ms at 64 rows on an
    # H200 against 0.2 ms of HBM time); 8 tokens per generate() call gave 1.42x the engine's tokens/s
    # there (docs/BENCHMARKS.md, "Decode on a GPU: HBM roofline").
    c.rollout.decode_steps_per_call = 8

    c.learner.adv_estimator = "grpo"
    c.learner.lr = 1e-6
    c.learner.clip_eps_low = 0.2
    c.learner.clip_eps_high = 0.28
    c.learner.off_policy = "tis"
    c.learner.loss_agg = "seq-mean-token-mean"
    # 8 packed rows of 2560 tokens per micro-batch at worst (every response at max length): ~24 GB of
    # activations; 16 rows (micro_batches=16) leave 7% of the GPU's 72 GB budget free beside the
    # server's weights and KV, under the 10% launch/plan.py memory asks for.
    c.learner.micro_batches = 32
    c.learner.seq_len_buckets = (512, 1024, 2048, 2560)
    # learner.pack_length defaults to rollout.max_total_len: pack the long-tail batch instead of padding it
    c.learner.remat = "dots_with_no_batch_dims_saveable"  # keep matmul outputs, recompute the rest
    c.learner.attention_impl = "auto"  # tokamax flash attention on GPU (pip install tokamax), else Pallas

    c.runtime.mode = "laminar"
    c.runtime.num_servers = 1  # colocated on the one GPU
    c.runtime.prompts_per_step = 32
    c.runtime.samples_per_prompt = 8
    c.runtime.total_steps = 500
    c.runtime.checkpoint_every = 25
    c.scheduler.max_batch = 64
    if variant:
        raise ValueError(f"configs/gpu_single.py: unknown variant {variant!r}")
    return c
