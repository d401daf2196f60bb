"""Per-token versions: staleness judged token by token, trajectories that span versions counted,
and token versions kept through an experience row."""

import numpy as np

from laminar_jax.learner.batch import mixed_version_frac, staleness, token_staleness
from laminar_jax.types import Trajectory, from_row, to_row


def _traj(uid, n, version, token_versions=None, mask=None):
    return Trajectory(uid=uid, prompt_uid=uid.split("/")[0], sample_index=0, prompt_ids=np.arange(3, dtype=np.int32),
                      response_ids=np.arange(len(mask) if mask is not None else n, dtype=np.int32),
                      behaviour_logprobs=np.zeros(n, np.float32), version=version,
                      token_versions=None if token_versions is None else np.asarray(token_versions, np.int32),
                      policy_mask=None if mask is None else np.asarray(mask, np.uint8), reward=1.0)


def test_token_staleness_judges_each_token_on_its_own_version():
    a = _traj("a/0", 4, 3, [3, 3, 5, 5])  # spans versions 3 and 5
    b = _traj("b/0", 2, 4)  # one version, no per-token record
    s = token_staleness([a, b], learner_version=6)
    # tokens: 3, 3, 1, 1 (a) and 2, 2 (b)
    assert (s.mean, s.max, s.min) == (2.0, 3, 1)
    # per trajectory (its oldest token): 3 and 2
    assert staleness(np.array([a.version, b.version]), 6).mean == 2.5
    assert mixed_version_frac([a, b]) == 0.5 and mixed_version_frac([b]) == 0.0


def test_token_versions_follow_policy_tokens_through_a_row():
    t = _traj("c/1", 2, 1, [1, 2], mask=[1, 0, 0, 1])  # two observation tokens between
    row = {"uid": t.uid, "prompt_uid": t.prompt_uid, "sample_index": 1, "prompt_ids": t.prompt_ids,
           "reward": 1.0, "version": t.version, **to_row(t)}
    back = from_row(row)
    assert back.policy_token_versions().tolist() == [1, 2]
    row.pop("token_versions")  # a row written without them: every token is the trajectory's version
    assert from_row(row).policy_token_versions().tolist() == [1, 1]
