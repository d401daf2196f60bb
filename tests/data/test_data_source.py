"""Prompt files in verl's layout -> grain pipeline: order, epochs, resume, bad rows, over-long prompts."""

import itertools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from laminar_jax.configlib import ConfigError, from_config_dict
from laminar_jax.data import BadRowError, DataSection, OverlongPromptError, build_prompt_source
from laminar_jax.model.tokenizer import BuiltinTokenizer

TOK = BuiltinTokenizer()


def _row(i, chat=True, **over):
    q = f"What is {i} + {i}?"
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] if chat else q,
        "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
        "extra_info": {"split": "train", "index": i},
    }
    row.update(over)
    return row


def _write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _source(path, **kw):
    return build_prompt_source(DataSection(source="file", path=path, **kw), TOK)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_both_formats_and_prompt_forms(tmp_path, fmt):
    rows = [_row(i, chat=(i % 2 == 0)) for i in range(6)]
    rows[3]["extra_info"] = None  # optional column
    if fmt == "jsonl":
        path = _write_jsonl(tmp_path / "p.jsonl", rows)
    else:  # a parquet column holds one type: chat rows and plain rows go to two files
        _write_parquet(tmp_path / "p0.parquet", rows[:1] + rows[2:3] + rows[4:5])
        _write_parquet(tmp_path / "p1.parquet", rows[1:2] + rows[3:4] + rows[5:6])
        path = str(tmp_path / "p*.parquet")
        rows = [rows[i] for i in (0, 2, 4, 1, 3, 5)]
    got = {p.index: p for p in _source(path, num_epochs=1)}
    assert sorted(got) == list(range(6))
    for i, p in got.items():
        r = rows[i]
        want_text = TOK.apply_chat_template(r["prompt"]) if isinstance(r["prompt"], list) else r["prompt"]
        assert p.prompt_text == want_text
        assert p.prompt_ids == [TOK.bos_id] + TOK.encode(want_text)
        assert p.ground_truth == r["reward_model"]["ground_truth"] and p.data_source == "openai/gsm8k"
        assert p.epoch == 0 and p.uid.endswith(f"/{i}@0")
        assert p.extra_info == (r["extra_info"] or {})
    texts = sorted(p.prompt_text for p in got.values())
    assert "What is 1 + 1?" in texts
    assert "system: Be brief.\nuser: What is 0 + 0?\nassistant: " in texts


def test_glob_reads_all_files_in_sorted_order(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [_row(i) for i in range(3)])
    _write_parquet(tmp_path / "b.parquet", [_row(i) for i in range(3, 7)])
    src = _source(str(tmp_path / "*"), shuffle=False, num_epochs=1, name="mix")
    got = list(src)
    assert [p.ground_truth for p in got] == [str(2 * i) for i in range(7)]
    assert [p.uid for p in got] == [f"mix/{i}@0" for i in range(7)]
    with pytest.raises(FileNotFoundError, match="nothing"):
        _source(str(tmp_path / "nothing*.jsonl"))


def test_order_is_deterministic_per_seed_and_differs_across_epochs(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [_row(i) for i in range(40)])
    a = [p.uid for p in _source(path, seed=3, num_epochs=3)]
    b = [p.uid for p in _source(path, seed=3, num_epochs=3)]
    c = [p.uid for p in _source(path, seed=4, num_epochs=3)]
    assert a == b and a != c
    assert len(a) == 120 and len(set(a)) == 120  # uids unique across epochs
    epochs = [[int(u.split("/")[-1].split("@")[0]) for u in a[e * 40 : (e + 1) * 40]] for e in range(3)]
    assert all(sorted(e) == list(range(40)) for e in epochs)  # each epoch is a permutation
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert [p.index for p in _source(path, shuffle=False, num_epochs=1)] == list(range(40))
    infinite = _source(path, seed=3, num_epochs=None)
    assert [p.uid for p in itertools.islice(infinite, 200)][:120] == a


@pytest.mark.parametrize("cut", [0, 1, 17, 40, 41, 79])
def test_resume_continues_with_exactly_the_next_prompt(tmp_path, cut):
    rows = [_row(i) for i in range(40)]
    rows[5] = _row(5, prompt=None)  # a skipped bad row inside the stream: counters must resume too
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    kw = dict(seed=11, num_epochs=2, skip_bad_rows=True)
    full = list(_source(path, **kw))
    first = _source(path, **kw)
    head = list(itertools.islice(first, cut))
    state = json.loads(json.dumps(first.get_state()))  # must survive JSON
    resumed = _source(path, **kw)
    next(resumed)  # move it elsewhere first: set_state must override
    resumed.set_state(state)
    tail = list(resumed)
    assert head + tail == full
    assert resumed.counters["yielded"] == len(full) == 78
    assert resumed.counters["bad_rows_skipped"] == 2


def test_state_from_another_dataset_is_refused(tmp_path):
    src_a = _source(_write_jsonl(tmp_path / "a.jsonl", [_row(i) for i in range(5)]), seed=1)
    src_b = _source(_write_jsonl(tmp_path / "b.jsonl", [_row(i) for i in range(5)]), seed=2)
    with pytest.raises(ValueError, match="saved for"):
        src_b.set_state(src_a.get_state())


def test_bad_rows_name_file_and_row_or_are_skipped_and_counted(tmp_path):
    rows = [_row(i) for i in range(6)]
    rows[1] = _row(1, prompt=None)
    rows[2] = _row(2, reward_model={"style": "rule"})
    rows[3] = _row(3, prompt=[{"role": "user", "content": 7}])
    path = _write_jsonl(tmp_path / "bad.jsonl", rows, raw_lines=["{not json"])
    src = _source(path, shuffle=False)
    assert next(src).index == 0
    with pytest.raises(BadRowError, match=r"bad\.jsonl row 1 \(line 2\).*'prompt'"):
        next(src)
    src = _source(path, shuffle=False, num_epochs=1, skip_bad_rows=True)
    assert [p.index for p in src] == [0, 4, 5]
    assert src.counters["bad_rows_skipped"] == 4 and src.counters["yielded"] == 3

    ppath = _write_parquet(tmp_path / "bad.parquet", [_row(0), _row(1, reward_model={"ground_truth": None})])
    src = _source(ppath, shuffle=False)
    next(src)
    with pytest.raises(BadRowError, match=r"bad\.parquet row 1: 'reward_model.ground_truth' is missing"):
        next(src)


def test_overlong_prompts_filtered_truncated_or_raised(tmp_path):
    rows = [_row(i, chat=False) for i in range(4)]
    rows[2]["prompt"] = "x" * 100 + " what is 2 + 2?"
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    src = _source(path, shuffle=False, num_epochs=1, max_prompt_tokens=40, overlong="filter")
    assert [p.index for p in src] == [0, 1, 3]
    assert src.counters["overlong_filtered"] == 1
    src = _source(path, shuffle=False, num_epochs=1, max_prompt_tokens=40, overlong="truncate")
    got = list(src)
    assert len(got) == 4 and src.counters["overlong_truncated"] == 1 and src.counters["overlong_filtered"] == 0
    long = got[2]
    assert long.truncated and len(long.prompt_ids) == 40 and long.prompt_ids[0] == TOK.bos_id
    assert long.prompt_text.endswith("what is 2 + 2?")  # keeps the end, where the question is
    assert not got[0].truncated and len(got[0].prompt_ids) < 40
    src = _source(path, shuffle=False, max_prompt_tokens=40, overlong="error")
    next(src), next(src)
    with pytest.raises(OverlongPromptError, match=r"long\.jsonl row 2 .*116 tokens > max_prompt_tokens=40"):
        next(src)


def test_section_validation_and_config_round_trip():
    with pytest.raises(ConfigError, match="data.path"):
        DataSection(source="file").validate("data")
    with pytest.raises(ConfigError, match="data.num_epochs"):
        DataSection(num_epochs=0).validate("data")
    with pytest.raises(ConfigError, match="overlong"):
        from_config_dict(DataSection, {"overlong": "chop"}, "data")
    sec = from_config_dict(DataSection, {"source": "synthetic_skew", "num_epochs": 2, "seed": 5}, "data")
    assert sec.num_epochs == 2 and sec.seed == 5


def test_a_whole_epoch_of_rejected_rows_raises_instead_of_spinning(tmp_path):
    """Every prompt over-long and filtered, epochs unbounded: an error naming the cause, not a hang."""
    path = _write_jsonl(tmp_path / "all_long.jsonl", [_row(i, chat=False) for i in range(3)])
    src = _source(path, shuffle=False, max_prompt_tokens=2, overlong="filter")
    with pytest.raises(ValueError, match="no usable prompt in a whole epoch"):
        next(src)


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_non_utf8_bytes_name_file_and_row_and_can_be_skipped(tmp_path, suffix):
    path = tmp_path / f"latin.{suffix}"
    lines = [json.dumps(_row(i)).encode() for i in range(3)]
    lines[1] = lines[1].replace(b"What is", b"Wh\xe4t is")  # one latin-1 byte
    path.write_bytes(b"\n".join(lines) + b"\n")
    src = _source(str(path), shuffle=False)
    assert next(src).index == 0
    with pytest.raises(BadRowError, match=rf"latin\.{suffix} row 1 \(line 2\).*not valid UTF-8: byte 0xe4"):
        next(src)
    src = _source(str(path), shuffle=False, num_epochs=1, skip_bad_rows=True)
    assert [p.index for p in src] == [0, 2] and src.counters["bad_rows_skipped"] == 1
