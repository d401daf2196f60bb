"""One record per sample: the dispatcher creates it, the rollout worker takes it, the store adds the
generated and scored fields to it, and the learner's batch is made of it: the same object in one
process. Rows of plain fields are made only for a checkpoint."""

import json

import numpy as np

from laminar_jax.buffer import ExperienceStore, PromptLedger
from laminar_jax.buffer.dispatch import Dispatcher, WorkQueue
from laminar_jax.data.records import Prompt
from laminar_jax.scheduler.modes import get_policy
from laminar_jax.types import PROMPT_FIELDS, REQUIRED_FIELDS, Trajectory, to_row


class _ListSource:
    """A fake prompt source over a list (position = next index)."""

    def __init__(self, prompts):
        self.prompts, self.pos = prompts, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= len(self.prompts):
            raise StopIteration
        self.pos += 1
        return self.prompts[self.pos - 1]

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = state["pos"]


def _prompt(i: int) -> Prompt:
    return Prompt(uid=f"d/{i}@0", index=i, epoch=0, data_source="math", prompt_text=f"p{i}",
                  prompt_ids=[1, 2 + i, 3], ground_truth=str(i), extra_info={"i": i})


def _dispatcher(n_prompts: int = 2, samples: int = 2):
    store, queue = ExperienceStore(group_size=samples), WorkQueue()
    d = Dispatcher(_ListSource([_prompt(i) for i in range(n_prompts)]), PromptLedger(), store, queue,
                   get_policy("laminar"), prompts_per_step=1, samples_per_prompt=samples, max_staleness=None,
                   seed=0, max_queued_prompts=8)
    return d, store, queue


def _generate(store: ExperienceStore, rec: Trajectory, version: int = 0) -> None:
    """What the buffer does with an engine's output for `rec`: its generated fields, then the score."""
    out = Trajectory(rec.uid, rec.prompt_uid, rec.sample_index, rec.prompt_ids,
                     response_ids=np.array([7, 8], np.int32), behaviour_logprobs=np.array([-0.5, -0.25], np.float32),
                     version=version, finish_reason="length", token_versions=np.array([version, version], np.int32))
    store.put_many(rec.uid, to_row(out))
    store.put_many(rec.uid, {"reward": 1.0, "version": version})


def test_the_dispatched_record_is_what_the_worker_takes_and_the_learner_gets():
    d, store, queue = _dispatcher()
    assert d.pump(learner_version=0) == 2
    work = queue.take(4)
    assert [w.uid for w in work] == ["d/0@0/0", "d/0@0/1", "d/1@0/0", "d/1@0/1"]
    first = work[0]
    assert isinstance(first, Trajectory) and first is store.row(first.uid)  # no copy on the way to a worker
    assert (first.data_source, first.ground_truth, first.extra_info) == ("math", "0", {"i": 0})
    assert first.prompt_ids.dtype == np.int32 and first.seed is not None and first.reward is None
    assert "reward" not in first and first.response_ids is None
    for rec in work:
        _generate(store, rec, version=3)
    batch = store.get("learner", 2, REQUIRED_FIELDS, timeout=1)
    assert [id(r) for r in batch] == [id(w) for w in work]  # the same objects, fields added on the way
    assert first.response_ids.tolist() == [7, 8] and first.version == 3 and first.reward == 1.0
    assert first.finish_reason == "length" and first.policy_token_versions().tolist() == [3, 3]


def test_a_checkpoint_row_restores_the_record_and_its_ready_fields():
    d, store, queue = _dispatcher(n_prompts=1)
    d.pump(learner_version=0)
    done, pending = queue.take(2)
    _generate(store, done, version=1)
    state = json.loads(json.dumps(d.snapshot()))  # what a checkpoint keeps: plain rows

    d2, store2, queue2 = _dispatcher(n_prompts=1)
    assert d2.restore(state, REQUIRED_FIELDS) == 1  # the group is partial: re-dispatched
    again = queue2.take(4)
    assert [r.uid for r in again] == [pending.uid]  # only the missing sample is generated again
    assert again[0] is store2.row(pending.uid)
    kept = store2.row(done.uid)
    for f in (*PROMPT_FIELDS, *REQUIRED_FIELDS, "finish_reason", "token_versions"):
        a, b = getattr(kept, f), getattr(done, f)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, f
        assert type(a) is type(b), f


def test_a_snapshot_is_a_value_fields_written_after_it_are_not_ready_in_it():
    """A checkpoint is written after its snapshot is taken (the learner's save): a sample scored in
    between must restore as unscored, re-generated, never as a ready record missing its reward."""
    d, store, queue = _dispatcher(n_prompts=1)
    d.pump(learner_version=0)
    done, late = queue.take(2)
    _generate(store, done, version=1)
    out = Trajectory(late.uid, late.prompt_uid, late.sample_index, late.prompt_ids,
                     response_ids=np.array([7], np.int32), behaviour_logprobs=np.array([-0.5], np.float32), version=1)
    store.put_many(late.uid, to_row(out))  # generated, not yet scored
    snap = d.snapshot()
    store.put_many(late.uid, {"reward": 0.5, "version": 1})  # scored while the checkpoint is written
    state = json.loads(json.dumps(snap))

    d2, store2, queue2 = _dispatcher(n_prompts=1)
    assert d2.restore(state, REQUIRED_FIELDS) == 1
    assert [r.uid for r in queue2.take(4)] == [late.uid]  # generated again
    assert store2.ready_groups("learner", REQUIRED_FIELDS) == 0
    restored = store2.row(late.uid)
    assert restored.reward is None and "reward" not in restored


class _FakeEpisodeDriver:
    """A fake EpisodeDriver that records what each episode starts with."""

    def __init__(self):
        self.started = []

    def start(self, request, record):
        self.started.append((request, record))


def test_an_episode_starts_from_the_record_taken_without_asking_the_buffer():
    from laminar_jax.rollout.records import TurnSpec
    from laminar_jax.runtime.rollout_worker import EpisodeFeed

    def record_of(uid):
        raise AssertionError(f"the buffer was asked for {uid!r}: the record taken carries its fields")

    d, _, queue = _dispatcher(n_prompts=1, samples=1)
    d.pump(learner_version=0)
    (rec,) = queue.take(1)
    driver = _FakeEpisodeDriver()
    EpisodeFeed(driver, record_of, TurnSpec(max_new_tokens=4)).start(rec)
    ((request, record),) = driver.started
    assert request.uid == rec.uid and request.seed == rec.seed and request.turn is not None
    assert record == {"data_source": "math", "ground_truth": "0", "extra_info": {"i": 0}, "prompt_uid": "d/0@0",
                      "uid": "d/0@0/0"}
