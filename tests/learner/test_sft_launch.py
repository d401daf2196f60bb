"""launch/sft.py: supervised warm-start alone on a prompt/response jsonl, exported as a HF directory;
the (prompt, response) pairs are built like RL prompts (chat template, BOS, length policy)."""

import json
import os
import subprocess
import sys

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
