"""The whole run's configuration: one typed section per plane, validated once.

Flow: ``configs/<x>.py:get_config(variant)`` returns an ml_collections ConfigDict built from
:func:`default_config`; the command line overrides it (``--config.learner.lr=1e-6``);
:func:`finalize` turns it into a frozen :class:`Config`, rejecting unknown keys and bad values
with the dotted key; the runtime writes it into the run directory as JSON, and child processes
start from that file (:func:`load_config`), never from argv.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import ml_collections

from laminar_jax.buffer.config import BufferSection
from laminar_jax.configlib import ConfigError, expect, from_config_dict, to_config_dict, to_json, validate_tree
from laminar_jax.data.config import GENERATED_HINT, DataSection
from laminar_jax.env.config import EnvSection
from laminar_jax.learner.config import LearnerSection, MeshSection
from laminar_jax.model.config import ModelSection
from laminar_jax.placement import PlacementSection
from laminar_jax.relay.config import RelaySection
from laminar_jax.rollout.config import RolloutSection
from laminar_jax.runtime.config import RuntimeSection
from laminar_jax.scheduler.config import SchedulerSection

__all__ = ["Config", "ConfigError", "default_config", "finalize", "save_config", "load_config"]


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run.

    Attributes:
      model: The policy model (laminar_jax.model).
      learner: Losses, optimiser, checkpoints (laminar_jax.learner).
      mesh: Device mesh of the learner.
      rollout: Rollout engines and sampling (laminar_jax.rollout).
      relay: Weight store and relay tier (laminar_jax.relay).
      buffer: Experience buffer and sampling policy (laminar_jax.buffer).
      scheduler: Repack and failure detection (laminar_jax.scheduler).
      data: Prompts and rewards (laminar_jax.data).
      runtime: Wiring, mode and run length (laminar_jax.runtime).
      env: Multi-turn episodes and their environments (laminar_jax.env).
      placement: Which devices the learner and each rollout server use (laminar_jax.placement).
      seed: Global seed; planes derive theirs from it unless set.
    """

    model: ModelSection = ModelSection()
    learner: LearnerSection = LearnerSection()
    mesh: MeshSection = MeshSection()
    rollout: RolloutSection = RolloutSection()
    relay: RelaySection = RelaySection()
    buffer: BufferSection = BufferSection()
    scheduler: SchedulerSection = SchedulerSection()
    data: DataSection = DataSection()
    runtime: RuntimeSection = RuntimeSection()
    env: EnvSection = EnvSection()
    placement: PlacementSection = PlacementSection()
    seed: int = 0

    def validate(self, prefix: str) -> None:
        expect(self.seed >= 0, "seed", self.seed, ">= 0")
        expect(self.runtime.mode != "stream" or self.buffer.max_staleness is not None, "buffer.max_staleness",
               self.buffer.max_staleness, "set (an int >= 0) when runtime.mode='stream'")
        if self.rollout.overlong_prompt == "error":
            # The data plane filters by data.max_prompt_tokens; anything longer would kill a server.
            expect(self.data.max_prompt_tokens <= self.rollout.max_prompt_len, "data.max_prompt_tokens",
                   self.data.max_prompt_tokens,
                   f"<= rollout.max_prompt_len={self.rollout.max_prompt_len} (or rollout.overlong_prompt='truncate')")
        if self.learner.adv_estimator in ("grpo", "rloo"):
            # A group of one has no baseline: its advantage is 0 and the prompt trains nothing
            # (verl would give GRPO r/(1+eps) and RLOO r). We refuse rather than silently waste it.
            expect(self.runtime.samples_per_prompt >= 2, "runtime.samples_per_prompt", self.runtime.samples_per_prompt,
                   f">= 2 with learner.adv_estimator={self.learner.adv_estimator!r} (a group of one trajectory has "
                   "no baseline and gets advantage 0; use 'gae' with a critic for one sample per prompt)")
        rt = self.runtime
        if self.rollout.decode_row_buckets and rt.mode == "laminar":
            # Repack promises a moved sequence the tokens it would have had unmoved; with row buckets
            # a row's bits can follow how many rows share its decode call.
            expect(not self.scheduler.repack, "rollout.decode_row_buckets", self.rollout.decode_row_buckets,
                   "() with scheduler.repack=True in laminar mode (moves must be output-identical; "
                   "set scheduler.repack=False to use row buckets)")
        if self.rollout.inflight_kv == "reprefill":
            # Re-prefilling happens at in-flight swaps only; an episode waiting without a slot has no
            # slot to recompute its KV in.
            expect(rt.mode == "inflight", "rollout.inflight_kv", "reprefill",
                   f"'keep' (the default) unless runtime.mode='inflight' (runtime.mode={rt.mode!r} never swaps "
                   "weights under a live sequence)")
            expect(not (self.env.enabled and self.env.release_slot_while_waiting), "rollout.inflight_kv", "reprefill",
                   "'keep' with env.release_slot_while_waiting=True (an episode waiting without a slot cannot "
                   "re-prefill its KV at an in-flight swap)")
        if rt.eval_every or rt.eval_before_train:
            key = "runtime.eval_every" if rt.eval_every else "runtime.eval_before_train"
            value = rt.eval_every or rt.eval_before_train
            expect(self.data.has_val(), key, value, "0/False unless held-out prompts are set (data.val_files, or "
                   f"data.val_size with {GENERATED_HINT})")
            expect(not self.env.enabled, key, value, "0/False with env.enabled=True (evaluation of multi-turn "
                   "episodes is not supported)")
        if self.learner.lora.enabled:
            from laminar_jax.model.lora import check_targets, param_shapes_of
            from laminar_jax.model.sharded import model_config

            check_targets(self.learner.lora, param_shapes_of(model_config(self.model), self.model.value_head))
        if self.learner.pack_length:
            # A trajectory is at most rollout.max_total_len tokens and must fit in one packed row.
            expect(self.learner.pack_length >= self.rollout.max_total_len, "learner.pack_length",
                   self.learner.pack_length, f">= rollout.max_total_len={self.rollout.max_total_len} (or 0: no packing)")


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def default_config() -> ml_collections.ConfigDict:
    """All defaults as a ConfigDict (what configs/*.py start from and override)."""
    return to_config_dict(Config())


def repo_config(name: str, variant: str = "") -> ml_collections.ConfigDict:
    """``get_config(variant)`` of the repository's ``configs/<name>.py`` (benchmarks and tests)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"laminar_configs_{name}", path)
    if spec is None or not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such config file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant)


def finalize(cd: ml_collections.ConfigDict | dict) -> Config:
    """Validate after overrides: unknown keys, wrong types and bad values raise ConfigError.

    Linked values are derived here, once: `learner.pack_length` (unless set) = rollout.max_total_len,
    `rollout.dtype` (unless set) = model.dtype, and `learner.total_steps` (the optimizer updates the
    lr schedule spans) = runtime.total_steps x ppo_epochs x mini_batches. (The checkpoint directory,
    <run_dir>/checkpoints unless set, is resolved when the run starts and its run directory exists:
    runtime/parts.py.)
    """
    cfg = derive(from_config_dict(Config, cd))
    validate_tree(cfg)
    return cfg


def derive(cfg: Config) -> Config:
    """The values a run derives from others (see `finalize`); idempotent."""
    ln, rt = cfg.learner, cfg.runtime
    updates = {"total_steps": max(1, rt.total_steps * ln.ppo_epochs * ln.mini_batches)}
    if ln.pack_length is None:
        # The longest trajectory is rollout.max_total_len tokens; one packed row must hold it.
        updates["pack_length"] = cfg.rollout.max_total_len
    rollout = cfg.rollout if cfg.rollout.dtype is not None else dataclasses.replace(cfg.rollout, dtype=cfg.model.dtype)
    return dataclasses.replace(cfg, learner=dataclasses.replace(ln, **updates), rollout=rollout)


def unknown_override(argv: list[str]) -> Optional[str]:
    """The first ``--config.<section>.<key>=...`` in argv naming no config key, as a ConfigError message.

    ml_collections stops on such a flag with a bare ``AttributeError`` traceback; entry points call
    this first so the user sees the dotted key and the keys the section has.
    """
    import typing

    hints = typing.get_type_hints(Config)
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config."):].split("=", 1)[0]
        section, _, field = key.partition(".")
        if section not in hints:
            return f"{key}: unknown key; Config has {sorted(hints)}"
        sec_cls = hints[section]
        if not dataclasses.is_dataclass(sec_cls):
            continue
        names = sorted(f.name for f in dataclasses.fields(sec_cls))
        if field.split(".")[0] not in names:
            return f"{key}: unknown key; {sec_cls.__name__} has {names}"
    return None


# config.json's record of where the roles ran (placement.Layout.to_json); not a config key.
REALISED_PLACEMENT = "realised_placement"


def save_config(cfg: Config, run_dir: str, layout: Optional[dict] = None) -> str:
    """Write <run_dir>/config.json; ``layout``: the realised device layout, recorded beside the keys."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.json")
    tmp = path + ".tmp"
    text = to_json(cfg)
    if layout is not None:
        text = json.dumps({**json.loads(text), REALISED_PLACEMENT: layout}, indent=2)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def load_config(path: str) -> Config:
    """Read a resolved config.json (as written by save_config) and validate it again."""
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
    raw.pop(REALISED_PLACEMENT, None)  # a record of the last run's devices, not a key
    return finalize(raw)


def replace(cfg: Config, **sections) -> Config:
    """Functional update of whole sections or dotted keys: replace(cfg, **{"runtime.mode": "sync"})."""
    out = cfg
    for key, value in sections.items():
        section, _, field = key.partition(".")
        if not field:
            out = dataclasses.replace(out, **{section: value})
        else:
            out = dataclasses.replace(out, **{section: dataclasses.replace(getattr(out, section), **{field: value})})
    out = derive(out)
    validate_tree(out)
    return out


def resolve_run_dir(cfg: Config, now: Optional[str] = None) -> str:
    """The run directory as an absolute path (orbax refuses relative checkpoint paths)."""
    if cfg.runtime.run_dir:
        return os.path.abspath(cfg.runtime.run_dir)
    import time

    return os.path.abspath(os.path.join("runs", now or time.strftime("%Y%m%d-%H%M%S")))
