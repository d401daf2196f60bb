"""Dynamic sampling (learner.dynamic_sampling) through a whole run: zero-signal groups are filtered
and replaced by fresh prompts in every mode while other servers are mid-generation, the refill bound
holds, and the ledger and the summary account for every prompt (none lost, none trained twice).

The driver tests use the real buffer service, dispatcher, ledger and rollout workers with fake
servers whose rewards are fixed per prompt (tests/runtime/runtime_fakes.py); the last test is a
real local run of the demo."""

import dataclasses
import json
import os
import zlib

import pytest

from laminar_jax.config import finalize
from tests.runtime import test_driver
from tests.runtime.runtime_fakes import FakeServer


def zero_signal_prompt(prompt_uid: str) -> bool:
    return zlib.crc32(prompt_uid.encode()) % 2 == 0


class SignalServer(FakeServer):
    """A fake server that scores its own samples (as a multi-turn episode is scored): every sample of
    a zero-signal prompt gets 1.0; the others get their sample index's parity."""

    everything_zero_signal = False

    def step(self):
        out = []
        for t in super().step():
            flat = self.everything_zero_signal or zero_signal_prompt(t.prompt_uid)
            out.append(dataclasses.replace(t, reward=1.0 if flat else float(t.sample_index % 2)))
        return out


def _run(tmp_path, monkeypatch, mode, everything_zero_signal=False, retries=10, steps=4):
    monkeypatch.setattr(test_driver, "FakeServer", SignalServer)
    monkeypatch.setattr(SignalServer, "everything_zero_signal", everything_zero_signal)
    cd = test_driver.repo_config("demo", "short")
    cd.runtime.update(mode=mode, total_steps=steps, progress=False, timeline=False, num_servers=2,
                      run_dir=str(tmp_path / "run"), wait_timeout_s=60.0)
    if mode == "stream":
        cd.buffer.max_staleness = 1
    cd.scheduler.heartbeat_timeout_s = 2.0
    cd.data.reward_workers = 1
    cd.learner.dynamic_sampling = True
    cd.learner.dynamic_sampling_max_retries = retries
    cfg = finalize(cd)
    driver, trained = test_driver._driver(cfg)
    s = driver.run()
    return cfg, driver, s, trained


@pytest.mark.parametrize("mode", ["laminar", "sync", "one_step", "stream", "inflight"])
def test_zero_signal_groups_are_filtered_and_replaced_in_every_mode(mode, tmp_path, monkeypatch):
    cfg, driver, s, trained = _run(tmp_path, monkeypatch, mode)
    test_driver._exactly_once(s, cfg, trained)  # full batches, no prompt lost or trained twice
    prompts = {uid.rsplit("/", 1)[0] for uid in trained}
    assert not any(zero_signal_prompt(p) for p in prompts), "a zero-signal group was trained on"
    ledger = driver.buffer.ledger.state_dict()["entries"]
    filtered = {u for u, e in ledger.items() if e["state"] == "filtered"}
    consumed = {u for u, e in ledger.items() if e["state"] == "consumed"}
    assert consumed == prompts and filtered and all(zero_signal_prompt(u) for u in filtered)
    states = driver.buffer.ledger.summary()
    assert states["total"] == states["consumed"] + states["filtered"] + states["dropped"] + states["in_flight"]
    assert s["zero_signal_groups_dropped"] == len(filtered) and s["zero_signal_groups_kept"] == 0
    assert s["zero_signal_drop_rate"] == round(len(filtered) / (len(filtered) + len(consumed)), 4)
    with open(os.path.join(cfg.runtime.run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    assert all(0.0 <= r["zero_signal_drop_rate"] <= 1.0 for r in steps)
    assert sum(r["zero_signal_dropped"] for r in steps) == len(filtered)


def test_the_refill_bound_fills_the_batch_with_zero_signal_groups_past_it(tmp_path, monkeypatch):
    """Every group is zero-signal: each batch filters retries x prompts_per_step groups, then trains on
    the next ones rather than waiting for ever."""
    cfg, driver, s, trained = _run(tmp_path, monkeypatch, "sync", everything_zero_signal=True, retries=1, steps=3)
    test_driver._exactly_once(s, cfg, trained)
    per_batch = cfg.runtime.prompts_per_step
    assert s["zero_signal_groups_dropped"] == 3 * per_batch and s["zero_signal_groups_kept"] == 3 * per_batch


@pytest.mark.slow  # two real demo runs; the driver tests above cover every mode in the default tier
def test_demo_run_filters_zero_signal_groups_and_resumes_without_loss(tmp_path):
    from laminar_jax.runtime.local import run_local

    def run(steps):
        cd = test_driver.repo_config("demo", "short")
        cd.runtime.run_dir, cd.runtime.total_steps = str(tmp_path / "run"), steps
        cd.learner.dynamic_sampling = True
        cd.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test
        return run_local(finalize(cd))

    first = run(2)
    # After the SFT warm-start about half the demo's groups of 4 are all-correct or all-wrong.
    assert first["steps"] == 2 and first["zero_signal_groups_dropped"] > 0
    assert first["lost_prompts"] == 0 and first["duplicated_prompts"] == 0 and first["consumed_prompts"] == 2 * 8
    second = run(4)  # resumes from the first run's final checkpoint, its ledger included
    assert second["steps"] == 4 and second["steps_this_run"] == 2
    assert second["lost_prompts"] == 0 and second["duplicated_prompts"] == 0 and second["consumed_prompts"] == 4 * 8
    assert second["zero_signal_groups_dropped"] >= first["zero_signal_groups_dropped"]
    d, c = second["zero_signal_groups_dropped"], second["consumed_prompts"]
    assert second["zero_signal_drop_rate"] == round(d / (d + c), 4)
    with open(os.path.join(tmp_path, "run", "metrics.jsonl")) as f:  # both runs' steps, each counted once
        assert sum(json.loads(line)["zero_signal_dropped"] for line in f) == d
