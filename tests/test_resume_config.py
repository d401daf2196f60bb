"""compare_resume_config: ledger-breaking changes are refused, the rest listed."""

import dataclasses
import json

from laminar_jax.config import Config
from laminar_jax.resume import REFUSED, compare_resume_config, flatten


def _dict(cfg: Config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))  # what config.json holds


def test_identical_configs_have_nothing_to_say():
    assert compare_resume_config(_dict(Config()), _dict(Config())) == ([], [])


def test_group_size_change_is_refused_and_named():
    base = Config()
    new = dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, samples_per_prompt=8))
    errors, changes = compare_resume_config(_dict(base), _dict(new))
    assert changes == [] and len(errors) == 1
    assert errors[0].startswith("runtime.samples_per_prompt: 4 -> 8 cannot change on resume")


def test_harmless_changes_are_listed_and_run_dir_ignored():
    base = Config()
    new = dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, total_steps=99, run_dir="/elsewhere"),
                              learner=dataclasses.replace(base.learner, lr=3e-6))
    errors, changes = compare_resume_config(_dict(base), _dict(new))
    assert errors == []
    assert changes == ["learner.lr: 1e-06 -> 3e-06", "runtime.total_steps: 20 -> 99"]


def test_every_refused_key_exists_in_the_config():
    keys = set(flatten(_dict(Config())))
    assert set(REFUSED) <= keys, sorted(set(REFUSED) - keys)


def test_data_files_seed_and_model_changes_are_refused_added_keys_listed():
    base = _dict(Config())
    new = json.loads(json.dumps(base))
    new["data"]["path"], new["seed"], new["model"]["preset"] = "other.jsonl", 7, "small"
    new["relay"]["a_new_key"] = 1
    errors, changes = compare_resume_config(base, new)
    assert [e.split(":")[0] for e in errors] == ["data.path", "model.preset", "seed"]
    assert changes == ["relay.a_new_key: '<absent>' -> 1"]
