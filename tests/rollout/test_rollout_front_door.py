"""The offline front door: LLM(hf_dir, kv_memory_gb) sizing, default EOS stops, errors instead of silent
cuts, generate() reusing its compiled programs, and the live-page bucket settings."""

import dataclasses
import json

import numpy as np
import pytest

from laminar_jax.model import from_pretrained
from laminar_jax.model.hf import load_hf_config
from laminar_jax.rollout import LLM, RolloutSection, SamplingParams, generate, make_engine
from laminar_jax.rollout.programs import programs as _programs
from laminar_jax.rollout.schedule import live_buckets as _live_buckets
from laminar_jax.rollout.llm import kv_bytes_per_page, row_buckets, size_section
from laminar_jax.rollout.offline import default_section
from laminar_jax.rollout.warmup import warmup
from tests.model.hf_fixtures import save_hf_model
from tests.rollout.rollout_helpers import SECTION, make_server, request, run_until, tiny_model

PROMPTS = [[1, 5, 9, 11], [1, 17, 33, 4, 60, 61, 62], [1, 44]]


def _write_tokenizer(path, eos_token: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token, "bos_token": "<bos>"}))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_front_door")
    save_hf_model("qwen2", str(path))
    _write_tokenizer(path, eos_token="w7")  # differs from config.json's eos (2): both must stop
    return path


def test_llm_sizes_the_pool_from_the_budget_and_matches_generate(hf_dir):
    cfg = load_hf_config(str(hf_dir))
    budget = 0.002
    llm = LLM(str(hf_dir), kv_memory_gb=budget, max_num_seqs=2, max_model_len=64)
    assert llm.section.page_size == 64
    per_page = kv_bytes_per_page(cfg, llm.section.page_size, "float32")
    assert llm.section.num_pages - 1 == int(budget * (1 << 30)) // per_page
    assert llm.section.stop_token_ids == (2, 7)  # config.json's eos, then the tokenizer's
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=())
    outs = llm.generate(PROMPTS, sp)
    ref = generate(from_pretrained(str(hf_dir)), PROMPTS, sp)
    assert [o.token_ids for o in outs] == [r.tokens.tolist() for r in ref]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    # Strings go through the directory's tokenizer.
    text_out = llm.generate(["w5 w9 w11"], sp)[0]
    assert text_out.prompt_token_ids == [5, 9, 11] and text_out.text is not None


def test_llm_rejects_a_budget_below_one_sequence(hf_dir):
    with pytest.raises(ValueError, match="kv_memory_gb=1e-06"):
        LLM(str(hf_dir), kv_memory_gb=1e-6, max_model_len=64)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(hf_dir), dtype="int8")
    with pytest.raises(ValueError, match="matmul_precision='tf32'"):
        LLM(str(hf_dir), matmul_precision="tf32")


def test_llm_traces_its_programs_at_its_own_precision_only(hf_dir, monkeypatch):
    """'auto' is float32 products for a float32 model, in force while the LLM's engine runs (and
    compiles) and not after: the rest of the process keeps its own setting."""
    from laminar_jax.matmul_precision import apply_matmul_precision, matmul_precision
    from laminar_jax.rollout import llm as llm_module

    llm = LLM(str(hf_dir), kv_memory_gb=0.002, max_num_seqs=2, max_model_len=64)
    assert llm.matmul_precision == "highest"
    assert LLM(str(hf_dir), kv_memory_gb=0.002, max_num_seqs=2, max_model_len=64,
               dtype="bfloat16").matmul_precision == "default"
    seen, inner = [], llm_module.complete
    monkeypatch.setattr(llm_module, "complete", lambda *a, **k: seen.append(matmul_precision()) or inner(*a, **k))
    before = matmul_precision()
    apply_matmul_precision("default", "float32")
    try:
        out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=2))
        assert seen == ["highest"] and matmul_precision() == "default" and len(out[0].token_ids) == 2
    finally:
        apply_matmul_precision(before, "float32")


def test_llm_keeps_one_server_and_its_kv_pools_across_calls(hf_dir, monkeypatch):
    """generate() calls share one RolloutServer (a fresh one zeroed the whole KV budget every call),
    and give what a fresh LLM gives; a call that fails drops the server, so the next starts clean."""
    from laminar_jax.rollout import llm as llm_module

    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=())
    llm = LLM(str(hf_dir), kv_memory_gb=0.002, max_num_seqs=2, max_model_len=64)
    first = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    server = llm._server
    again = [o.token_ids for o in llm.generate(PROMPTS[::-1], greedy)]
    assert llm._server is server and server.num_live == 0
    fresh = LLM(str(hf_dir), kv_memory_gb=0.002, max_num_seqs=2, max_model_len=64)
    assert again == [o.token_ids for o in fresh.generate(PROMPTS[::-1], greedy)]

    def fail(*a, **k):
        raise TimeoutError("injected")

    monkeypatch.setattr(llm_module, "complete", fail)
    with pytest.raises(TimeoutError, match="injected"):
        llm.generate(PROMPTS, greedy)
    assert llm._server is None
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == first


def test_row_buckets_add_one_row_for_float32_only():
    # One live row (the longest request alone) runs as its own batch in float32, where XLA:CPU's
    # 1-row products are matrix-vector products; bf16's 1-row products take a slow path.
    assert row_buckets(32) == row_buckets(32, dtype="float32") == (1, 4, 8, 16)
    assert row_buckets(32, dtype="bfloat16") == (4, 8, 16)
    assert row_buckets(4) == (1,) and row_buckets(4, dtype="bfloat16") == ()
    assert row_buckets(1) == () and row_buckets(64, smallest=1) == (1, 2, 4, 8, 16, 32)
    cfg = tiny_model().cfg
    assert size_section(cfg, 0.01, "float32", 32, 128, 32, 16, (2,)).decode_row_buckets == (1, 4, 8, 16)
    assert size_section(cfg, 0.01, "bfloat16", 32, 128, 32, 16, (2,)).decode_row_buckets == (4, 8, 16)


def test_many_sequences_run_as_one_call_with_row_buckets_unless_chunks_are_asked_for():
    # 64 sequences in chunks of 32 ran bf16 at about half the tokens/s: XLA:CPU's bf16 products in the
    # chunk loop's body. One call of all slots, with buckets up to half of them, instead.
    cfg = tiny_model().cfg
    sec = size_section(cfg, 0.01, "bfloat16", 64, 128, 32, 16, (2,))
    assert sec.decode_chunk == 0 and sec.decode_row_buckets == (4, 8, 16, 32)
    assert size_section(cfg, 0.01, "float32", 128, 128, 32, 16, (2,)).decode_row_buckets == (1, 4, 8, 16, 32, 64)
    chunked = size_section(cfg, 0.01, "float32", 64, 128, 32, 16, (2,), decode_chunk=16)
    assert chunked.decode_chunk == 16 and chunked.decode_row_buckets == (1, 4, 8)  # buckets below the chunk


def test_size_section_is_pure_and_validated():
    cfg = tiny_model().cfg
    sec = size_section(cfg, 0.01, "bfloat16", 8, 128, 32, 16, (2,))
    assert sec.num_slots == 8 and sec.max_total_len == 128 and sec.max_prompt_len == 32
    assert sec.num_pages - 1 == int(0.01 * (1 << 30)) // kv_bytes_per_page(cfg, 16, "bfloat16")
    with pytest.raises(ValueError, match="max_prompt_len=128"):
        size_section(cfg, 0.01, "float32", 8, 128, 128, 16, (2,))


def test_default_sampling_stop_ids_are_the_servers_eos():
    # Probe the greedy continuation, then make its 3rd token the server's default stop id.
    server = _greedy_server(())
    server.submit(request(0, max_new=12, temperature=0.0))
    probe = run_until(server, 1)["p0/0"].response_ids.tolist()
    stop = probe[2]
    first = probe.index(stop)
    server = _greedy_server((stop,))
    req = request(0, max_new=12, temperature=0.0)
    server.submit(dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, stop_token_ids=None)))
    out = run_until(server, 1)["p0/0"]
    assert out.finish_reason == "eos" and out.response_ids.tolist() == probe[:first + 1]
    # Explicit () still means: never stop early.
    server = _greedy_server((stop,))
    server.submit(request(0, max_new=12, temperature=0.0))
    assert run_until(server, 1)["p0/0"].finish_reason == "length"


def _greedy_server(stop):
    return make_server(dataclasses.replace(SECTION, stop_token_ids=tuple(stop), temperature=0.0))


def test_max_new_tokens_beyond_max_total_len_raises_naming_both():
    server = make_server()
    req = request(0, max_new=SECTION.max_total_len, prompt_len=5)
    with pytest.raises(ValueError, match=r"max_new_tokens=64.*max_total_len=64"):
        server.submit(req)
    # The section default (a documented cap) still shrinks to fit.
    server.submit(dataclasses.replace(req, sampling=None))


def test_generate_on_a_model_reuses_its_programs_and_checks_section():
    model = tiny_model()
    sp = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=())
    generate(model, PROMPTS, sp)
    # The programs generate() used: equal engines share them (programs.programs is an lru_cache).
    engine, params = make_engine(model, default_section(PROMPTS, [sp] * len(PROMPTS)))
    progs = engine.bound(params).programs
    counts = (progs.prefill_insert._cache_size(), progs.generate._cache_size(), _programs.cache_info().misses)
    assert counts[0] >= 1 and counts[1] >= 1
    # Different prompts and lengths (same power-of-two buckets): nothing new compiles.
    generate(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 3], [1, 4, 4]], sp)
    assert (progs.prefill_insert._cache_size(), progs.generate._cache_size(), _programs.cache_info().misses) == counts
    engine_params = make_engine(model, SECTION)
    with pytest.raises(ValueError, match="section"):
        generate(engine_params, PROMPTS, sp, section=dataclasses.replace(SECTION, num_slots=2))
    generate(engine_params, PROMPTS, sp, section=SECTION)  # the engine's own section is fine


def test_live_bucket_policies():
    assert _live_buckets(1000, "fine") == (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1000)
    assert _live_buckets(1000, "pow2") == (16, 32, 64, 128, 256, 512, 1000)
    assert _live_buckets(1000, "pow4") == (16, 64, 256, 1000)
    with pytest.raises(ValueError, match="rollout.live_buckets"):
        RolloutSection(live_buckets="pow3").validate()
    with pytest.raises(ValueError, match="rollout.warmup_live_buckets"):
        RolloutSection(warmup_live_buckets=-1).validate()


@pytest.mark.parametrize("first_n,slots", [(1, 3), (0, 5)])
def test_warmup_compiles_only_the_first_live_buckets(first_n, slots):
    # Geometries (page 4) no other test compiles, so the jit cache grows by exactly what warmup() compiles.
    sec = RolloutSection(num_slots=slots, page_size=4, num_pages=64, max_prompt_len=16, max_total_len=80,
                         prefill_buckets=(16,), live_buckets="pow4", warmup_live_buckets=first_n,
                         stop_token_ids=(), attention_impl="live_pages")
    engine, params = make_engine(tiny_model(1), sec)
    progs = engine.bound(params).programs
    before = progs.generate._cache_size()  # shared with the other geometry's engine (same program graph)
    warmup(engine, params)
    assert engine.schedule.live_buckets == ((16, 60) if slots == 3 else (16, 64, 100))
    assert progs.generate._cache_size() - before == (first_n or len(engine.schedule.live_buckets))
    # A bucket left out still works: it compiles on first use.
    out = generate((engine, params), [[1, 2, 3]] * slots,
                   SamplingParams(temperature=0.0, max_new_tokens=60, stop_token_ids=()))
    assert all(len(o.tokens) == 60 for o in out) and np.isfinite(out[0].logprobs).all()


def test_bf16_pool_is_stored_as_bits_and_backends_agree():
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.model import PRESETS, Transformer

    model = Transformer(PRESETS["tiny"], rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=())
    outs = {}
    for impl in ("live_pages", "gather_dense", "pool_scan", "cpu_kernel"):
        pages = {"page_size": 16} if impl == "cpu_kernel" else {}  # the kernel takes pages of 16s
        engine, params = make_engine(model, dataclasses.replace(SECTION, attention_impl=impl, **pages))
        assert engine.init_decode_state().k_pages[0].dtype == jnp.uint16
        outs[impl] = [o.tokens.tolist() for o in generate((engine, params), PROMPTS, sp)]
    assert outs["live_pages"] == outs["gather_dense"] == outs["pool_scan"] == outs["cpu_kernel"]
    assert len(set(map(tuple, outs["live_pages"]))) > 1  # not a degenerate constant output
