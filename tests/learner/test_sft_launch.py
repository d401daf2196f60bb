"""launch/sft.py: supervised warm-start alone on a prompt/response jsonl, exported as a HF directory;
the (prompt, response) pairs are built like RL prompts (chat template, BOS, length policy)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from laminar_jax.data.config import DataSection
from laminar_jax.data.records import BadRowError
from laminar_jax.data.sft import sft_pairs
from laminar_jax.model.tokenizer import BuiltinTokenizer
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = BuiltinTokenizer()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(n):
    return [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+{i}="}], "response": str(2 * i)}
            for i in range(n)]


def test_pairs_from_a_file_follow_the_rl_prompt_format(tmp_path):
    path = _write(tmp_path / "sft.jsonl", _rows(3) + [{"data_source": "s", "prompt": "plain 7*6=", "response": "42"}])
    pairs, counts = sft_pairs(DataSection(source="file", path=path), TOK, max_total_len=64, seed=0)
    assert counts["rows"] == 4 and len(pairs) == 4
    assert pairs[1] == ([TOK.bos_id] + TOK.encode("1+1="), TOK.encode("2") + [TOK.eos_id])
    assert pairs[3][0] == [TOK.bos_id] + TOK.encode("plain 7*6=")
    # Responses are cut to what fits in rollout.max_total_len; over-long prompts follow data.overlong.
    long = _write(tmp_path / "long.jsonl", [{"data_source": "s", "prompt": "q", "response": "x" * 50},
                                            {"data_source": "s", "prompt": "y" * 40, "response": "z"}])
    pairs, counts = sft_pairs(DataSection(source="file", path=long, max_prompt_tokens=16), TOK, max_total_len=20, seed=0)
    assert len(pairs) == 1 and len(pairs[0][0]) + len(pairs[0][1]) == 20
    assert counts["response_truncated"] == 1 and counts["overlong_filtered"] == 1


def test_a_row_without_response_is_an_error_naming_it(tmp_path):
    path = _write(tmp_path / "rl.jsonl", _rows(2) + [{"data_source": "s", "prompt": "q",
                                                       "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(BadRowError, match=r"rl.jsonl row 2 \(line 3\): 'response' must be a non-empty string"):
        sft_pairs(DataSection(source="file", path=path), TOK, max_total_len=64, seed=0)
    pairs, counts = sft_pairs(DataSection(source="file", path=path, skip_bad_rows=True), TOK, max_total_len=64, seed=0)
    assert len(pairs) == 2 and counts["bad_rows_skipped"] == 1


def _sft(args, timeout=240):
    env = child_env(JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(ROOT, "launch", "sft.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_launch_sft_trains_on_a_jsonl_and_exports(tmp_path):
    from laminar_jax.model import from_pretrained, load_tokenizer

    path = _write(tmp_path / "sft.jsonl", _rows(40))
    out = tmp_path / "hf"
    res = _sft(["--config=configs/demo.py:short", f"--out={out}", "--steps=30", "--config.data.source=file",
                f"--config.data.path={path}", f"--config.runtime.compilation_cache_dir={tmp_path / 'cache'}"])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["pairs"] == 40 and summary["steps"] == 30
    assert summary["loss_last"] < summary["loss_first"]  # it learned something
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    model, tok = from_pretrained(str(out)), load_tokenizer(str(out))
    assert tok.encode("1+1=") == TOK.encode("1+1=") and model.cfg.vocab_size == 128
    assert any((tmp_path / "cache").iterdir())  # the compilation cache is on


def test_launch_sft_usage_errors(tmp_path):
    res = _sft(["--config=configs/demo.py:short"], timeout=120)
    assert res.returncode == 2 and "--out=<hf_dir>" in res.stderr
    res = _sft(["--config=configs/demo.py", f"--out={tmp_path}", "--config.runtime.sft_warmup_steps=0"], timeout=120)
    assert res.returncode != 0 and "runtime.sft_warmup_steps (or --steps)" in res.stderr


def test_one_sft_step_trains_at_lr_and_longer_schedules_are_unchanged():
    import jax
    import optax
    from flax import nnx

    from laminar_jax.config import finalize, repo_config
    from laminar_jax.learner.sft import sft_schedule
    from laminar_jax.model import build_model, load_tokenizer
    from laminar_jax.runtime.parts import sft_warmup

    assert float(sft_schedule(1e-3, 1)(0)) == pytest.approx(1e-3)
    for steps in (2, 30, 200):
        old = optax.warmup_cosine_decay_schedule(0.0, 1e-3, max(1, steps // 10), steps)
        assert [float(sft_schedule(1e-3, steps)(i)) for i in range(steps + 2)] == \
            [float(old(i)) for i in range(steps + 2)]
    # runtime.sft_warmup_steps=1 before RL: one step that changes the weights.
    c = repo_config("demo", "short")
    c.runtime.sft_warmup_steps = 1
    cfg = finalize(c)
    model = build_model(cfg.model)

    def params():
        return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]

    before = params()
    losses = sft_warmup(cfg, model, load_tokenizer(cfg.model.tokenizer))
    assert len(losses) == 1 and np.isfinite(losses[0])
    assert any(not np.array_equal(a, b) for a, b in zip(before, params()))


def test_out_is_checked_before_training(tmp_path):
    from laminar_jax.learner.sft import OutDirError, claim_out_dir, commit_out_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(OutDirError, match="file: is a file, not a directory"):
        claim_out_dir(str(tmp_path / "file"), overwrite=True)
    with pytest.raises(OutDirError, match=f"{tmp_path / 'file'} is a file, not a directory"):
        claim_out_dir(str(tmp_path / "file" / "sub" / "hf"), overwrite=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "stale.safetensors").write_text("old")
    with pytest.raises(OutDirError, match=r"full: directory is not empty \(1 entry\); pass --overwrite"):
        claim_out_dir(str(full), overwrite=False)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OutDirError, match="locked: directory is not writable"):
            claim_out_dir(str(locked), overwrite=True)
    # Overwrite: the export is staged beside the directory and then replaces it whole (no stale file).
    staging = claim_out_dir(str(full), overwrite=True)
    assert os.path.dirname(staging) == str(tmp_path) and os.listdir(staging) == []
    (tmp_path / staging / "config.json").write_text("{}")
    commit_out_dir(staging, str(full))
    assert os.listdir(full) == ["config.json"] and sorted(os.listdir(tmp_path)) == ["file", "full"] + (
        ["locked"] if os.geteuid() != 0 else [])
    # A new directory (and its parents) and an empty one are taken as they are.
    for out in (tmp_path / "a" / "b" / "hf", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        commit_out_dir(claim_out_dir(str(out), overwrite=False), str(out))
        assert out.is_dir() and os.listdir(out) == []


def test_launch_sft_one_step_refuses_then_overwrites_a_non_empty_out(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("stale shard of another export")
    args = ["--config=configs/demo.py:short", f"--out={out}", "--steps=1",
            f"--config.runtime.compilation_cache_dir={tmp_path / 'cache'}"]
    res = _sft(args, timeout=120)
    assert res.returncode == 2 and "directory is not empty (1 entry); pass --overwrite" in res.stderr
    assert "sft:" not in res.stderr  # refused before any data, model or training
    res = _sft(args + ["--overwrite"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["steps"] == 1
    assert "model-00001-of-00002.safetensors" not in os.listdir(out) and (out / "model.safetensors").is_file()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no staging left behind
