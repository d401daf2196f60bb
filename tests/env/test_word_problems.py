"""The calculator demo's data: word problems and synthetic tool-use traces that a live episode
reproduces token for token, and the demo config that writes and reads them."""

import json

import numpy as np
import pytest

from laminar_jax.config import finalize, repo_config
from laminar_jax.env.calculator import CalculatorEnv, evaluate, format_number
from laminar_jax.env.tools import TOOL_CALL_END, TOOL_CALL_START, calls_tool, parse_tool_calls, render_tool_message
from laminar_jax.env.word_problems import problem_rows, tool_trace, word_problem, write_problem_file
from laminar_jax.data.records import BadRowError
from laminar_jax.model.tokenizer import BuiltinTokenizer

TOK = BuiltinTokenizer()


def test_rows_are_deterministic_and_traces_solve_their_problem():
    rows = problem_rows(64, seed=3, tokenizer=TOK)
    assert rows == problem_rows(64, seed=3, tokenizer=TOK) and rows != problem_rows(64, seed=4, tokenizer=TOK)
    for row in rows:
        (action, observation, answer), truth = row["response"], row["reward_model"]["ground_truth"]
        (call,) = parse_tool_calls(action)
        assert action.endswith(TOOL_CALL_END) and call.name == "calculator"
        assert format_number(evaluate(call.arguments["expression"])) == truth
        assert all(n in row["prompt"][0]["content"] for n in call.arguments["expression"].replace("*", " ")
                   .replace("+", " ").split())  # the expression's numbers come from the question
        # Replay the trace as an episode: the tool turn, the driver's tool message, the answer.
        assert observation == render_tool_message(truth, TOK)
        env = CalculatorEnv()
        env.reset({"ground_truth": truth})
        step = env.step(action)
        assert (step.observation, step.reward, step.done) == (truth, 0.0, False)
        assert env.step(answer) == (None, 1.0, True)


def test_questions_share_one_layout_and_need_arithmetic():
    rng = np.random.default_rng(0)
    problems = [word_problem(rng) for _ in range(300)]
    for p in problems:  # the same length, the numbers at the same characters: a fixed-distance copy
        a, b = p.expression.replace("*", " ").replace("+", " ").split()
        assert len(p.question) == 40 and p.question[0] == a and p.question[13] == b
        assert len(p.answer) == 2  # the tool's value is copied into the answer at a fixed distance too
    assert len({p.answer for p in problems}) > 20 and {p.expression[1] for p in problems} == {"*", "+"}


def test_tool_share_mixes_tool_traces_with_direct_answers():
    rows = problem_rows(400, seed=0, tokenizer=TOK, tool_share=0.5)
    tool = [r for r in rows if len(r["response"]) == 3]
    direct = [r for r in rows if len(r["response"]) == 1]
    assert len(tool) + len(direct) == 400 and 150 < len(tool) < 250
    assert all(r["response"] == [f"Answer: {r['reward_model']['ground_truth']}"] for r in direct)
    assert all(len(r["response"]) == 3 for r in problem_rows(50, seed=0, tokenizer=TOK))  # default: all tool
    with pytest.raises(ValueError, match="tool_share"):
        problem_rows(4, seed=0, tool_share=1.5)


def test_direct_answers_are_rough_with_a_spread():
    rows = problem_rows(600, seed=0, tokenizer=TOK, tool_share=0.5, direct_spread=2)
    direct = [r for r in rows if len(r["response"]) == 1]
    off = [int(r["response"][0].removeprefix("Answer: ")) - int(r["reward_model"]["ground_truth"]) for r in direct]
    assert set(off) == {-2, -1, 0, 1, 2} and 0.1 < off.count(0) / len(off) < 0.3  # right ~1 time in 5
    tool = [r for r in rows if len(r["response"]) == 3]
    assert all(r["response"][2] == f"Answer: {r['reward_model']['ground_truth']}" for r in tool)  # tool: exact
    with pytest.raises(ValueError, match="direct_spread"):
        problem_rows(4, seed=0, direct_spread=-1)


def test_warm_start_trains_on_policy_turns_not_on_tool_messages(tmp_path):
    from laminar_jax.data.config import DataSection
    from laminar_jax.data.sft import sft_pairs
    from laminar_jax.learner.sft import pack_examples

    rows = [{"data_source": "s", "prompt": "q?", "response": ["ab", "OBS", "c"]},
            {"data_source": "s", "prompt": "q?", "response": "xy"}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs, _ = sft_pairs(DataSection(source="file", path=str(path)), TOK, max_total_len=64, seed=0)
    (p0, r0, m0), (p1, r1) = pairs
    assert r0 == TOK.encode("abOBSc") + [TOK.eos_id] and m0 == [1, 1, 0, 0, 0, 1, 1]
    assert r1 == TOK.encode("xy") + [TOK.eos_id]
    tokens, mask = pack_examples(pairs, 16)
    # Position t is scored on token t+1: the prompt is BOS q ? (3 tokens), so targets start at t=2.
    assert tokens[0, :10].tolist() == p0 + r0
    assert mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1] + [0] * 7
    assert mask[1].tolist() == [0, 0, 1, 1, 1] + [0] * 11
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"data_source": "s", "prompt": "q", "response": ["turn", "observation"]}) + "\n")
    with pytest.raises(BadRowError, match=r"row 0 .*'response' as a list"):
        sft_pairs(DataSection(source="file", path=str(bad)), TOK, max_total_len=64, seed=0)


def test_demo_config_writes_its_problem_file_once_and_trains_on_it(tmp_path):
    from laminar_jax.data.sft import sft_pairs

    c = finalize(repo_config("agentic_demo"))
    assert c.env.enabled and c.env.default == "calculator" and c.runtime.sft_warmup_steps > 0
    pairs, counts = sft_pairs(c.data, TOK, max_total_len=c.rollout.max_total_len, seed=0)
    assert counts["rows"] == len(pairs) and counts["response_truncated"] == 0
    assert {TOK.decode(pair[1])[:7] for pair in pairs} == {TOOL_CALL_START[:7], "Answer:"}  # tool and direct
    assert all(pair[1][-1] == TOK.eos_id for pair in pairs)
    assert max(len(pair[0]) for pair in pairs) <= c.rollout.max_prompt_len
    path = str(tmp_path / "p.jsonl")
    write_problem_file(path, 5, 1, TOK)
    before = open(path).read()
    write_problem_file(path, 5, 2, TOK)  # already there: kept as is
    assert open(path).read() == before and len(before.splitlines()) == 5
    assert json.loads(before.splitlines()[0])["extra_info"]["env"] == "calculator"


def test_calls_tool_reads_policy_tokens_only():
    start = TOK.encode(TOOL_CALL_START)
    ids = TOK.encode("x" + TOOL_CALL_START + "y")
    assert calls_tool(ids, [1] * len(ids), start)
    assert not calls_tool(ids, [1] + [0] * (len(ids) - 1), start)  # in an observation: not the policy's call
    assert not calls_tool(TOK.encode("no call"), [1] * 7, start)


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        repo_config("agentic_demo", "nope")
