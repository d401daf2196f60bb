"""Config section for the environment plane (multi-turn episodes)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from laminar_jax.configlib import expect


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Multi-turn episodes: which environment, how the pool runs it, the turn and trajectory budgets.

    Attributes:
      enabled: Run every prompt as a multi-turn episode against an environment (False: single-turn completions).
      default: Environment for prompts that name none (see laminar_jax/env/registry.py for the selection order).
      by_data_source: {data_source: environment name}, consulted before `default`.
      env_kwargs: {environment name: keyword arguments} for the environments it names (a record's own extra_info.env_kwargs win).
      workers: Environment calls that may run at once per rollout server (EnvPool threads).
      timeout_s: Deadline of one environment call (reset or step); past it the episode ends with reward 0.
      turn_max_new_tokens: Token budget of one policy turn.
      turn_stop: Text that ends a policy turn (the end of a tool call), matched as token ids on the host.
      max_response_tokens: Budget of a whole trajectory's response (policy + observation tokens); 0 = up to rollout.max_total_len.
      chat_template: Template rendering tool messages (None: the tokenizer's own; see env/tools.py for the plain fallback).
      sandbox: How the python environment isolates model-written code: 'bwrap' (bubblewrap namespaces; the environment refuses to start without bwrap, `apt-get install bubblewrap`) or 'none' (unsandboxed, in the trainer's own user and namespaces; the log and the summary's env_sandbox say so). Overrides any environment kwarg of the same name.
      release_slot_while_waiting: A sequence waiting on its environment gives its slot to other requests (its KV pages stay) and takes a free slot again on the observation (False: it keeps its slot).
    """

    enabled: bool = False
    default: Optional[str] = None
    by_data_source: Optional[dict] = None
    env_kwargs: Optional[dict] = None
    workers: int = 8
    timeout_s: float = 30.0
    turn_max_new_tokens: int = 64
    turn_stop: str = "</tool_call>"
    max_response_tokens: int = 0
    chat_template: Optional[str] = None
    sandbox: str = "bwrap"
    release_slot_while_waiting: bool = False

    def validate(self, prefix: str) -> None:
        expect(self.workers >= 1, f"{prefix}.workers", self.workers, ">= 1")
        expect(self.timeout_s > 0, f"{prefix}.timeout_s", self.timeout_s, "> 0")
        expect(self.turn_max_new_tokens >= 1, f"{prefix}.turn_max_new_tokens", self.turn_max_new_tokens, ">= 1")
        expect(self.sandbox in ("bwrap", "none"), f"{prefix}.sandbox", self.sandbox, "'bwrap' or 'none'")
        expect(self.max_response_tokens >= 0, f"{prefix}.max_response_tokens", self.max_response_tokens, ">= 0")
        expect(self.by_data_source is None or all(isinstance(k, str) and isinstance(v, str) and v
                                                  for k, v in self.by_data_source.items()),
               f"{prefix}.by_data_source", self.by_data_source, "a {data_source: environment name} dict")
        expect(self.env_kwargs is None or all(isinstance(v, dict) for v in self.env_kwargs.values()),
               f"{prefix}.env_kwargs", self.env_kwargs, "a {environment name: {keyword: value}} dict")
        expect(not self.enabled or bool(self.turn_stop), f"{prefix}.turn_stop", self.turn_stop,
               "non-empty when env.enabled")
