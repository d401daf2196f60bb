"""GPU pod: Qwen2.5-7B GRPO on DAPO-Math-style data, 16K responses, 16 samples per prompt (Ray).

Mirrors the set-up in the Laminar paper: 512 prompts x 16 samples per iteration,
mini-batch 2048 trajectories (128 prompts) per learner step, clip-higher 0.2/0.28, no importance
correction, max prompt 2K, max response 16K. See docs/DEPLOY.md for starting the cluster.

# on the Ray head host (the learner runs in the driver process, so start it where the learner GPUs are):
python launch/run.py --config=configs/gpu_pod.py --config.runtime.address=auto \
    --config.model.path=/models/Qwen2.5-7B --config.data.path=gs://bucket/dapo_math_17k.parquet
"""

from laminar_jax.config import default_config


def get_config(variant: str = ""):
    c = default_config()
    c.model.preset = "qwen2.5-7b"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.rollout.dtype = "bfloat16"  # served and published in bfloat16; the learner trains float32 master weights

    c.data.source = "file"
    c.data.path = "data/dapo_math_17k.parquet"
    c.data.max_prompt_tokens = 2048
    c.data.reward_workers = 32

    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1

    # Per rollout GPU: 15.2 GB of bfloat16 weights (rollout.dtype) + 37.6 GB of bf16 KV (10240 pages x
    # 64 tokens); 256 x 72 pages (67.6 GB of KV) did not fit beside float32 weights on an 80 GB H100.
    c.rollout.num_slots = 128
    c.rollout.page_size = 64
    c.rollout.num_pages = 128 * 80 + 1
    c.rollout.max_prompt_len = 2048
    c.rollout.max_new_tokens = 16384
    c.rollout.max_total_len = 18432
    # 16 tokens per generate() call: one host round trip (dispatch, then the host reads the tokens)
    # per 16 decode steps, with sampling and stop checks on the device; a retiring sequence idles
    # its slot at most 15 steps of responses thousands of tokens long.
    c.rollout.decode_steps_per_call = 16

    c.learner.adv_estimator = "grpo"
    c.learner.lr = 1e-6
    c.learner.clip_eps_low = 0.2
    c.learner.clip_eps_high = 0.28
    c.learner.off_policy = "none"
    c.learner.loss_agg = "token-mean"
    # 2 packed 18K-token rows per learner GPU per micro-batch: the backward pass holds one layer's
    # activations whole beside the stacked residuals (launch/plan.py memory)
    c.learner.micro_batches = 128
    c.learner.seq_len_buckets = (4096, 8192, 12288, 18432)
    # learner.pack_length defaults to rollout.max_total_len: pack the long-tail batch instead of padding it
    c.learner.remat = "full"  # 7B at 16K tokens per row: recompute each layer in the backward pass
    # Dense attention would hold f32[28, 18432, 18432] scores (38 GB) per row and layer; 'auto' runs
    # tokamax's flash attention on GPU (Mosaic GPU on Hopper; pip install tokamax), which keeps no
    # scores and skips masked blocks ('flash' is the portable fallback).
    c.learner.attention_impl = "auto"
    c.learner.attention_chunk = 1024

    c.relay.chunk_bytes = 32 << 20

    c.runtime.kind = "ray"
    c.runtime.mode = "laminar"
    c.runtime.num_servers = 96
    c.runtime.prompts_per_step = 128
    c.runtime.samples_per_prompt = 16
    c.runtime.total_steps = 2000
    c.runtime.checkpoint_every = 20
    c.scheduler.max_batch = 128
    c.scheduler.repack_interval_s = 5.0
    if variant:
        raise ValueError(f"configs/gpu_pod.py: unknown variant {variant!r}")
    return c
