"""A run's per-process JAX settings, applied once by every process that runs a role (the entry point,
each Ray actor): actor processes inherit none of them from the driver.

In this order: XLA's GPU allocator pool (gpu_allocator.py), the C allocator's policy before XLA
allocates anything (cpu/host_malloc.py), XLA's CPU threads before JAX's CPU backend starts
(cpu/threads.py), the persistent compilation cache before
anything compiles (compile_cache.py), the matrix-product precision before anything is traced
(matmul_precision.py).
"""

from __future__ import annotations


def apply_process_settings(cfg) -> None:
    """Apply `cfg`'s (a finalized Config) runtime settings to this process."""
    from laminar_jax.compile_cache import enable_compilation_cache
    from laminar_jax.cpu.host_malloc import apply_host_malloc
    from laminar_jax.cpu.threads import apply_cpu_threads
    from laminar_jax.gpu_allocator import apply_gpu_allocator
    from laminar_jax.matmul_precision import apply_matmul_precision

    apply_gpu_allocator(cfg.runtime.gpu_memory_fraction)
    apply_host_malloc(cfg.runtime.host_malloc)
    apply_cpu_threads(cfg.runtime.cpu_threads, cfg.runtime.cpu_async_dispatch)
    enable_compilation_cache(cfg.runtime.compilation_cache_dir)
    apply_matmul_precision(cfg.runtime.matmul_precision, cfg.model.dtype)


def apply_host_malloc(policy: str) -> bool:
    """The C allocator's policy for this process (runtime.host_malloc; the CPU plugin's
    cpu/host_malloc.py), for callers outside the entry points (the offline rollout.LLM)."""
    from laminar_jax.cpu.host_malloc import apply_host_malloc as apply

    return apply(policy)
