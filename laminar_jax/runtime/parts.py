"""What every runtime builds the same way before wiring: paths, the warm-start, the entry wrapper.

`resolve(cfg, run_dir)` fixes the run's paths and derived values once (the checkpoint directory
and the learner's step count), so every process of a run reads the same values from config.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from typing import Callable

from laminar_jax.config import Config, ConfigError, resolve_run_dir, save_config

log = logging.getLogger(__name__)


def relays_checking_store(cfg: Config, run_dir: str) -> Config:
    """The config every relay of a run starts with, in-process or an actor: the run's weight store
    filled in (the weight plane's default, `<run_dir>/weights`, when relay.store_url is unset), so
    a relay serves only versions that store has committed (relay.store_check_s), and the bytes a
    relay accepts unverified derived from the model's size (unverified_cap)."""
    from laminar_jax.relay.store import run_store_url

    url = run_store_url(cfg.relay, run_dir)
    return dataclasses.replace(cfg, relay=dataclasses.replace(cfg.relay, store_url=url,
                                                              max_unverified_bytes=unverified_cap(cfg)))


def version_bytes(cfg: Config) -> int:
    """Bytes of one published weight version (the policy's parameters, no value head) in the
    serving dtype (rollout.dtype; the model's dtype when unset), from the model's shapes alone."""
    import jax
    import numpy as np
    from flax import nnx

    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model.precision import as_dtype, is_floating
    from laminar_jax.model.sharded import abstract_model

    flat = flatten_params(nnx.state(abstract_model(cfg.model)))
    served = as_dtype(cfg.rollout.dtype or cfg.model.dtype)

    def nbytes(x) -> int:
        return int(np.prod(x.shape)) * (served.itemsize if is_floating(x) else np.dtype(x.dtype).itemsize)

    return sum(nbytes(x) for x in jax.tree.leaves(flat))


def unverified_cap(cfg: Config) -> int:
    """relay.max_unverified_bytes for the run's relays: as set, or (0) UNVERIFIED_VERSIONS x one
    version's bytes. A set value below one version is refused, naming the key."""
    from laminar_jax.relay.config import UNVERIFIED_VERSIONS

    one = version_bytes(cfg)
    if cfg.relay.max_unverified_bytes == 0:
        return max(4096, int(UNVERIFIED_VERSIONS * one))
    if cfg.relay.max_unverified_bytes < one:
        raise ConfigError(f"relay.max_unverified_bytes={cfg.relay.max_unverified_bytes} is below one weight "
                          f"version ({one} bytes): every push would be refused; set 0 to derive it from the model")
    return cfg.relay.max_unverified_bytes


def resolve(cfg: Config, run_dir: str) -> tuple[Config, bool]:
    """(cfg with runtime.run_dir = run_dir and learner.checkpoint_dir resolved (default
    <run_dir>/checkpoints, absolute), whether that directory holds a checkpoint). The run dir and a
    local checkpoint dir are created owner-only (0700); one another user owns is refused."""
    from laminar_jax.net.auth import private_dir

    private_dir(run_dir, "run dir")
    path = cfg.learner.checkpoint_dir or os.path.join(run_dir, "checkpoints")
    if "://" not in path:
        path = os.path.abspath(path)  # orbax refuses relative paths; URLs (gs://...) pass through
        private_dir(path, "checkpoint dir")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, run_dir=run_dir),
                              learner=dataclasses.replace(cfg.learner, checkpoint_dir=path))
    if "://" not in path:
        return cfg, os.path.isdir(path) and any(n.isdigit() for n in os.listdir(path))
    from etils import epath

    p = epath.Path(path)
    return cfg, p.exists() and any(c.name.isdigit() for c in p.iterdir())


def sft_warmup(cfg: Config, model, tokenizer, phase: Callable[[str], None] = lambda s: None) -> list[float]:
    """The supervised warm-start before RL (losses per step), on the data section's (prompt,
    response) pairs: the synthetic task's reference responses, or a file's 'response' column."""
    from laminar_jax.data.sft import sft_pairs
    from laminar_jax.learner.sft import sft_warmup as train

    pairs, _ = sft_pairs(cfg.data, tokenizer, max_total_len=cfg.rollout.max_total_len, seed=cfg.seed + 1)
    phase(f"supervised warm-start: {cfg.runtime.sft_warmup_steps} steps on {len(pairs)} reference responses")
    losses = train(model, pairs, cfg.runtime.sft_warmup_steps, cfg.runtime.sft_lr, seed=cfg.seed)
    phase(f"warm-start done: loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "warm-start done")
    return losses


def learner_models(cfg: Config, mesh, rules, phase: Callable[[str], None], sft: bool) -> tuple[Callable, list]:
    """(next_model, SFT losses): next_model() is the policy for a learner being built, every
    parameter loaded straight onto its shard of ``mesh`` (model.sharded.load_model; no whole copy
    on any one device, none kept between learners). The first call returns the model the
    supervised warm-start trained (``sft``); later ones (a learner rebuilt after a failure) load
    again and take the warm-started weights from the one host copy kept for that."""
    from laminar_jax.learner.mesh import sharding_of
    from laminar_jax.learner.publish import load_model_params, model_params
    from laminar_jax.model import build_model, load_tokenizer
    from laminar_jax.model.sharded import abstract_model

    shardings = sharding_of(abstract_model(cfg.model), mesh, rules)
    first = [build_model(cfg.model, shardings)]
    losses, warm = [], None
    if sft:
        losses = sft_warmup(cfg, first[0], load_tokenizer(cfg.model.tokenizer), phase)
        warm = model_params(first[0])

    def next_model():
        if first:
            return first.pop()
        model = build_model(cfg.model, shardings)
        if warm is not None:
            load_model_params(model, warm)
        return model

    return next_model, losses


def check_resume(cfg: Config, run_dir: str) -> None:
    """A run directory that holds a run: refuse config changes that break its ledger's meaning,
    log the others, and say so when there is no checkpoint to resume from."""
    from laminar_jax.config import ConfigError
    from laminar_jax.configlib import to_json
    from laminar_jax.resume import compare_resume_config

    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    resolved, resuming = resolve(cfg, run_dir)
    errors, changes = compare_resume_config(saved, json.loads(to_json(resolved)))
    if errors:
        raise ConfigError(f"{run_dir} holds a run whose config differs:\n  " + "\n  ".join(errors))
    for line in changes:
        log.warning("resume of %s with a changed config: %s", run_dir, line)
    if not resuming:
        log.warning("%s holds a run but no checkpoint in %s: starting from scratch", run_dir,
                    resolved.learner.checkpoint_dir)


def rpc_timeout(cfg: Config) -> float:
    """Bound of a small cross-process call (a Ray actor method, a relay control op)."""
    return min(cfg.runtime.wait_timeout_s, 120.0)


def run_with(build: Callable, cfg: Config) -> dict:
    """Write the run directory, run `build(cfg, run_dir, stop).run()` with SIGTERM/SIGINT mapped to
    a clean stop (checkpoint, resumable), then write and print the summary."""
    run_dir = resolve_run_dir(cfg)
    check_resume(cfg, run_dir)
    save_config(resolve(cfg, run_dir)[0], run_dir)
    stop = threading.Event()
    previous: dict = {}
    received: list[str] = []
    if threading.current_thread() is threading.main_thread():
        # SIGTERM/SIGINT: finish the current step, checkpoint, exit; a later run resumes from there.
        # A second signal falls through to the previous handler (e.g. KeyboardInterrupt).
        def on_signal(signum, frame):
            if stop.is_set() and callable(previous.get(signum)):
                previous[signum](signum, frame)
            received.append(signal.Signals(signum).name)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        summary = build(cfg, run_dir, stop).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary["interrupted_by"] = received[0] if received else None
    if received:
        args = [a for a in sys.argv[1:] if not a.startswith("--config.runtime.run_dir")]
        print(f"interrupted by {received[0]} at learner version {summary['steps']} (checkpointed); resume with:\n"
              f"  python launch/run.py {' '.join(args)} --config.runtime.run_dir={run_dir}", file=sys.stderr, flush=True)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    # One line of scalars on stdout; the curves are in metrics.jsonl (and in the returned dict).
    print(json.dumps({k: v for k, v in summary.items() if v is None or isinstance(v, (bool, int, float, str))}))
    return summary
