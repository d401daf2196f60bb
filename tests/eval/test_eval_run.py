"""Eval rounds in real local runs (demo short variant): eval.jsonl with versions, training goes on
while a round is in flight (laminar) or waits for it (sync), no eval sample reaches the training
ledger; launch/eval.py on the run directory and on its exported HF directory reproduces the run's
last round."""

import json
import os
import subprocess
import sys

import pytest

from laminar_jax.config import finalize, repo_config
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VAL = ["--config.data.val_size=12", "--config.runtime.eval_samples=3", "--config.runtime.eval_k=2"]


def demo_with_eval(run_dir, mode, total_steps, every, compile_ahead="none"):
    c = repo_config("demo", "short")
    c.runtime.mode, c.runtime.run_dir, c.runtime.total_steps = mode, str(run_dir), total_steps
    c.data.val_size, c.runtime.eval_samples, c.runtime.eval_k = 12, 3, 2
    c.runtime.eval_every, c.runtime.eval_before_train = every, True
    # "none": shapes compile at first use, for the tests that are not about warm-up (test_learner_warmup.py is).
    c.learner.compile_ahead = compile_ahead
    return finalize(c)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_steps(run_dir):
    return [r["step"] for r in read_jsonl(run_dir / "eval.jsonl")]


def has_wandb() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def laminar_run(tmp_path_factory):
    """One laminar run with eval rounds, logged to TensorBoard and (when installed) to W&B offline."""
    import dataclasses

    from laminar_jax.runtime.local import run_local

    run_dir = tmp_path_factory.mktemp("eval") / "laminar"
    cfg = demo_with_eval(run_dir, "laminar", 6, 3)
    loggers = ("tensorboard", "wandb") if has_wandb() else ("tensorboard",)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, loggers=loggers))
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    try:
        summary = run_local(cfg)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return run_dir, summary


def wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file (a LevelDB-style log of protobuf Records:
    32 KiB blocks, each chunk a 7-byte header crc32/u32, length/u16, type/u8)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data.startswith(b":W&B"), path
    pos, records, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(buf)
            buf = b""
    rows = []
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


@pytest.mark.skipif(not has_wandb(), reason="wandb is not installed (the 'wandb' extra)")
def test_wandb_offline_run_holds_the_logged_keys(laminar_run):
    run_dir, _ = laminar_run
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    keys = {k for row in rows for k in row}
    assert {"train/reward_mean", "train/loss", "warm_start/loss", "eval/overall/acc", "eval/overall/pass_at_2",
            "eval/synthetic_skew/truncation_rate", "rollout/queue"} <= keys, sorted(keys)
    train_steps = [row["train/step"] for row in rows if "train/reward_mean" in row]
    assert train_steps == list(range(1, 7)), rows
    assert sorted(row["eval/step"] for row in rows if "eval/overall/acc" in row) == eval_steps(run_dir), rows


def test_wandb_logger_without_the_package_names_runtime_loggers(monkeypatch, tmp_path):
    from laminar_jax.config import ConfigError
    from laminar_jax.monitor.loggers import make_loggers

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"runtime\.loggers.*pip install"):
        make_loggers(("tensorboard", "wandb"), str(tmp_path))


def test_laminar_run_writes_eval_rounds(laminar_run):
    run_dir, s = laminar_run
    rounds = read_jsonl(run_dir / "eval.jsonl")
    steps = eval_steps(run_dir)
    # Before training, every 3 steps, the last step; a round due while another is in flight (the
    # first one may still run at step 3 on a loaded machine) starts when that one is collected.
    assert steps[0] == 0 and steps[-1] == 6 and all(3 <= x < 6 for x in steps[1:-1]) and len(steps) <= 3, steps
    for r in rounds:
        assert r["version"] == r["step"] and sum(r["versions"].values()) == 12 * 4  # greedy + 3 sampled
        assert all(int(v) >= r["step"] for v in r["versions"])  # never an older policy than it claims
        o = r["metrics"]["overall"]
        assert o["prompts"] == 12 and o["samples"] == 48 and 0.0 <= o["acc"] <= 1.0 and 0.0 <= o["pass@2"] <= 1.0
        assert o["response_len"] > 0 and 0.0 <= o["truncation_rate"] <= 1.0
        assert r["metrics"]["synthetic_skew"] == o  # one data source
    # Eval samples are never trained on nor counted in the prompt ledger.
    assert s["consumed_prompts"] == 6 * 8 and s["duplicated_prompts"] == 0 and s["lost_prompts"] == 0
    assert s["eval_rounds"] == len(steps) and s["eval_step"] == 6 and s["eval_acc"] == rounds[-1]["metrics"]["overall"]["acc"]
    tb = tensorboard_scalars(run_dir / "tb")
    assert tb["eval/overall/acc"] == steps and tb["eval/synthetic_skew/pass_at_2"] == steps
    assert tb["train/reward_mean"] == list(range(1, 7))


def tensorboard_scalars(tb_dir) -> dict:
    """{tag: [steps]} of the scalars in a TensorBoard event directory (TFRecord framing:
    u64 length, u32 crc, the Event proto, u32 crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    out: dict = {}
    for path in sorted(tb_dir.glob("events*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append(event.step)
    return out


def test_laminar_training_goes_on_while_a_round_is_in_flight(tmp_path):
    """One large round before training (32 prompts x 32 responses): the learner trains while the
    round's requests share the servers' slots. The buffer stamps the learner version when the
    round's last sample is scored (not when the driver collects it). The round must outlast the
    first learner step: 16 x 16 no longer did once decode ran on the native CPU kernels."""
    import dataclasses

    from laminar_jax.runtime.local import run_local

    # Every shape compiled ahead: a first step that compiles its own shapes takes seconds, and the
    # round was once scored before it finished (learner_version_at_done 0).
    cfg = demo_with_eval(tmp_path / "big", "laminar", 3, 0, compile_ahead="all")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, eval_samples=31, eval_k=4),
                              data=dataclasses.replace(cfg.data, val_size=32))
    s = run_local(cfg)
    (r,) = read_jsonl(tmp_path / "big" / "eval.jsonl")
    assert r["step"] == 0 and sum(r["versions"].values()) == 32 * 32
    assert r["learner_version_at_done"] >= 1, r  # a step completed between submission and result
    assert s["steps"] == 3 and s["consumed_prompts"] == 3 * 8


@pytest.mark.slow
def test_sync_run_pins_each_round_to_one_version_and_waits_for_it(tmp_path):
    from laminar_jax.runtime.local import run_local

    s = run_local(demo_with_eval(tmp_path / "sync", "sync", 2, 1))
    rounds = read_jsonl(tmp_path / "sync" / "eval.jsonl")
    assert [r["step"] for r in rounds] == [0, 1, 2]
    for r in rounds:
        assert r["versions"] == {str(r["step"]): 48} and r["learner_version_at_done"] == r["step"]
    assert s["consumed_prompts"] == 2 * 8 and s["eval_rounds"] == 3


def _eval_cmd(checkpoint, out):
    return [sys.executable, os.path.join(ROOT, "launch", "eval.py"), f"--config={ROOT}/configs/demo.py:short",
            f"--checkpoint={checkpoint}", f"--out={out}", *VAL]


def _run(argv):
    env = child_env(JAX_PLATFORMS="cpu")
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_launch_eval_on_the_run_dir_and_its_hf_export_reproduces_the_last_round(laminar_run, tmp_path):
    from laminar_jax.runtime import export_pretrained

    run_dir, _ = laminar_run
    last = read_jsonl(run_dir / "eval.jsonl")[-1]
    rec = _run(_eval_cmd(run_dir, tmp_path / "run_eval.jsonl"))
    assert rec["kind"] == "run" and rec["version"] == 6 and rec["versions"] == {"6": 48}
    # Same weights, same prompts, same per-sample seeds: the engine gives the same responses
    # offline as on the run's servers.
    assert rec["metrics"] == last["metrics"]
    assert read_jsonl(tmp_path / "run_eval.jsonl") == [rec]
    export_pretrained(str(run_dir), str(tmp_path / "hf"))
    hf = _run(_eval_cmd(tmp_path / "hf", tmp_path / "hf_eval.jsonl"))
    assert hf["kind"] == "hf" and hf["version"] is None and hf["metrics"] == last["metrics"]


def test_launch_eval_errors_name_the_problem(tmp_path):
    env = child_env(JAX_PLATFORMS="cpu")
    no_val = [sys.executable, os.path.join(ROOT, "launch", "eval.py"), f"--config={ROOT}/configs/demo.py:short",
              f"--checkpoint={tmp_path}", "--config.data.val_size=0"]
    res = subprocess.run(no_val, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "data.val_files" in res.stderr
    res = subprocess.run(no_val + VAL, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and f"--checkpoint={tmp_path}: no config.json" in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("override,key", [
    ({"runtime.eval_every": 2, "data.val_size": 0}, "runtime.eval_every"),
    ({"runtime.eval_before_train": True, "data.val_size": 0}, "runtime.eval_before_train"),
    ({"runtime.eval_every": -1, "data.val_size": 4}, "runtime.eval_every"),
    ({"runtime.eval_k": 5, "data.val_size": 4}, "runtime.eval_k"),
    ({"runtime.eval_temperature": 0.0}, "runtime.eval_temperature"),
    ({"runtime.eval_every": 2, "data.val_size": 4, "data.source": "file", "data.path": "x.jsonl"}, "runtime.eval_every"),
    ({"data.val_files": " "}, "data.val_files"),
    ({"runtime.loggers": ("tensorboard", "mlflow")}, "runtime.loggers"),
    ({"runtime.eval_every": 2, "data.val_size": 4, "env.enabled": True}, "runtime.eval_every"),
])
def test_bad_eval_config_names_the_key(override, key):
    from laminar_jax.config import ConfigError

    c = repo_config("demo", "short")
    for dotted, v in override.items():
        section, name = dotted.split(".")
        setattr(getattr(c, section), name, v)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        finalize(c)


def test_val_files_in_verl_layout_are_the_eval_prompts(tmp_path):
    from laminar_jax.data.config import DataSection
    from laminar_jax.data.source import build_val_prompts
    from laminar_jax.model import load_tokenizer

    path = tmp_path / "val.jsonl"
    rows = [{"data_source": "synthetic_skew", "prompt": [{"role": "user", "content": f"ab*{k}="}],
             "reward_model": {"ground_truth": "x"}} for k in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = DataSection(val_files=str(path), max_prompt_tokens=32)
    prompts = build_val_prompts(section, load_tokenizer("builtin"), max_prompts=3)
    assert [p.index for p in prompts] == [0, 1, 2] and all(p.uid.startswith("val/val/") for p in prompts)
    with pytest.raises(FileNotFoundError, match="data.val_files"):
        build_val_prompts(DataSection(val_files=str(tmp_path / "nope.jsonl")), load_tokenizer("builtin"))
    synth = build_val_prompts(DataSection(val_size=5), load_tokenizer("builtin"))
    train = build_val_prompts(DataSection(val_size=5, seed=1), load_tokenizer("builtin"))
    assert len(synth) == 5 and [p.prompt_text for p in synth] != [p.prompt_text for p in train]


@pytest.mark.slow
def test_eval_rounds_on_the_ray_runtime(tmp_path):
    """The same rounds with the roles as Ray actors: eval requests cross to the rollout actors and
    their results come back through the buffer actor."""
    pytest.importorskip("ray")
    import dataclasses

    from laminar_jax.runtime import run

    cfg = demo_with_eval(tmp_path / "ray", "laminar", 4, 2)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, kind="ray", wait_timeout_s=240.0))
    s = run(cfg)
    rounds = read_jsonl(tmp_path / "ray" / "eval.jsonl")
    steps = [r["step"] for r in rounds]  # a round due while another runs starts when it is collected
    assert steps[0] == 0 and steps[-1] == 4 and steps == sorted(set(steps)) and s["eval_rounds"] == len(rounds)
    assert all(sum(r["versions"].values()) == 48 and min(map(int, r["versions"])) >= r["step"] for r in rounds)
    assert s["consumed_prompts"] == 4 * 8 and s["lost_prompts"] == 0
