"""A LoRA run's base in its own store: written once by the learner's side, read by server hosts;
a store holding another base is refused naming both identities (a resumed run keeps its base)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from laminar_jax.learner.publish import flatten_params
from laminar_jax.model.lora_version import BaseMismatchError, base_identity
from laminar_jax.relay.config import RelaySection
from laminar_jax.weights.lora_base import base_store_url, read_base, write_base
from tests.rollout.rollout_helpers import params_of, tiny_model


def _flat(seed: int) -> dict:
    return {k: np.array(v) for k, v in flatten_params(params_of(seed)).items()}


def test_the_base_store_round_trips_and_refuses_another_base(tmp_path):
    rcfg, url = RelaySection(), str(tmp_path / "weights")
    base = _flat(0)
    with pytest.raises(FileNotFoundError, match="lora_base"):
        read_base(rcfg, url, nnx.split(tiny_model(0))[1])
    write_base(rcfg, url, base, base_identity(base))
    write_base(rcfg, url, base, base_identity(base))  # again (a resume): the same base is fine
    served = read_base(rcfg, url, nnx.split(tiny_model(0))[1])
    assert served.id == base_identity(base)
    got = flatten_params(served.tree)
    for name, x in base.items():
        np.testing.assert_array_equal(got[name], x)
    other = _flat(1)
    with pytest.raises(BaseMismatchError) as e:
        write_base(rcfg, url, other, base_identity(other))
    assert base_identity(other) in str(e.value) and base_identity(base) in str(e.value)
    assert base_store_url(url).endswith("/lora_base")


def test_a_resumed_learner_adopts_the_runs_base(tmp_path):
    """The frozen base is not checkpointed and a resumed run skips the warm-up that made it: the
    learner takes the run's base from the base store, so its versions keep the run's identity."""
    from laminar_jax.learner import Learner
    from laminar_jax.weights.lora_base import adopt_base
    from tests.runtime.test_lora_publish import SECTION

    rcfg, url = RelaySection(), str(tmp_path / "weights")
    learner = Learner(SECTION, tiny_model(1))
    assert not adopt_base(learner, rcfg, url)  # a fresh run: nothing to adopt
    run_base = _flat(0)
    write_base(rcfg, url, run_base, base_identity(run_base))
    assert learner.lora.base_id != base_identity(run_base)
    assert adopt_base(learner, rcfg, url)
    assert learner.lora.base_id == base_identity(run_base)
    assert bytes(learner.published_params()["lora.base_sha256"]).hex() == base_identity(run_base)
    learner.close()
