"""Config section for the runtime (wiring, mode, run length)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from laminar_jax.cpu import host_malloc
from laminar_jax.configlib import expect

MODES = ("sync", "one_step", "stream", "laminar", "inflight")
LOGGERS = ("tensorboard", "wandb")


@dataclasses.dataclass(frozen=True)
class RuntimeSection:
    """How the planes are wired and how long the run lasts.

    Attributes:
      kind: 'local' (threads in one process, the embedded default) or 'ray' (one actor per role).
      mode: 'sync', 'one_step', 'stream', 'laminar' or 'inflight' (see docs/ARCHITECTURE.md, "Modes"; inflight: docs/INFLIGHT.md).
      run_dir: Run directory (resolved config, checkpoints, weight store, TensorBoard, timeline). None: runs/<timestamp>.
      num_servers: Number of rollout servers.
      server_processes: kind='local' only: each rollout server runs in a child process of its own (a fresh interpreter; buffer calls over a socket pair, weights pulled from an in-process relay on loopback) instead of a thread of the learner's process, so the roles share neither the interpreter lock nor XLA's CPU pool. CPU backends, placement.rollout_tp=1.
      prompts_per_step: Prompts (GRPO groups) per learner step.
      samples_per_prompt: Responses generated per prompt (the GRPO group size).
      total_steps: Learner steps to run.
      max_inflight_batches: Back-pressure for 'laminar' and 'inflight': at most this many batches of prompts dispatched and not yet trained on.
      sft_warmup_steps: Supervised warm-start steps on the task's reference responses before RL (0 = none).
      sft_lr: Learning rate of the warm-start.
      checkpoint_every: Learner steps between checkpoints (0 = only at the end).
      progress: Show the live progress display.
      timeline: Write the slot-occupancy timeline PNG at the end.
      max_wall_s: Stop (checkpointed, resumable) after this many seconds of RL; None = run total_steps.
      wait_timeout_s: Upper bound on any single wait inside the runtime; exceeded waits fail the run naming what they waited for.
      address: Ray cluster address for kind='ray' (None starts a local cluster).
      learner_processes: Learner processes joined by jax.distributed into one mesh (kind='ray' only; 1 = the learner runs in the driver process). mesh spans every process's devices.
      learner_gpus_per_process: GPUs each learner process (Ray actor) asks for when the cluster has GPUs (learner_processes > 1).
      cpu_threads: XLA's CPU intra-op thread pool size in the run's processes (XLA's PJRT_NPROC; set by the entry point before JAX starts): 0 = XLA's default, one thread per core. At small shapes on a few cores, 1 (with cpu_async_dispatch=False) saves CPU per trained token while the run's own threads (learner, servers) share the cores, for fewer tokens per second. CPU computations only.
      cpu_async_dispatch: JAX's asynchronous dispatch of CPU computations (jax_cpu_enable_async_dispatch). False starts each CPU computation on the thread that calls it, which costs less CPU per call; XLA's executor still hands ops of a larger program (more than 8 ops, a buffer over 512 bytes: the learner's passes, prefill) to the pool, and a program whose op finished there goes on there, so with one pool thread the learner's and the servers' calls queue for it. CPU computations only.
      matmul_precision: Precision of float32 matrix products in the run's processes (JAX's jax_default_matmul_precision, set by the entry point). 'highest' computes them in float32; 'default' lets the backend round the operands (TF32 on NVIDIA GPUs from Ampere on, one bfloat16 pass on TPUs), faster and ~1e-3 off; 'high' is in between on TPUs. 'auto': 'highest' when model.dtype is float32, else 'default' (a bfloat16 model's float32 products are its attention's). The CPU is unaffected.
      gpu_memory_fraction: Fraction of each GPU's memory XLA's allocator takes for the run's processes (XLA_PYTHON_CLIENT_MEM_FRACTION, with XLA_PYTHON_CLIENT_PREALLOCATE=true: one pool taken at start), set by every process that runs a role before JAX starts. The rest stays for the CUDA context, cuBLAS/cuDNN workspaces and NCCL; launch/plan.py memory budgets each GPU at this fraction of its memory.
      host_malloc: How the run's processes' C allocator (glibc) returns host memory (set by the entry point): 'keep' serves every block from its heaps and keeps freed memory, so XLA:CPU's per-call buffers reuse pages instead of faulting fresh ones in (~11M page faults and 17% of a CPU demo run's CPU in the kernel otherwise; resident memory stays at its peak); 'system' leaves glibc's defaults. See laminar_jax/cpu/host_malloc.py.
      compilation_cache_dir: JAX persistent compilation cache directory (~ and $VARS expanded): a second run with the same shapes loads its compiled programs instead of compiling them. Empty string turns it off.
      eval_every: Learner steps between evaluations on the held-out prompts (data.val_files / data.val_size), run on the rollout servers; the last step is evaluated too. 0 = no evaluation during training.
      eval_before_train: Also evaluate the starting policy, before the first step.
      eval_samples: Sampled responses per eval prompt (at eval_temperature) for pass@k, besides the one greedy response; 0 = greedy only.
      eval_k: The k of pass@k (<= eval_samples).
      eval_max_prompts: Evaluate at most this many held-out prompts (the first ones, in file order); 0 = all.
      eval_temperature: Sampling temperature of the eval_samples responses.
      eval_correct_threshold: A response counts as correct (accuracy, pass@k) when its reward is >= this.
      loggers: Where scalars go besides metrics.jsonl: 'tensorboard' (tb/ in the run directory) and/or 'wandb' (Weights & Biases; pip install -e ".[wandb]"; WANDB_MODE=offline logs under the run directory).
      wandb_project: The Weights & Biases project of runs logged with loggers=['wandb', ...].
      profile: Account for the process's CPU time in the RL window (decode, learner passes, publish, pulls, rewards, dispatch, Python and XLA threads, GIL wait; monitor/profile.py): the summary gets a 'profile' block. Local runtime only; the learner waits for each pass inside its phase.
      learner_resource: Custom Ray resource each learner process also asks one unit of (e.g. 'learner_host', given to learner hosts by `ray start --resources`), which places learner processes on those hosts; None = anywhere with free resources.
    """

    kind: Literal["local", "ray"] = "local"
    mode: Literal["sync", "one_step", "stream", "laminar", "inflight"] = "laminar"
    run_dir: Optional[str] = None
    num_servers: int = 2
    server_processes: bool = False
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    total_steps: int = 20
    max_inflight_batches: int = 2
    sft_warmup_steps: int = 0
    sft_lr: float = 3e-3
    checkpoint_every: int = 0
    progress: bool = True
    timeline: bool = True
    max_wall_s: Optional[float] = None
    wait_timeout_s: float = 600.0
    address: Optional[str] = None
    learner_processes: int = 1
    learner_gpus_per_process: int = 1
    learner_resource: Optional[str] = None
    compilation_cache_dir: str = "~/.cache/laminar_jax/jax"
    matmul_precision: Literal["auto", "highest", "high", "default"] = "auto"
    cpu_threads: int = 0
    cpu_async_dispatch: bool = True
    host_malloc: Literal["keep", "system"] = "keep"
    gpu_memory_fraction: float = 0.9
    eval_every: int = 0
    eval_before_train: bool = False
    eval_samples: int = 4
    eval_k: int = 4
    eval_max_prompts: int = 0
    eval_temperature: float = 1.0
    eval_correct_threshold: float = 1.0
    loggers: tuple[str, ...] = ("tensorboard",)
    wandb_project: str = "laminar_jax"
    profile: bool = False

    def validate(self, prefix: str) -> None:
        for name in ("num_servers", "prompts_per_step", "samples_per_prompt", "total_steps", "max_inflight_batches"):
            v = getattr(self, name)
            expect(v >= 1, f"{prefix}.{name}", v, ">= 1")
        expect(self.sft_warmup_steps >= 0, f"{prefix}.sft_warmup_steps", self.sft_warmup_steps, ">= 0")
        expect(self.checkpoint_every >= 0, f"{prefix}.checkpoint_every", self.checkpoint_every, ">= 0")
        expect(0.1 <= self.gpu_memory_fraction <= 1.0, f"{prefix}.gpu_memory_fraction", self.gpu_memory_fraction,
               "in [0.1, 1.0]")
        expect(self.host_malloc in host_malloc.POLICIES, f"{prefix}.host_malloc", self.host_malloc,
               f"one of {list(host_malloc.POLICIES)}")
        expect(self.cpu_threads >= 0, f"{prefix}.cpu_threads", self.cpu_threads, ">= 0 (0 = one per core)")
        expect(self.wait_timeout_s > 0, f"{prefix}.wait_timeout_s", self.wait_timeout_s, "> 0")
        expect(self.learner_processes >= 1, f"{prefix}.learner_processes", self.learner_processes, ">= 1")
        expect(self.learner_processes == 1 or self.kind == "ray", f"{prefix}.learner_processes",
               self.learner_processes, "1 unless runtime.kind='ray' (the local runtime has one learner process)")
        expect(not self.server_processes or self.kind == "local", f"{prefix}.server_processes", self.server_processes,
               "False unless runtime.kind='local' (Ray runs every rollout server in an actor process already)")
        expect(not (self.server_processes and self.profile), f"{prefix}.server_processes", self.server_processes,
               "False with runtime.profile=True (the accounting reads this process's threads only)")
        expect(self.learner_gpus_per_process >= 0, f"{prefix}.learner_gpus_per_process",
               self.learner_gpus_per_process, ">= 0")
        self._validate_eval(prefix)
        for name in self.loggers:
            expect(name in LOGGERS, f"{prefix}.loggers", self.loggers, f"a list of {list(LOGGERS)}")
        expect(not self.profile or self.kind == "local", f"{prefix}.profile", self.profile,
               "False unless runtime.kind='local' (the accounting reads this process's threads)")
        expect(self.learner_resource is None or self.learner_resource.strip() != "", f"{prefix}.learner_resource",
               self.learner_resource, "a Ray resource name or None")

    def _validate_eval(self, prefix: str) -> None:
        p = prefix
        expect(self.eval_every >= 0, f"{p}.eval_every", self.eval_every, ">= 0 (0 = no evaluation during training)")
        expect(self.eval_samples >= 0, f"{p}.eval_samples", self.eval_samples, ">= 0 (0 = greedy only)")
        expect(self.eval_samples == 0 or 1 <= self.eval_k <= self.eval_samples, f"{p}.eval_k", self.eval_k,
               f"in [1, runtime.eval_samples={self.eval_samples}]")
        expect(self.eval_max_prompts >= 0, f"{p}.eval_max_prompts", self.eval_max_prompts, ">= 0 (0 = all)")
        expect(self.eval_temperature > 0, f"{p}.eval_temperature", self.eval_temperature,
               "> 0 (the greedy response is always generated besides)")
