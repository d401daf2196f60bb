"""Plain records that cross plane boundaries (buffer -> rollout -> buffer -> learner, and eval).

They hold host data only (numpy / Python scalars), so any plane can build, store, checkpoint
or send them without importing another plane.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

import numpy as np

FinishReason = Literal["eos", "length", "aborted"]


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One generated response to one prompt: by one weight version, or (runtime.mode='inflight') by
    several, each token stamped with the version that sampled it.

    Attributes:
      uid: Unique id of this trajectory: f"{prompt_uid}/{sample_index}".
      prompt_uid: Id of the prompt (dataset index + epoch); the ledger key.
      sample_index: Index within the prompt's group (0..n_samples-1).
      prompt_ids: i32[P] prompt token ids.
      response_ids: i32[R] generated ids (including the stop token when finish_reason == 'eos').
      behaviour_logprobs: f32[N] log-prob of each *policy* token under `version` (sampling dist.):
        N = R without a policy mask, N = policy_mask.sum() with one.
      version: The weight version that generated the first response token: the oldest (versions only
        grow along a trajectory), so trajectory-level staleness is judged on it.
      finish_reason: 'eos' (stop token), 'length' (max_new_tokens / max length) or 'aborted'.
      reward: Scalar reward, None until scored.
      data_source: Key of the reward function that scores it.
      ground_truth: Whatever the reward function needs.
      extra: Free-form JSON-serialisable metadata (timings, server id, moves...).
      policy_mask: u8[R] or None. Multi-turn episodes interleave generated tokens (1) with
        environment observation tokens (0) in response_ids; observations are context only (never
        trained on, no behaviour log-prob). None means every response token is generated.
      token_versions: i32[N] or None: the weight version that sampled each policy token (aligned with
        behaviour_logprobs). None means every token is `version`'s; outside runtime.mode='inflight'
        every entry equals `version`.
    """

    uid: str
    prompt_uid: str
    sample_index: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    version: int
    finish_reason: FinishReason = "eos"
    reward: Optional[float] = None
    data_source: str = ""
    ground_truth: Any = None
    extra: dict = dataclasses.field(default_factory=dict)
    policy_mask: Optional[np.ndarray] = None
    token_versions: Optional[np.ndarray] = None

    @property
    def num_tokens(self) -> int:
        return int(len(self.prompt_ids) + len(self.response_ids))

    @property
    def num_policy_tokens(self) -> int:
        return int(len(self.response_ids) if self.policy_mask is None else np.asarray(self.policy_mask).sum())

    def response_policy_mask(self) -> np.ndarray:
        """f32[R]: the policy mask, all ones when there is none."""
        if self.policy_mask is None:
            return np.ones(len(self.response_ids), np.float32)
        return np.asarray(self.policy_mask, np.float32)

    def policy_token_versions(self) -> np.ndarray:
        """i32[N]: the version of each policy token (all `version` without token_versions)."""
        if self.token_versions is None:
            return np.full(len(self.behaviour_logprobs), self.version, np.int32)
        return np.asarray(self.token_versions, np.int32)

    def with_reward(self, reward: float) -> "Trajectory":
        return dataclasses.replace(self, reward=float(reward))


# The fields a finished trajectory adds to its experience row (the row already holds the prompt's:
# prompt_ids, prompt_uid, sample_index, data_source, ground_truth, extra_info).
GENERATED_FIELDS = ("response_ids", "behaviour_logprobs", "finish_reason")
# What makes a row trainable: generated, scored, and stamped with its (first token's) weight version.
REQUIRED_FIELDS = ("response_ids", "behaviour_logprobs", "version", "reward")


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One sample to generate: a prompt and the index of the sample within its group. What the
    reward needs (data_source, ground truth) stays in the sample's experience row."""

    uid: str
    prompt_uid: str
    sample_index: int
    prompt_ids: tuple[int, ...]
    seed: int


def to_row(traj: Trajectory) -> dict[str, Any]:
    """What a finished trajectory writes into its experience row (reward and version come with the score)."""
    row = {"response_ids": np.asarray(traj.response_ids, np.int32),
           "behaviour_logprobs": np.asarray(traj.behaviour_logprobs, np.float32),
           "finish_reason": traj.finish_reason}
    if traj.policy_mask is not None:
        row["policy_mask"] = np.asarray(traj.policy_mask, np.uint8)
    if traj.token_versions is not None:
        row["token_versions"] = np.asarray(traj.token_versions, np.int32)
    return row


def from_row(row: dict[str, Any]) -> Trajectory:
    """A complete experience row (prompt fields + `to_row` + reward + version) as the Trajectory the learner trains on."""
    return Trajectory(uid=row["uid"], prompt_uid=row["prompt_uid"], sample_index=int(row["sample_index"]),
                      prompt_ids=np.asarray(row["prompt_ids"], np.int32),
                      response_ids=np.asarray(row["response_ids"], np.int32),
                      behaviour_logprobs=np.asarray(row["behaviour_logprobs"], np.float32),
                      version=int(row["version"]), finish_reason=row.get("finish_reason", "eos"),
                      reward=float(row["reward"]), data_source=row.get("data_source", ""),
                      ground_truth=row.get("ground_truth"),
                      policy_mask=(None if row.get("policy_mask") is None
                                   else np.asarray(row["policy_mask"], np.uint8)),
                      token_versions=(None if row.get("token_versions") is None
                                      else np.asarray(row["token_versions"], np.int32)))
