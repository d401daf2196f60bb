"""Config section for the data plane: where prompts come from and how rewards are scored."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from laminar_jax.configlib import expect

# Sources that generate their prompts from a seed: data.val_size draws held-out prompts from a
# stream of their own. A file source names its held-out prompts in data.val_files instead.
GENERATED_SOURCES = ("synthetic_skew", "reasoning_gym")
# The one wording of that rule in error messages (config check, data plane, launch/eval.py).
GENERATED_HINT = "a generated data.source: " + " or ".join(repr(s) for s in GENERATED_SOURCES)


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompt source, prompt filtering and reward scoring.

    Attributes:
      source: 'synthetic_skew' (built-in skewed-length task), 'file' (parquet/jsonl in verl's layout) or 'reasoning_gym'.
      path: File or glob of .parquet/.jsonl/.json files (source='file'); files are read in sorted order.
      val_files: Held-out prompts for evaluation (runtime.eval_every, launch/eval.py): a file or glob of .parquet/.jsonl/.json files in the same layout as data.path; None = none (or data.val_size).
      val_size: When val_files is None and data.source is generated (synthetic_skew, reasoning_gym): this many held-out prompts drawn from a stream of their own (synthetic_skew: its own random stream; reasoning_gym: the same dataset under another seed). Not used by file sources, which name theirs in val_files. 0 = none.
      name: Dataset name used in prompt uids; None derives it from the source (file stem, task name).
      reasoning_gym_dataset: reasoning-gym dataset name, e.g. 'basic_arithmetic' (source='reasoning_gym').
      dataset_size: Number of distinct prompts per epoch for procedural sources.
      seed: Seed for procedural generation and for the per-epoch shuffle.
      shuffle: Shuffle prompts (a different permutation each epoch, fixed by seed).
      num_epochs: Passes over the data; None repeats forever.
      max_prompt_tokens: Prompts longer than this (in tokens, BOS included) are handled by `overlong`.
      overlong: 'filter' drops over-long prompts, 'truncate' keeps their last tokens, 'error' raises.
      skip_bad_rows: Skip (and count) malformed rows instead of raising.
      add_bos: Prepend the tokenizer's BOS id to prompt_ids when it has one and the prompt does not already start with it (a chat template such as Llama-3's writes it itself).
      chat_template: Jinja chat template for chat-message prompts, as a path to a file or the template text itself; None uses the tokenizer's own (chat_template.jinja or tokenizer_config.json's chat_template).
      chat_template_kwargs: Flags passed to the chat template, e.g. {'enable_thinking': False} for Qwen3.
      reward_workers: Worker processes (or threads) scoring rewards off the learner's critical path.
      reward_timeout_s: Per-response scoring deadline; a timeout scores 0.0 and replaces the worker.
      reward_mode: 'process' (subprocess workers; needed for math_verify's signal timeouts) or 'thread'.
      reward_registry: 'module:function' returning the RewardRegistry used by the reward workers.
      skew_repeat_median: synthetic_skew: median repeat count of the lognormal draw.
      skew_repeat_sigma: synthetic_skew: lognormal sigma of the repeat count (larger = heavier tail).
      skew_max_repeats: synthetic_skew: repeat counts are clipped to [1, skew_max_repeats] (at most 35).
      skew_pattern_min: synthetic_skew: shortest pattern (letters a-z).
      skew_pattern_max: synthetic_skew: longest pattern.
    """

    source: Literal["synthetic_skew", "file", "reasoning_gym"] = "synthetic_skew"
    path: Optional[str] = None
    val_files: Optional[str] = None
    val_size: int = 0
    name: Optional[str] = None
    reasoning_gym_dataset: str = "basic_arithmetic"
    dataset_size: int = 10_000
    seed: int = 0
    shuffle: bool = True
    num_epochs: Optional[int] = None
    max_prompt_tokens: int = 256
    overlong: Literal["filter", "truncate", "error"] = "filter"
    skip_bad_rows: bool = False
    add_bos: bool = True
    chat_template: Optional[str] = None
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    reward_workers: int = 2
    reward_timeout_s: float = 10.0
    reward_mode: Literal["process", "thread"] = "process"
    reward_registry: str = "laminar_jax.data.rewards:default_registry"
    skew_repeat_median: float = 3.0
    skew_repeat_sigma: float = 1.0
    skew_max_repeats: int = 32
    skew_pattern_min: int = 1
    skew_pattern_max: int = 3

    def validate(self, prefix: str) -> None:
        p = prefix
        expect(self.source != "file" or bool(self.path), f"{p}.path", self.path, "a file or glob when source='file'")
        expect(self.val_files is None or self.val_files.strip() != "", f"{p}.val_files", self.val_files,
               "a file or glob of .parquet/.jsonl/.json files, or None")
        expect(self.val_size >= 0, f"{p}.val_size", self.val_size, ">= 0")
        expect(bool(self.reasoning_gym_dataset), f"{p}.reasoning_gym_dataset", self.reasoning_gym_dataset, "a name")
        expect(self.dataset_size >= 1, f"{p}.dataset_size", self.dataset_size, ">= 1")
        expect(0 <= self.seed < 2**32, f"{p}.seed", self.seed, "in [0, 2**32)")
        expect(self.num_epochs is None or self.num_epochs >= 1, f"{p}.num_epochs", self.num_epochs, "None or >= 1")
        expect(self.max_prompt_tokens >= 1, f"{p}.max_prompt_tokens", self.max_prompt_tokens, ">= 1")
        expect(self.reward_workers >= 1, f"{p}.reward_workers", self.reward_workers, ">= 1")
        expect(self.reward_timeout_s > 0, f"{p}.reward_timeout_s", self.reward_timeout_s, "> 0")
        reserved = {"messages", "tools", "documents", "add_generation_prompt"}
        expect(not reserved & set(self.chat_template_kwargs), f"{p}.chat_template_kwargs", self.chat_template_kwargs,
               f"template flags other than {sorted(reserved)} (those are set per prompt)")
        expect(":" in self.reward_registry, f"{p}.reward_registry", self.reward_registry, "'module:function'")
        expect(self.skew_repeat_median >= 1, f"{p}.skew_repeat_median", self.skew_repeat_median, ">= 1")
        expect(self.skew_repeat_sigma >= 0, f"{p}.skew_repeat_sigma", self.skew_repeat_sigma, ">= 0")
        expect(1 <= self.skew_max_repeats <= 35, f"{p}.skew_max_repeats", self.skew_max_repeats, "in [1, 35]")
        expect(1 <= self.skew_pattern_min, f"{p}.skew_pattern_min", self.skew_pattern_min, ">= 1")
        expect(
            self.skew_pattern_min <= self.skew_pattern_max <= 16,
            f"{p}.skew_pattern_max",
            self.skew_pattern_max,
            f"in [skew_pattern_min={self.skew_pattern_min}, 16]",
        )

    def has_val(self) -> bool:
        """Whether the section names held-out prompts (val_files, or val_size for a generated source)."""
        return self.val_files is not None or (self.val_size > 0 and self.source in GENERATED_SOURCES)
