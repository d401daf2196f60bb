"""Export a run's trained policy as a Hugging Face directory (servable by transformers / vLLM)."""

from __future__ import annotations

import os
import shutil
from typing import Optional


def export_pretrained(run_dir: str, out_dir: str, version: Optional[int] = None):
    """Write weight `version` (default: the newest) of the run's weight store to `out_dir` with
    `save_pretrained`, copy tokenizer files when the model has them, and return the model."""
    from flax import nnx

    from laminar_jax.config import load_config
    from laminar_jax.learner.publish import unflatten_params
    from laminar_jax.model import build_model, save_pretrained
    from laminar_jax.relay import WeightStore

    cfg = load_config(os.path.join(run_dir, "config.json"))
    store = WeightStore(cfg.relay.store_url or os.path.join(run_dir, "weights"), keep_last=cfg.relay.keep_last)
    version = store.latest() if version is None else version
    if version is None:
        raise FileNotFoundError(f"{run_dir}: the weight store holds no version to export")
    model = build_model(cfg.model)
    graphdef, state = nnx.split(model)
    nnx.update(model, unflatten_params(store.read(version), state))
    save_pretrained(model, out_dir)
    tok_dir = cfg.model.tokenizer if os.path.isdir(cfg.model.tokenizer) else cfg.model.path
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if tok_dir and os.path.exists(os.path.join(tok_dir, name)):
            shutil.copy(os.path.join(tok_dir, name), os.path.join(out_dir, name))
    return model
