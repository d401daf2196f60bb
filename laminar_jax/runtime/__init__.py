"""Runtime: wires the planes. `run(cfg)` starts the configured runtime (`local` or `ray`)."""

from __future__ import annotations

from laminar_jax.runtime.export import export_pretrained

__all__ = ["run", "export_pretrained"]


def run(cfg) -> dict:
    """Train according to `cfg` (a finalized laminar_jax.config.Config); returns the summary dict."""
    if cfg.runtime.kind == "local":
        from laminar_jax.runtime.local import run_local

        return run_local(cfg)
    if cfg.runtime.kind == "ray":
        raise NotImplementedError(
            "runtime.kind='ray' is not implemented yet (the Ray runtime is tracked in issue 7); "
            "use runtime.kind='local'")
    raise ValueError(f"runtime.kind={cfg.runtime.kind!r}: must be 'local' or 'ray'")
