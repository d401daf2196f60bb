"""One eval round offline (launch/eval.py): a policy from a run directory or a Hugging Face
directory, the config's held-out prompts, the real engine (rollout/offline.py), the config's reward
registry, and the same figures and record as an eval round during training.

A run directory (config.json with the run's sections) gives the newest version of its weight
store, built with the run's own model section and tokenizer. A Hugging Face directory (config.json
+ *.safetensors) is loaded with from_pretrained; its tokenizer.json when it has one, else the
config's model.tokenizer. Generation uses the config's rollout section (slots, pages, lengths).
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from laminar_jax.eval.metrics import EvalSample, round_metrics, versions_seen
from laminar_jax.eval.rounds import eval_items


def checkpoint_kind(path: str) -> str:
    """'run' (a laminar run directory) or 'hf' (a Hugging Face directory); raises naming the path."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"--checkpoint={path}: no config.json (expected a run directory or a Hugging Face "
                                f"directory)")
    with open(cfg_file, encoding="utf-8") as f:
        raw = json.load(f)
    if isinstance(raw, dict) and "runtime" in raw and "model" in raw:
        return "run"
    if any(n.endswith(".safetensors") for n in os.listdir(path)):
        return "hf"
    raise ValueError(f"--checkpoint={path}: config.json is neither a run's (no runtime/model sections) nor a "
                     f"Hugging Face model's with *.safetensors beside it")


def load_run_policy(run_dir: str, version: Optional[int] = None):
    """(model, version, tokenizer spec) of a run directory's weight store (newest version by default)."""
    from flax import nnx

    from laminar_jax.config import load_config
    from laminar_jax.learner.publish import unflatten_params
    from laminar_jax.model import build_model
    from laminar_jax.relay import WeightStore

    run_cfg = load_config(os.path.join(run_dir, "config.json"))
    store = WeightStore.of_run(run_cfg.relay, run_dir)
    version = store.latest() if version is None else version
    if version is None:
        raise FileNotFoundError(f"--checkpoint={run_dir}: its weight store {store.url} holds no version")
    model = build_model(run_cfg.model)
    _, state = nnx.split(model)
    nnx.update(model, unflatten_params(store.read(version), state))
    return model, int(version), run_cfg.model.tokenizer


def load_hf_policy(path: str, fallback_tokenizer: str):
    from laminar_jax.model.pretrained import from_pretrained

    tok = path if os.path.isfile(os.path.join(path, "tokenizer.json")) else fallback_tokenizer
    return from_pretrained(path), None, tok


def score(items, completions, tokenizer, registry) -> list[EvalSample]:
    eos = tokenizer.eos_id
    out = []
    for it, c in zip(items, completions):
        text = tokenizer.decode([t for t in c.tokens.tolist() if t != eos])
        reward = registry.score(it.data_source, text, it.ground_truth, it.extra_info)
        out.append(EvalSample(it.prompt_uid, it.data_source, it.sample_index == 0, reward, len(c.tokens),
                              c.finish_reason, -1 if c.version is None else int(c.version)))
    return out


def evaluate_checkpoint(cfg, checkpoint: str, version: Optional[int] = None, timeout_s: float = 3600.0) -> dict:
    """One eval round of `checkpoint` on cfg's held-out prompts; the record eval.jsonl holds."""
    from laminar_jax.data.rewards import load_registry
    from laminar_jax.data.source import build_val_prompts
    from laminar_jax.model import load_tokenizer
    from laminar_jax.rollout.offline import generate

    kind = checkpoint_kind(checkpoint)
    model, version, tok_spec = (load_run_policy(checkpoint, version) if kind == "run"
                                else load_hf_policy(checkpoint, cfg.model.tokenizer))
    tokenizer = load_tokenizer(tok_spec)
    rt = cfg.runtime
    prompts = build_val_prompts(cfg.data, tokenizer, rt.eval_max_prompts)
    items = eval_items(prompts, 0, rt.eval_samples, rt.eval_temperature, cfg.rollout, cfg.seed)
    t0 = time.time()
    done = generate(model, [list(it.prompt_ids) for it in items], [it.sampling for it in items], section=cfg.rollout,
                    seeds=[it.seed for it in items], version=version or 0, timeout_s=timeout_s)
    samples = score(items, done, tokenizer, load_registry(cfg.data.reward_registry))
    t1 = time.time()
    return {"checkpoint": os.path.abspath(checkpoint), "kind": kind, "step": version, "version": version,
            "versions": versions_seen(samples) if version is not None else {}, "t_submit": t0, "t_done": t1,
            "duration_s": round(t1 - t0, 3),
            "metrics": round_metrics(samples, rt.eval_k if rt.eval_samples else None, rt.eval_correct_threshold)}
