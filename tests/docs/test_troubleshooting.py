"""Every error quoted in docs/TROUBLESHOOTING.md is triggered here and its text checked.

The doc marks each quote with ``<!-- err:ID -->`` followed by a ```text block; ``…`` in the quote
stands for a varying part. A trigger returns the message the user sees (``str(exc)``, a logged
reward error, or a process's stderr); the quote's pieces must all appear in it, in order.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from laminar_jax.buffer import ExperienceStore
from laminar_jax.config import finalize
from laminar_jax.model import from_pretrained, load_hf_config, load_tokenizer
from laminar_jax.relay import RelayClient
from laminar_jax.rollout import Request
from laminar_jax.rollout.paged import PageAllocator
from laminar_jax.runtime.rollout_worker import RolloutWorker
from tests.subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "TROUBLESHOOTING.md")
_QUOTE = re.compile(r"<!-- err:([a-z0-9-]+) -->\s*```text\n(.*?)\n```", re.DOTALL)


def doc_quotes() -> dict[str, str]:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    found = _QUOTE.findall(text)
    quotes = dict(found)
    assert len(quotes) == len(found), "duplicate err ids in TROUBLESHOOTING.md"
    assert text.count("<!-- err:") == len(found), "an err marker without a ```text block right after it"
    return quotes


def raised(fn) -> str:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the message is what we check
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{fn} raised nothing")


def assert_quoted(quote: str, message: str) -> None:
    pos = 0
    for piece in (p.strip() for p in quote.split("…")):
        if not piece:
            continue
        i = message.find(piece, pos)
        assert i >= 0, f"doc fragment {piece!r} not found (in order) in the message:\n{message[:2000]}"
        pos = i + len(piece)


# ------------------------------------------------------------------------------------ triggers
def _finalize_with(**kv):
    from laminar_jax.config import default_config

    cd = default_config()
    for key, value in kv.items():
        section, field = key.split(".")
        cd[section][field] = value
    return finalize(cd)


def _demo_run(tmp_path, name: str, **kv):
    from configs.demo import get_config
    from laminar_jax.runtime import run

    cd = get_config("short")
    cd.runtime.sft_warmup_steps = 0
    cd.runtime.total_steps = 1
    cd.runtime.timeline = False
    cd.learner.compile_ahead = "none"  # shapes compile at first use: not a warm-up test (test_learner_warmup.py is)
    cd.runtime.run_dir = str(tmp_path / name)
    for key, value in kv.items():
        section, field = key.split(".")
        cd[section][field] = value
    return run(finalize(cd))


def _tiny_model():
    from flax import nnx

    from laminar_jax.model import PRESETS, Transformer

    return Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0))


def _server(**kv):
    from laminar_jax.rollout import RolloutSection, RolloutServer

    sec = RolloutSection(num_slots=2, page_size=8, num_pages=20, max_prompt_len=16, max_total_len=64,
                         max_new_tokens=8, **kv)
    return RolloutServer.from_model(_tiny_model(), sec)


def _hf_dir(tmp_path, config: dict) -> str:
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _prompts_file(tmp_path) -> str:
    p = tmp_path / "prompts.jsonl"
    rows = [{"data_source": "exact_match", "prompt": "What is 2+2? " * 5, "reward_model": {"ground_truth": "4"}},
            {"data_source": "exact_match", "prompt": "hi", "reward_model": {}}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def _source(tmp_path, **kv):
    from laminar_jax.data import build_prompt_source
    from laminar_jax.data.config import DataSection
    from laminar_jax.model import BuiltinTokenizer

    return build_prompt_source(DataSection(**kv), BuiltinTokenizer())


def _reward_error(tmp_path, monkeypatch, caplog, data_source: str) -> str:
    (tmp_path / "slow_rewards_doc.py").write_text(
        "import time\nfrom laminar_jax.data import RewardRegistry\n\n"
        "def slow(response, ground_truth, extra_info):\n    time.sleep(2)\n    return 1.0\n\n"
        "def registry():\n    reg = RewardRegistry()\n    reg.register_reward('slow_task', slow)\n    return reg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from laminar_jax.data import RewardPool

    with caplog.at_level(logging.WARNING, logger="laminar_jax.data.reward_pool"):
        with RewardPool(1, timeout_s=0.3, registry_spec="slow_rewards_doc:registry", mode="thread") as pool:
            result = pool.score(data_source, "x", "1")
    assert result.reward == 0.0 and not result.ok
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert result.error in logged, "the failure is logged, not only returned"
    return result.error


def _missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    from laminar_jax.model import save_pretrained

    d = str(tmp_path / "tiny_hf")
    save_pretrained(_tiny_model(), d)
    f = os.path.join(d, "model.safetensors")
    tensors = load_file(f)
    tensors.pop("model.norm.weight")
    save_file(tensors, f)
    return from_pretrained(d)


def _cli_unknown_key() -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "run.py"), "--config=configs/demo.py:short",
                        "--config.runtime.step=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    return p.stderr


def _chat_without_template(tmp_path):
    from tests.model.chat_fixtures import write_tokenizer_dir

    tok = load_tokenizer(write_tokenizer_dir(str(tmp_path / "tok"), "qwen2.5", with_template=False))
    return tok.apply_chat_template([{"role": "user", "content": "hi"}])


def _runaway_chat_template(tmp_path):
    from tests.model.chat_fixtures import write_tokenizer_dir

    d = write_tokenizer_dir(str(tmp_path / "tok"), "qwen2.5", with_template=False)
    with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    return load_tokenizer(d).apply_chat_template([{"role": "user", "content": "hi"}])


def _python_env_without_bwrap(monkeypatch):
    from laminar_jax.env import bwrap
    from laminar_jax.env.config import EnvSection
    from laminar_jax.runtime.rollout_worker import check_env_sandbox

    monkeypatch.setattr(bwrap, "find_bwrap", lambda: None)
    return raised(lambda: check_env_sandbox(EnvSection(enabled=True, default="python")))


def _checkpoint_relative(tmp_path, monkeypatch):
    from laminar_jax.learner.checkpoint import Checkpointer

    monkeypatch.chdir(tmp_path)
    ckpt = Checkpointer("relative/checkpoints", keep=1, async_save=False)
    try:
        ckpt.save(1, {"w": np.zeros(3, np.float32)}, {"version": 1})
    finally:
        try:
            ckpt.close()
        except Exception:  # noqa: BLE001 - closing after the failed save may fail the same way
            pass


def _host_keys(link):
    from laminar_jax.net.auth import RunKeys

    return RunKeys(link, RunKeys.generate().public)


def _relay_without_key():
    from laminar_jax.relay import RelayServer, RelaySection

    with RelayServer(RelaySection(io_timeout_s=2.0), keys=_host_keys(b"k" * 32)) as server:
        return raised(lambda: RelayClient([server.address]).wait_for(1, 0.5))


def _relay_push_refusal(**cfg):
    from laminar_jax.relay import RelaySection, RelayServer
    from laminar_jax.relay.manifest import plan_layout
    from laminar_jax.net.wire import connect

    m = plan_layout({"w": np.zeros(4096, np.float32)}, 5)
    with RelayServer(RelaySection(io_timeout_s=2.0, **cfg), keys=_host_keys(b"k" * 32)) as server:
        peer = connect(server.address, 2.0, 2.0, b"k" * 32)
        try:
            return raised(lambda: peer.request({"op": "push", "version": 5, "manifest": m.to_dict(),
                                                "chunk_bytes": 4096}, "have", "push"))
        finally:
            peer.close()


def _utf8_bad_row(tmp_path) -> str:
    p = tmp_path / "latin.jsonl"
    good = json.dumps({"data_source": "exact_match", "prompt": "hi", "reward_model": {"ground_truth": "4"}})
    p.write_bytes(good.encode() + b"\n" + good.encode().replace(b'"hi"', b'"h\xe9"') + b"\n")
    src = _source(tmp_path, source="file", path=str(p), shuffle=False)
    return raised(lambda: [next(src) for _ in range(2)])


def _reward_float32() -> str:
    from laminar_jax.data.reward_worker import _score
    from laminar_jax.data.rewards import RewardRegistry

    reg = RewardRegistry()
    reg.register_reward("huge", lambda r, g, e: 1e300)
    return _score(reg, {"id": 0, "data_source": "huge", "response": "", "ground_truth": None})["error"]


def _checkpoint_damage(tmp_path, caplog, keep_one: bool) -> str:
    import jax.numpy as jnp

    from laminar_jax.learner.checkpoint import Checkpointer

    d = str(tmp_path / "ckpt")
    ck = Checkpointer(d, keep=3, async_save=False)
    for step in (1, 2):
        ck.save(step, {"w": np.full(4096, step, np.float32)}, {"version": step})
    ck.close()
    for step in ((2,) if keep_one else (1, 2)):
        for root, _, files in os.walk(os.path.join(d, str(step), "state")):
            for f in files:
                path = os.path.join(root, f)
                if os.path.getsize(path) > 64 and not f.endswith((".json", "_METADATA", "manifest.ocdbt")):
                    os.truncate(path, os.path.getsize(path) // 2)
    ck = Checkpointer(d, keep=3, async_save=False)
    try:
        with caplog.at_level(logging.WARNING, logger="laminar_jax.learner.checkpoint"):
            if keep_one:
                assert ck.restore_newest({"w": jnp.zeros(4096, jnp.float32)}).step == 1
                return "\n".join(r.getMessage() for r in caplog.records)
            return raised(lambda: ck.restore_newest({"w": jnp.zeros(4096, jnp.float32)}))
    finally:
        ck.close()


def _publisher_nowhere():
    from laminar_jax.relay import Publisher, RelaySection

    return Publisher(RelaySection())


QWEN2 = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}

def _eval_cli_without_val(tmp_path) -> str:
    res = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "eval.py"),
                          f"--config={ROOT}/configs/demo.py:short", f"--checkpoint={tmp_path}",
                          "--config.data.val_size=0"],
                         cwd=ROOT, env=child_env(JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    return res.stderr


def _val_prompts(tmp_path, **kv):
    from laminar_jax.data.config import DataSection
    from laminar_jax.data.source import build_val_prompts

    return build_val_prompts(DataSection(**kv), load_tokenizer("builtin"))


def _loggers(tmp_path, names):
    from laminar_jax.monitor.loggers import make_loggers

    return make_loggers(names, str(tmp_path))


TRIGGERS = {
    "config-bad-value": lambda t, m, c: raised(lambda: _finalize_with(**{"learner.lr": -1.0})),
    "config-choice": lambda t, m, c: raised(lambda: _finalize_with(**{"runtime.mode": "async"})),
    "config-gae": lambda t, m, c: raised(lambda: _finalize_with(**{"learner.adv_estimator": "gae"})),
    "config-file-path": lambda t, m, c: raised(lambda: _finalize_with(**{"data.source": "file"})),
    "config-unknown-key": lambda t, m, c: raised(lambda: finalize(
        {"runtime": {"step": 3}})),
    "config-cli-unknown": lambda t, m, c: _cli_unknown_key(),
    "config-group-of-one": lambda t, m, c: raised(lambda: _finalize_with(**{"runtime.samples_per_prompt": 1})),
    "chat-template-missing": lambda t, m, c: raised(lambda: _chat_without_template(t)),
    "chat-template-budget": lambda t, m, c: raised(lambda: _runaway_chat_template(t)),
    "sandbox-no-bwrap": lambda t, m, c: _python_env_without_bwrap(m),
    "sft-source": lambda t, m, c: raised(lambda: _demo_run(t, "sft", **{
        "runtime.sft_warmup_steps": 5, "data.source": "file", "data.path": _prompts_file(t)})),
    "kv-num-pages": lambda t, m, c: raised(lambda: _finalize_with(**{"rollout.num_pages": 8})),
    "kv-out-of-pages": lambda t, m, c: raised(
        lambda: PageAllocator(4).allocate(5)),
    "queue-full": lambda t, m, c: raised(lambda: [
        srv.submit(Request(uid=f"q{i}", prompt_ids=[1, 5, 6]), timeout=0.1)
        for srv in [_server(queue_capacity=1)] for i in range(2)]),
    "prompt-overlong-data": lambda t, m, c: raised(lambda: next(_source(
        t, source="file", path=_prompts_file(t), overlong="error", max_prompt_tokens=10, shuffle=False))),
    "prompt-overlong-rollout": lambda t, m, c: raised(lambda: _server().submit(
        Request(uid="long", prompt_ids=list(range(1, 30))), timeout=0.1)),
    "prompt-limits": lambda t, m, c: raised(lambda: _demo_run(
        t, "overlong", **{"rollout.max_prompt_len": 4, "rollout.max_total_len": 160})),
    # Servers that never take work (as when they wait for weights that do not come): no batch ever.
    "learner-wait": lambda t, m, c: (m.setattr(RolloutWorker, "_admit", lambda self: None), raised(
        lambda: _demo_run(t, "wait", **{"runtime.wait_timeout_s": 1.0})))[1],
    "buffer-timeout": lambda t, m, c: raised(lambda: ExperienceStore(
        group_size=4).get("learner", 2, ["reward", "version"], timeout=0.1)),
    "relay-pull-timeout": lambda t, m, c: raised(
        lambda: RelayClient(["127.0.0.1:9"]).pull(timeout=0.3)),
    "publisher-nowhere": lambda t, m, c: raised(_publisher_nowhere),
    "relay-no-key": lambda t, m, c: _relay_without_key(),
    "relay-forged": lambda t, m, c: _relay_push_refusal(),
    "relay-too-large": lambda t, m, c: _relay_push_refusal(max_unverified_bytes=8192),
    "bad-row-utf8": lambda t, m, c: _utf8_bad_row(t),
    "reward-float32": lambda t, m, c: _reward_float32(),
    "checkpoint-skipped": lambda t, m, c: _checkpoint_damage(t, c, keep_one=True),
    "checkpoint-moved": lambda t, m, c: _checkpoint_damage(t, c, keep_one=True),
    "checkpoint-none": lambda t, m, c: _checkpoint_damage(t, c, keep_one=False),
    "unsupported-arch": lambda t, m, c: raised(lambda: from_pretrained(
        _hf_dir(t, {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}))),
    "unsupported-rope": lambda t, m, c: raised(lambda: load_hf_config(
        _hf_dir(t, dict(QWEN2, rope_scaling={"rope_type": "yarn", "factor": 4.0})))),
    "sliding-window": lambda t, m, c: raised(lambda: load_hf_config(
        _hf_dir(t, dict(QWEN2, use_sliding_window=True)))),
    "missing-tensor": lambda t, m, c: raised(lambda: _missing_tensor(t)),
    "no-config-json": lambda t, m, c: raised(
        lambda: from_pretrained(str(t / "nothing"))),
    "tokenizer-missing": lambda t, m, c: raised(
        lambda: load_tokenizer(str(t / "nothing"))),
    "reward-timeout": lambda t, m, c: _reward_error(t, m, c, "slow_task"),
    "reward-missing": lambda t, m, c: _reward_error(t, m, c, "other_task"),
    "bad-row": lambda t, m, c: raised(lambda: [next(it) for it in [_source(
        t, source="file", path=_prompts_file(t), max_prompt_tokens=500, shuffle=False)] for _ in range(2)]),
    "reasoning-gym-unknown": lambda t, m, c: raised(lambda: _source(
        t, source="reasoning_gym", reasoning_gym_dataset="no_such_task", dataset_size=4)),
    "checkpoint-relative": lambda t, m, c: raised(lambda: _checkpoint_relative(t, m)),
    "eval-no-val": lambda t, m, c: raised(lambda: _finalize_with(**{"runtime.eval_every": 20})),
    "eval-cli-no-val": lambda t, m, c: _eval_cli_without_val(t),
    "eval-val-files-missing": lambda t, m, c: raised(lambda: _val_prompts(t, val_files=str(t / "val*.jsonl"))),
    "eval-env": lambda t, m, c: raised(lambda: _finalize_with(**{
        "runtime.eval_every": 20, "data.val_size": 8, "env.enabled": True})),
    "wandb-missing": lambda t, m, c: (m.setitem(sys.modules, "wandb", None), raised(
        lambda: _loggers(t, ("wandb",))))[1],
}


def test_every_quote_has_a_trigger():
    quotes = doc_quotes()
    assert set(quotes) == set(TRIGGERS), (
        f"untested quotes: {sorted(set(quotes) - set(TRIGGERS))}; triggers without a quote: "
        f"{sorted(set(TRIGGERS) - set(quotes))}")


@pytest.mark.parametrize("err_id", sorted(TRIGGERS))
def test_quoted_error_matches_the_code(err_id, tmp_path, monkeypatch, caplog):
    quote = doc_quotes()[err_id]
    message = TRIGGERS[err_id](tmp_path, monkeypatch, caplog)
    assert_quoted(quote, message)
