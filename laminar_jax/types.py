"""Plain records that cross plane boundaries (buffer -> rollout -> buffer -> learner, and eval).

They hold host data only (numpy / Python scalars), so any plane can build, store, checkpoint
or send them without importing another plane.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

import numpy as np

FinishReason = Literal["eos", "length", "aborted"]


@dataclasses.dataclass(eq=False)
class Trajectory:
    """One sample's record, from dispatch to the learner's batch (as JetStream's `ActiveRequest`).

    The dispatcher creates it with the prompt's fields; the sample's generated fields (response,
    behaviour log-probs, finish reason, per-token versions) are added when its rollout completes,
    and `reward` with `version` when it is scored. In one process the same object travels: the
    experience store holds it, `get_batch` hands it out and the learner trains on it. Rows of plain
    fields (`to_row`, `from_row`, the store's checkpoint) are made only where it is persisted, and
    it is pickled where it crosses a process. A rollout engine's own output is a Trajectory too (a
    finished sequence), whose generated fields the buffer adds to the sample's record.

    Fields read by name as well (``rec["reward"]``, ``"reward" in rec``): a field is present once
    set (not None), which is how the store's rows are read.

    Attributes:
      uid: Unique id of this trajectory: f"{prompt_uid}/{sample_index}".
      prompt_uid: Id of the prompt (dataset index + epoch); the ledger key and the group.
      sample_index: Index within the prompt's group (0..n_samples-1).
      prompt_ids: i32[P] prompt token ids.
      response_ids: i32[R] generated ids (including the stop token when finish_reason == 'eos');
        None until generated.
      behaviour_logprobs: f32[N] log-prob of each *policy* token under `version` (sampling dist.):
        N = R without a policy mask, N = policy_mask.sum() with one. None until generated.
      version: The weight version that generated the first response token: the oldest (versions only
        grow along a trajectory), so trajectory-level staleness is judged on it. In the experience
        store it is set with the reward (None until scored), so a sample is never ready unscored.
      finish_reason: 'eos' (stop token), 'length' (max_new_tokens / max length) or 'aborted'.
      reward: Scalar reward, None until scored.
      data_source: Key of the reward function that scores it.
      ground_truth: Whatever the reward function needs.
      extra: Free-form JSON-serialisable metadata of the generation (timings, server id, moves...).
      policy_mask: u8[R] or None. Multi-turn episodes interleave generated tokens (1) with
        environment observation tokens (0) in response_ids; observations are context only (never
        trained on, no behaviour log-prob). None means every response token is generated.
      token_versions: i32[N] or None: the weight version that sampled each policy token (aligned with
        behaviour_logprobs). None means every token is `version`'s; outside runtime.mode='inflight'
        every entry equals `version`.
      seed: The sample's sampling seed (stable across processes and resumes); None outside dispatch.
      extra_info: The prompt's free-form record for its reward function and environment.
    """

    uid: str
    prompt_uid: str
    sample_index: int
    prompt_ids: Optional[np.ndarray]
    response_ids: Optional[np.ndarray] = None
    behaviour_logprobs: Optional[np.ndarray] = None
    version: Optional[int] = None
    finish_reason: FinishReason = "eos"
    reward: Optional[float] = None
    data_source: str = ""
    ground_truth: Any = None
    extra: dict = dataclasses.field(default_factory=dict)
    policy_mask: Optional[np.ndarray] = None
    token_versions: Optional[np.ndarray] = None
    seed: Optional[int] = None
    extra_info: Any = None

    def __getitem__(self, name: str) -> Any:
        if name not in self:
            raise KeyError(f"trajectory {self.uid!r} has no field {name!r} set")
        return getattr(self, name)

    def __contains__(self, name: object) -> bool:
        return name in _FIELD_NAMES and getattr(self, name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in self else default

    def episode_record(self) -> dict[str, Any]:
        """What an environment is chosen and reset with (a multi-turn episode): EPISODE_FIELDS."""
        return {k: getattr(self, k) for k in EPISODE_FIELDS}

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


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Trajectory))


# The prompt's fields, set on a sample's record when it is dispatched.
PROMPT_FIELDS = ("prompt_ids", "prompt_uid", "sample_index", "seed", "data_source", "ground_truth", "extra_info")
# What an environment is chosen and reset with (a multi-turn episode), besides the uid.
EPISODE_FIELDS = ("data_source", "ground_truth", "extra_info", "prompt_uid")
# The fields a finished trajectory adds to its sample's record (which holds the prompt's already:
# prompt_ids, prompt_uid, sample_index, seed, data_source, ground_truth, extra_info).
GENERATED_FIELDS = ("response_ids", "behaviour_logprobs", "finish_reason")
# What makes a record trainable: generated, scored, and stamped with its (first token's) weight version.
REQUIRED_FIELDS = ("response_ids", "behaviour_logprobs", "version", "reward")


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One request to generate outside the experience store: a prompt and the index of the sample
    within its group (an eval round's `EvalItem`). A training sample goes to the rollout workers
    as its own record (Trajectory), which carries the same fields."""

    uid: str
    prompt_uid: str
    sample_index: int
    prompt_ids: tuple[int, ...]
    seed: int


def to_row(traj: Trajectory) -> dict[str, Any]:
    """The generated fields of a finished trajectory (an engine's output), as the buffer adds them to
    the sample's record (reward and version come with the score)."""
    row = {"response_ids": np.asarray(traj.response_ids, np.int32),
           "behaviour_logprobs": np.asarray(traj.behaviour_logprobs, np.float32),
           "finish_reason": traj.finish_reason}
    if traj.policy_mask is not None:
        row["policy_mask"] = np.asarray(traj.policy_mask, np.uint8)
    if traj.token_versions is not None:
        row["token_versions"] = np.asarray(traj.token_versions, np.int32)
    return row


def from_row(row: dict[str, Any], group: Optional[str] = None) -> Trajectory:
    """A row of plain fields (the experience store's persisted form, or any subset of the fields
    with "uid") as a record; arrays keep their dtype. `group` is the prompt uid when the row has none."""
    unknown = sorted(set(row) - _FIELD_NAMES)
    if unknown:
        raise ValueError(f"row {row.get('uid')!r}: unknown trajectory field(s) {unknown} "
                         f"(known: {sorted(_FIELD_NAMES)})")
    rec = Trajectory(uid=row["uid"], prompt_uid=row.get("prompt_uid", group),
                     sample_index=int(row.get("sample_index", 0)), prompt_ids=None)
    for name, value in row.items():
        if name not in ("uid", "prompt_uid", "sample_index"):
            set_field(rec, name, value)
    return rec


def set_field(rec: Trajectory, name: str, value: Any) -> None:
    """Set one field of a record by name (the store's write), as its type: arrays stay arrays, the
    version an int, the reward a float."""
    if name not in _FIELD_NAMES:
        raise ValueError(f"trajectory {rec.uid!r}: no field {name!r} (known: {sorted(_FIELD_NAMES)})")
    if value is not None:
        if name in _ARRAY_FIELDS:
            value = np.asarray(value)
        elif name in ("version", "sample_index", "seed"):
            value = int(value)
        elif name == "reward":
            value = float(value)
    setattr(rec, name, value)


_ARRAY_FIELDS = frozenset({"prompt_ids", "response_ids", "behaviour_logprobs", "policy_mask", "token_versions"})
