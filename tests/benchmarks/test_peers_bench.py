"""The peers bench's argument parsing and result assembly (the runs themselves are a benchmark, not a test),
and our worker on a workload smaller than its concurrency."""

import pytest

from laminar_jax.benchmarks.peers import _laminar_worker, parse_args, run_worker_process, summarize


def test_parse_args_defaults_and_errors():
    a = parse_args(["--quick"])
    assert (a.requests, a.repeats, a.dtypes, a.concurrency) == (48, 1, ["float32", "bfloat16"], 32)
    assert parse_args(["--dtypes", "bfloat16", "--repeats", "3"]).dtypes == ["bfloat16"]
    with pytest.raises(SystemExit, match="--dtypes"):
        parse_args(["--dtypes", "int8"])


def _run(system, dtype, tps, outputs=((1, 2), (3,)), ok=True):
    base = {"system": system, "dtype": dtype, "load_avg": 2.0}
    if not ok:
        return {**base, "ok": False, "reason": "No module named 'vllm'"}
    return {**base, "ok": True, "tokens_per_s": tps, "outputs": [list(o) for o in outputs], "version": system}


def test_summarize_medians_spread_agreement_and_failures():
    runs = [_run("laminar", "float32", 100.0), _run("vllm", "float32", 200.0, outputs=((1, 2), (4,))),
            _run("vllm", "float32", 300.0), _run("laminar", "float32", 120.0), _run("laminar", "float32", 90.0),
            _run("laminar", "bfloat16", 50.0), _run("vllm", "bfloat16", 0.0, ok=False)]
    s = summarize(runs)
    lam = s["rows"]["laminar_float32"]
    assert (lam["median"], lam["min"], lam["max"], lam["runs"]) == (100.0, 90.0, 120.0, 3)
    assert s["rows"]["vllm_float32"]["median"] == 250.0
    assert s["ratio_vs_vllm"] == {"float32": pytest.approx(0.4)}
    assert s["greedy_identical_frac"] == {"float32": 0.5}  # first successful runs: 1 of 2 requests equal
    assert s["rows"]["vllm_bfloat16"]["median"] is None
    assert s["rows"]["vllm_bfloat16"]["failures"] == ["No module named 'vllm'"]
    assert "bfloat16" not in s["ratio_vs_vllm"]


def test_our_worker_serves_fewer_requests_than_its_concurrency(tmp_path):
    """`peers --quick --concurrency 64` runs 48 requests on 64 sequences at once: the warm-up call takes
    every request there is, not `concurrency` of them, and the timed call serves each to its length."""
    from flax import nnx

    from laminar_jax.benchmarks.engine import make_workload
    from laminar_jax.model import PRESETS, Transformer, save_pretrained

    cfg = PRESETS["tiny"]
    save_pretrained(Transformer(cfg, rngs=nnx.Rngs(0)), str(tmp_path))
    wl = make_workload(3, 4, 12, cfg.vocab_size)
    spec = {"dir": str(tmp_path), "dtype": "float32", "prompts": wl.prompts, "max_new": wl.max_new,
            "concurrency": 8, "kv_memory_gb": 0.01, "max_model_len": 64, "max_prompt_len": 32}
    r = _laminar_worker(spec)
    assert r["tokens"] == sum(wl.max_new) and [len(o) for o in r["outputs"]] == list(wl.max_new)


def test_a_failed_worker_reports_its_last_lines_and_a_known_fix():
    import os
    import sys

    script = ("import sys; print('loading', file=sys.stderr); "
              "print('RuntimeError: operator torchvision::nms does not exist', file=sys.stderr); sys.exit(3)")
    r = run_worker_process([sys.executable, "-c", script], dict(os.environ), 60, "PEERS_RESULT ")
    assert not r["ok"] and r["reason"].startswith("exit 3: loading | RuntimeError: operator torchvision::nms")
    assert "pip uninstall -y torchvision torchaudio torchcodec" in r["reason"]

    other = run_worker_process([sys.executable, "-c", "import sys; sys.exit('no such model')"], dict(os.environ),
                               60, "PEERS_RESULT ")
    assert other["reason"] == "exit 1: no such model"  # no fix claimed for a failure the bench does not know
