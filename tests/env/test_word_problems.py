"""The calculator demo's data: word problems and synthetic tool-use traces that a live episode
reproduces token for token, and the demo config that writes and reads them."""

import json

import numpy as np
import pytest

from laminar_jax.config import finalize, repo_config
from laminar_jax.env.calculator import CalculatorEnv, evaluate, format_number
from laminar_jax.env.tools import TOOL_CALL_END, TOOL_CALL_START, calls_tool, parse_tool_calls, render_tool_message
from laminar_jax.env.word_problems import problem_rows, tool_trace, word_problem, write_problem_file
from laminar_jax.model.tokenizer import BuiltinTokenizer

TOK = BuiltinTokenizer()


def test_rows_are_deterministic_and_traces_solve_their_problem():
    rows = problem_rows(64, seed=3, tokenizer=TOK)
    assert rows == problem_rows(64, seed=3, tokenizer=TOK) and rows != problem_rows(64, seed=4, tokenizer=TOK)
    for row in rows:
        trace, truth = row["response"], row["reward_model"]["ground_truth"]
        (call,) = parse_tool_calls(trace)
        assert call.name == "calculator" and format_number(evaluate(call.arguments["expression"])) == truth
        assert all(n in row["prompt"][0]["content"] for n in call.arguments["expression"].replace("*", " ")
                   .replace("+", " ").replace("-", " ").split())  # the expression's numbers come from the question
        # Replay the trace as an episode: the tool turn, the driver's tool message, the answer.
        action, rest = trace.split(TOOL_CALL_END, 1)
        observation = render_tool_message(truth, TOK)
        assert rest.startswith(observation)
        env = CalculatorEnv()
        env.reset({"ground_truth": truth})
        step = env.step(action + TOOL_CALL_END)
        assert (step.observation, step.reward, step.done) == (truth, 0.0, False)
        assert env.step(rest[len(observation):]) == (None, 1.0, True)


def test_problems_need_the_tool():
    rng = np.random.default_rng(0)
    answers = [int(word_problem(rng).answer) for _ in range(200)]
    assert min(answers) > 30 and len(set(answers)) > 150  # multi-digit, rarely repeated: not guessable


def test_demo_config_writes_its_problem_file_once_and_trains_on_it(tmp_path):
    from laminar_jax.data.sft import sft_pairs

    c = finalize(repo_config("agentic_demo"))
    assert c.env.enabled and c.env.default == "calculator" and c.runtime.sft_warmup_steps > 0
    pairs, counts = sft_pairs(c.data, TOK, max_total_len=c.rollout.max_total_len, seed=0)
    assert counts["rows"] == len(pairs) and counts["response_truncated"] == 0
    prompt, response = pairs[0]
    assert TOK.decode(response).startswith(TOOL_CALL_START) and response[-1] == TOK.eos_id
    assert max(len(p) for p, _ in pairs) <= c.rollout.max_prompt_len
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
