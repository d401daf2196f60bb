"""The Engine is JetStream's contract plus the export/import of live sequences; the decode
schedule is one object it receives."""

import dataclasses
import inspect

import numpy as np
import pytest
from flax import nnx

from laminar_jax.rollout import DecodeSchedule, Engine, SlotInit
from tests.rollout.rollout_helpers import SECTION, tiny_model

CONTRACT = {"prefill", "insert", "prefill_insert", "generate", "free", "deactivate",  # JetStream's calls
            "read_slot", "write_slot",  # export / import of a live sequence
            "init_decode_state", "abstract_state",  # the decode state, and its shapes for compiling
            "bound",  # the programs for a params object (programs.Bound), which the rooms around it run
            "attention_impl"}


def test_the_engine_public_surface_is_the_contract():
    public = {n for n, _ in inspect.getmembers(Engine) if not n.startswith("_")}
    assert public == CONTRACT


def _engine(schedule=None) -> tuple[Engine, object]:
    model = tiny_model()
    graphdef, params = nnx.split(model)
    return Engine(graphdef, model.cfg, SECTION, schedule=schedule), params


def test_the_engine_runs_the_schedule_it_receives():
    """A schedule of 3 tokens per call, given to an engine whose section says 1: each generate()
    advances a live slot by 3."""
    base, params = _engine()
    assert base.schedule.steps_per_call == 1
    schedule = DecodeSchedule.of(SECTION, "cpu", base.kernels.needs_live_pages)
    assert schedule == base.schedule  # what the engine derives from its section
    engine, _ = _engine(dataclasses.replace(schedule, steps_per_call=3))
    init = SlotInit(np.zeros(engine.key_shape, np.uint32), 0.0, 0, 1.0, 10, np.zeros(0, np.int32))
    state = engine.prefill_insert(params, engine.init_decode_state(), 0, [1, 5, 7, 9], init)
    state, out = engine.generate(params, state)
    assert int(np.asarray(state.lengths)[0]) == 3 + 3  # the prompt's KV (4 - 1 tokens) and 3 fed tokens
    assert np.asarray(out.tokens).shape[0] == 3


def test_a_schedule_for_another_engine_is_refused_naming_the_field():
    base, _ = _engine()
    with pytest.raises(ValueError, match="schedule.num_slots=8"):
        _engine(dataclasses.replace(base.schedule, num_slots=8))
    with pytest.raises(ValueError, match="schedule.live_buckets"):
        _engine(dataclasses.replace(base.schedule, live_buckets=(0,) if base.schedule.uses_live_pages else (16,)))
