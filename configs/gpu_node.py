"""One host, several accelerators: an 8-GPU node, Qwen2.5-7B GRPO, laminar mode, local runtime.

The learner's mesh spans GPUs 0-3 (FSDP over 4); four rollout servers take GPUs 4-7, one each
(placement.learner_devices=4, colocate=False; runtime.num_servers is derived: (8 - 4) / 1).
Check the per-GPU memory first:

python launch/plan.py memory --config=configs/gpu_node.py --gpu h100
python launch/run.py --config=configs/gpu_node.py \
    --config.model.path=/models/Qwen2.5-7B --config.model.tokenizer=/models/Qwen2.5-7B \
    --config.data.path=/data/dapo_math_17k.parquet

Variants:
  :32b   Qwen2.5-32B on an 8 x H200 node: learner over 4, two rollout servers at TP 2 (GPUs 4-5, 6-7).
         Parameters and AdamW state in bfloat16 (8 bytes per parameter): in float32 the 32B training
         state alone is 131 GB per learner GPU (the planner says so).
  :0.5b  Qwen2.5-0.5B shapes, learner and one server colocated on whatever devices the host has
         (one GPU: the benchmark set-up).
Without model.path it builds the shapes with random weights (a systems test).
"""

from laminar_jax.config import default_config


def get_config(variant: str = ""):
    c = default_config()
    c.model.preset = "qwen2.5-7b"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"

    c.data.source = "file"
    c.data.path = "data/dapo_math_17k.parquet"
    c.data.max_prompt_tokens = 2048
    c.data.overlong = "filter"
    c.data.reward_workers = 8

    c.placement.learner_devices = 4
    c.placement.rollout_tp = 1
    c.placement.colocate = False
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1

    # Per rollout GPU: 30.5 GB of float32 weights + 37.6 GB of bf16 KV (10240 pages x 64 tokens).
    c.rollout.num_slots = 128
    c.rollout.page_size = 64
    c.rollout.num_pages = 128 * 80 + 1
    c.rollout.max_prompt_len = 2048
    c.rollout.max_new_tokens = 8192
    c.rollout.max_total_len = 10240
    # 16 tokens per generate() call: one host round trip (dispatch, then the host reads the tokens)
    # per 16 decode steps, with sampling and stop checks on the device; a retiring sequence idles
    # its slot at most 15 steps of responses thousands of tokens long.
    c.rollout.decode_steps_per_call = 16

    c.learner.adv_estimator = "grpo"
    c.learner.lr = 1e-6
    c.learner.clip_eps_low = 0.2
    c.learner.clip_eps_high = 0.28
    c.learner.off_policy = "tis"
    c.learner.loss_agg = "token-mean"
    c.learner.micro_batches = 64  # 512 trajectories per step: 2 packed rows per learner GPU per micro-batch
    c.learner.seq_len_buckets = (2048, 4096, 8192, 10240)
    c.learner.remat = "full"
    c.learner.attention_impl = "flash"
    c.learner.attention_chunk = 1024

    c.runtime.kind = "local"
    c.runtime.mode = "laminar"
    c.runtime.prompts_per_step = 64
    c.runtime.samples_per_prompt = 8
    c.runtime.total_steps = 1000
    c.runtime.checkpoint_every = 25
    c.scheduler.max_batch = 128
    c.scheduler.repack_interval_s = 2.0
    if variant == "32b":
        c.model.preset = "qwen2.5-32b"
        c.model.param_dtype = "bfloat16"
        c.placement.rollout_tp = 2  # 8 KV heads: 4 per GPU
        # Per rollout GPU: 32.8 GB of weights (half) + 85.9 GB of KV (half of 10240 pages x 64 tokens, 64 layers).
        c.rollout.num_slots = 96
        c.learner.micro_batches = 128  # one packed 10K-token row per learner GPU per micro-batch
    elif variant == "0.5b":
        c.model.preset = "qwen2.5-0.5b"
        c.placement.learner_devices = None
        c.placement.colocate = True
        c.runtime.num_servers = 1
        c.rollout.num_slots = 64
        c.rollout.page_size = 16
        c.rollout.num_pages = 64 * 160 + 1
        c.rollout.max_prompt_len = 1024
        c.rollout.max_new_tokens = 1536
        c.rollout.max_total_len = 2560
        c.data.max_prompt_tokens = 1024
        c.learner.micro_batches = 16  # as configs/gpu_single.py: the worst-case micro-batch fits an 80 GB GPU
        c.learner.seq_len_buckets = (512, 1024, 2048, 2560)
        c.learner.remat = "dots_with_no_batch_dims_saveable"
        c.learner.attention_impl = "dense"
        c.runtime.prompts_per_step = 32
    elif variant:
        raise ValueError(f"configs/gpu_node.py: unknown variant {variant!r} (known: '', '32b', '0.5b')")
    return c
