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
    from laminar_jax.runtime.rollout_worker import host_params

    cfg = load_config(os.path.join(run_dir, "config.json"))
    store = WeightStore.from_config(cfg.relay, cfg.relay.store_url or os.path.join(run_dir, "weights"))
    version = store.latest() if version is None else version
    if version is None:
        raise FileNotFoundError(f"{run_dir}: the weight store holds no version to export")
    # Shapes only, then the stored version's host arrays: no device holds the model on the way.
    model = abstract_model(cfg.model)
    graphdef, state = nnx.split(model)
    nnx.update(model, host_params(store.read(version), state))
    write_hf_dir(model, cfg.model, out_dir)
    return model
