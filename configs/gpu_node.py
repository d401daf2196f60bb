"""One host, several accelerators: an 8-GPU node, Qwen2.5-7B GRPO, laminar mode, local runtime.

The learner's mesh spans GPUs 0-3 (FSDP over 4); four rollout servers take GPUs 4-7, one each
(placement.learner_devices=4, colocate=False; runtime.num_servers is derived: (8 - 4) / 1).
Check the per-GPU memory first:

python launch/plan.py memory --config=configs/gpu_node.py --gpu h100
python launch/run.py --config=configs/gpu_node.py \
    --config.model.path=/models/Qwen2.5-7B --config.model.tokenizer=/models/Qwen2.5-7B \
    --config.data.path=/data/dapo_math_17k.parquet

Variants:
  :32b   Qwen2.5-32B on an 8 x H200 node: the learner over all 8 GPUs (FSDP 8) and one rollout
         server at TP 8 colocated with it. The learner keeps float32 master weights, AdamW moments
         and gradients (20 bytes per parameter with the micro-batch gradient: 82 GB per GPU over 8;
         in bfloat16, updates of lr 1e-6 round to nothing), so it cannot leave GPUs to the server:
         over 4 GPUs that state alone is 164 GB per GPU. The server's bfloat16 weights (8.2 GB per
         GPU) and a smaller page pool (640 pages of 64 tokens, 1.3 GB per GPU) fit beside it when
         XLA's pool takes 95% of each GPU (runtime.gpu_memory_fraction): launch/plan.py memory
         gives 120.4 GB of 133.9 GB.
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
    c.rollout.dtype = "bfloat16"  # served and published in bfloat16; the learner trains float32 master weights

    c.data.source = "file"
    c.data.path = "data/dapo_math_17k.parquet"
    c.data.max_prompt_tokens = 2048
    c.data.overlong = "filter"
    c.data.reward_workers = 8

    c.placement.learner_devices = 4
    c.placement.rollout_tp = 1
    c.placement.colocate = False
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1

    # Per rollout GPU: 15.2 GB of bfloat16 weights + 37.6 GB of bf16 KV (10240 pages x 64 tokens).
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
    c.learner.attention_impl = "auto"  # tokamax's flash attention on GPU (pip install tokamax), else Pallas
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
        c.placement.learner_devices = None
        c.placement.colocate = True
        c.placement.rollout_tp = 8  # 8 KV heads: 1 per GPU
        c.runtime.num_servers = 1
        c.runtime.gpu_memory_fraction = 0.95
        c.rollout.num_slots = 32
        # beside the learner's state on the same GPU, within the plan's 10% margin (launch/plan.py memory):
        # 5 whole 8K-token sequences, more of the long tail's shorter ones
        c.rollout.num_pages = 640 + 1
        # 8K-token trajectories: a 10K-token row's activations (the stacked residuals and the layer the
        # backward pass recomputes) leave the 32B learner under the plan's 10% margin
        c.rollout.max_new_tokens = 6144
        c.rollout.max_total_len = 8192
        c.learner.seq_len_buckets = (2048, 4096, 8192)
        c.learner.micro_batches = 64  # one packed 8K-token row per learner GPU per micro-batch
        c.learner.logits_chunk_tokens = 256  # the log-prob chunk within the plan's 10% margin (launch/plan.py memory)
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
        c.learner.attention_impl = "auto"
        c.runtime.prompts_per_step = 32
    elif variant:
        raise ValueError(f"configs/gpu_node.py: unknown variant {variant!r} (known: '', '32b', '0.5b')")
    return c
