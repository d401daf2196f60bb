"""TPU slice: Qwen2.5-1.5B GRPO on a v5e-8 host (8 chips x 16 GB HBM, topology v5e:2x4), laminar
mode, local runtime.

The learner's mesh spans chips 0-3 (FSDP over 4); four rollout servers take chips 4-7, one each
(placement.learner_devices=4, colocate=False). A v5e chip has 16 GB: the 1.5B model's float32
master weights, AdamW moments and gradients (20 B per parameter with the micro-batch gradient,
7.7 GB over 4 chips) leave room for one 4K-token packed row per chip per micro-batch under
remat='full'; a server holds the bfloat16 weights (3.1 GB) and 7.5 GB of KV pages.

python launch/plan.py memory --config=configs/tpu_pod.py --gpu tpu-v5e
python launch/run.py --config=configs/tpu_pod.py \
    --config.model.path=/models/Qwen2.5-1.5B-Instruct --config.model.tokenizer=/models/Qwen2.5-1.5B-Instruct \
    --config.data.path=/data/gsm8k/train.parquet
"""

from laminar_jax.config import default_config


def get_config(variant: str = ""):
    c = default_config()
    c.model.preset = "qwen2.5-1.5b"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"

    c.data.source = "file"
    c.data.path = "data/math/train.parquet"
    c.data.max_prompt_tokens = 1024
    c.data.overlong = "filter"
    c.data.reward_workers = 8

    c.placement.learner_devices = 4
    c.placement.rollout_tp = 1
    c.placement.colocate = False
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1

    c.rollout.num_slots = 64
    c.rollout.page_size = 64
    c.rollout.num_pages = 64 * 64 + 1
    c.rollout.max_prompt_len = 1024
    c.rollout.max_new_tokens = 3072
    c.rollout.max_total_len = 4096

    c.learner.adv_estimator = "grpo"
    c.learner.lr = 1e-6
    c.learner.clip_eps_low = 0.2
    c.learner.clip_eps_high = 0.28
    c.learner.off_policy = "tis"
    c.learner.loss_agg = "token-mean"
    c.learner.micro_batches = 64  # 256 trajectories per step: one packed 4K-token row per learner chip per micro-batch
    c.learner.seq_len_buckets = (1024, 2048, 4096)
    c.learner.remat = "full"
    c.learner.attention_impl = "flash"
    c.learner.attention_chunk = 512
    c.learner.logits_chunk_tokens = 1024  # 3 x 1024 x 151936 float32 logits: 1.9 GB per chip

    c.runtime.kind = "local"
    c.runtime.mode = "laminar"
    c.runtime.prompts_per_step = 32
    c.runtime.samples_per_prompt = 8
    c.runtime.total_steps = 1000
    c.runtime.checkpoint_every = 25
    c.scheduler.max_batch = 64
    if variant:
        raise ValueError(f"configs/tpu_pod.py: unknown variant {variant!r}")
    return c
