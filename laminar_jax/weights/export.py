"""Export a trained policy as a self-contained Hugging Face directory (transformers, TRL, vLLM load it).

The directory holds the weights (safetensors), config.json, generation_config.json and the
tokenizer files (laminar_jax.model.export.write_hf_dir).
"""

from __future__ import annotations

import os
from typing import Optional

from laminar_jax.model.export import write_hf_dir  # noqa: F401 - re-exported for callers of this module


def export_pretrained(run_dir: str, out_dir: str, version: Optional[int] = None):
    """Write weight `version` (default: the newest) of the run's weight store to `out_dir` as a
    self-contained HF directory (see write_hf_dir) and return the model (its leaves host arrays)."""
    from flax import nnx

    from laminar_jax.config import load_config
    from laminar_jax.model.sharded import abstract_model
    from laminar_jax.relay import WeightStore
    from laminar_jax.weights.host import host_params

    cfg = load_config(os.path.join(run_dir, "config.json"))
    store = WeightStore.of_run(cfg.relay, run_dir)
    version = store.latest() if version is None else version
    if version is None:
        raise FileNotFoundError(f"{run_dir}: the weight store holds no version to export")
    # Shapes only, then the stored version's host arrays: no device holds the model on the way.
    model = abstract_model(cfg.model)
    graphdef, state = nnx.split(model)
    flat = store.read(version)
    if "lora.base_sha256" in flat:  # learner.lora: an adapter version, merged into the run's base
        from laminar_jax.weights.lora_base import merged_flat

        flat = merged_flat(cfg.relay, store.url, flat)
    nnx.update(model, host_params(flat, state))
    write_hf_dir(model, cfg.model, out_dir)
    return model


def export_peft(run_dir: str, out_dir: str) -> dict:
    """Write the newest checkpoint's LoRA adapters (learner.lora) of the run to ``out_dir`` in PEFT's
    format (adapter_config.json + adapter_model.safetensors, model/peft.py); the restore report."""
    import dataclasses

    from laminar_jax.config import load_config
    from laminar_jax.learner import Learner
    from laminar_jax.model import build_model
    from laminar_jax.model.peft import write_peft_adapter

    cfg = load_config(os.path.join(run_dir, "config.json"))
    if not cfg.learner.lora.enabled:
        raise ValueError(f"{run_dir}: learner.lora.rank is 0 in this run (full fine-tuning has no adapters); "
                         "use export_pretrained")
    section = dataclasses.replace(cfg.learner, checkpoint_dir=cfg.learner.checkpoint_dir
                                  or os.path.join(run_dir, "checkpoints"))
    learner = Learner(section, build_model(cfg.model), publish_dtype=cfg.rollout.dtype)
    try:
        learner.restore_latest()
        if learner.restore_report is None or learner.restore_report["step"] is None:
            raise FileNotFoundError(f"{section.checkpoint_dir}: no checkpoint to export adapters from")
        write_peft_adapter(learner.adapter_params(), section.lora, out_dir, base_model=cfg.model.path)
        return {"version": learner.version, **learner.restore_report}
    finally:
        learner.close()
