"""Runtime: wires the planes. `run(cfg)` starts the configured runtime (`local` or `ray`)."""

from __future__ import annotations

from laminar_jax.weights.export import export_pretrained

__all__ = ["run", "export_pretrained"]


def run(cfg) -> dict:
    """Train according to `cfg` (a finalized laminar_jax.config.Config); returns the summary dict."""
    from laminar_jax.cpu.threads import apply_cpu_threads
    from laminar_jax.cpu.host_malloc import apply_host_malloc
    from laminar_jax.matmul_precision import apply_matmul_precision

    apply_host_malloc(cfg.runtime.host_malloc)
    apply_cpu_threads(cfg.runtime.cpu_threads, cfg.runtime.cpu_async_dispatch)  # holds if JAX has not started
    apply_matmul_precision(cfg.runtime.matmul_precision, cfg.model.dtype)
    if cfg.runtime.kind == "local":
        from laminar_jax.runtime.local import run_local

        return run_local(cfg)
    if cfg.runtime.kind == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ImportError("runtime.kind='ray' needs Ray: pip install 'ray>=2.40' (the 'ray' extra)") from None
        from laminar_jax.runtime.ray_runtime import run_ray

        return run_ray(cfg)
    raise ValueError(f"runtime.kind={cfg.runtime.kind!r}: must be 'local' or 'ray'")
