"""Multi-turn episodes on CPU: the demo's tiny model, each prompt an episode against an environment.

python launch/run.py --config=configs/agentic_demo.py            # the calculator demo, a few minutes on 2 cores
python launch/run.py --config=configs/agentic_demo.py:latency    # the benchmark workload

Default variant (''): arithmetic word problems (one operation on one-digit numbers, two-digit
answers) with the `calculator` environment. The demo writes its problems
(laminar_jax/env/word_problems.py) to a JSON-lines file in the temp directory, each row with a
synthetic trace as its 'response': half of them a tool-use trace (tool call, tool message, exact
answer), half a rough direct answer without the tool (off by up to DIRECT_SPREAD, right about one
time in five). A supervised warm-start on those traces (the tool message masked out of the loss)
teaches both, so the policy starts calling the tool on about half the problems; RL then learns
that the tool pays.
The reward is correctness only (1 when the answer's last number is right), so `reward_curve` is the
correct-answer rate; `tool_call_curve` is the share of trajectories that called the tool. Both rise
(docs/AGENTS.md has the measured figures; tests/env/test_agentic_run.py, slow, checks the rise).
'calculator_short': the same, a handful of steps and a 20-step warm-start (no learning expected).

Variant 'latency' (the benchmark workload, also `launch/bench.py e2e --workload agentic`): the
`latency` environment, 3 policy turns per episode, log-normal latency per step (median 3 s, the
preset); the reward is the share of non-empty turns; waiting episodes give their slot up, servers
admit while 2 versions behind, 3 batches in flight (_env_bound). Variant 'short': the same with a 50 ms
median, for tests; 'resume': 0.5 s, so that a kill lands mid-episode.
"""

import os
import tempfile

from laminar_jax.config import repo_config

LATENCY_MEDIAN_S = 3.0
CALCULATOR_PROBLEMS = 4096
TOOL_SHARE = 0.5
# Direct answers off by up to 2 (right about one time in five): exact ones the tiny model memorises,
# as well as its seed lets it, and where it memorises well RL has little left to gain from the tool.
DIRECT_SPREAD = 2
VARIANTS = ("", "calculator_short", "latency", "short", "resume")


def calculator_file(seed: int = 0, n: int = CALCULATOR_PROBLEMS, tool_share: float = TOOL_SHARE,
                    direct_spread: int = DIRECT_SPREAD) -> str:
    """The demo's problem file (written once; the builtin tokenizer's tool-message rendering)."""
    from laminar_jax.env.word_problems import write_problem_file
    from laminar_jax.model.tokenizer import load_tokenizer

    name = f"calculator-s{seed}-n{n}-t{tool_share:g}-d{direct_spread}-v6.jsonl"
    path = os.path.join(tempfile.gettempdir(), "laminar_jax_agentic_demo", name)
    return write_problem_file(path, n, seed, load_tokenizer("builtin"), tool_share=tool_share,
                              direct_spread=direct_spread)


def _episodes(c) -> None:
    c.runtime.progress = False
    c.env.enabled = True
    c.env.turn_stop = "</tool_call>"
    c.env.workers = 16
    c.env.timeout_s = 60.0
    # Eval rounds are single-turn (launch/eval.py and runtime.eval_every refuse episodes).
    c.data.val_size = 0
    c.runtime.eval_every = 0


def _calculator(c, short: bool) -> None:
    c.data.source = "file"
    c.data.path = calculator_file(c.data.seed)
    c.data.max_prompt_tokens = 80  # the questions are 40 characters + BOS
    c.rollout.max_prompt_len = 80
    c.env.default = "calculator"
    c.env.env_kwargs = {"calculator": {"max_turns": 3}}
    c.env.turn_max_new_tokens = 96  # a tool call is 76 characters
    c.rollout.max_new_tokens = 96  # the first turn's budget
    c.rollout.max_total_len = 256
    c.rollout.num_pages = 16 * 16 + 1
    c.rollout.temperature = 1.0
    c.learner.seq_len_buckets = (128, 256)
    c.learner.pack_length = 256
    # The tiny model copies the operands into its call after ~400 steps on tool traces alone; here
    # half the traces are direct answers, and at 500 steps whether it copied depended on its seed
    # (instead it wrote an expression with the answer it recalled, e.g. 5+6 for "8 cards and 3 more").
    c.runtime.sft_warmup_steps = 20 if short else 1000
    c.runtime.sft_lr = 1e-2
    # RL on a sharp warm-started tiny model: at the single-turn demo's 1e-3 (or even 2e-4) Adam's
    # per-parameter steps wreck the copying it learned and reward falls; 1e-4 keeps it and moves the
    # choice tool / no tool.
    c.learner.lr = 1e-4
    c.runtime.total_steps = 4 if short else 40
    c.runtime.prompts_per_step = 8
    c.runtime.samples_per_prompt = 4 if short else 8


def _latency(c, median_s: float, steps: int) -> None:
    c.runtime.sft_warmup_steps = 0
    c.env.default = "latency"
    c.env.turn_max_new_tokens = 16
    c.rollout.max_new_tokens = 16  # the first turn's budget
    c.rollout.max_total_len = 128
    c.learner.seq_len_buckets = (64, 128)
    c.learner.pack_length = 128
    c.env.env_kwargs = {"latency": {"turns": 3, "median_s": median_s, "sigma": 0.5}}
    c.runtime.total_steps = steps
    c.runtime.samples_per_prompt = 4
    c.runtime.prompts_per_step = 4


def get_config(variant: str = ""):
    if variant not in VARIANTS:
        raise ValueError(f"configs/agentic_demo.py: unknown variant {variant!r} (known: {VARIANTS})")
    c = repo_config("demo", "short")
    _episodes(c)
    if variant in ("", "calculator_short"):
        _calculator(c, short=bool(variant))
    else:
        median = {"latency": LATENCY_MEDIAN_S, "short": 0.05, "resume": 0.5}[variant]
        _latency(c, median, 3 if variant == "short" else 6)
    if variant == "latency":
        _env_bound(c)
    return c


def _env_bound(c) -> None:
    """Settings for episodes that wait seconds on their environment (the benchmark workload)."""
    # A waiting episode holds no slot, so the slot count does not cap the episodes in flight.
    c.env.release_slot_while_waiting = True
    # An episode lasts ~10-25 s and the learner publishes every ~9 s: at admit_lag 1 a server
    # stops admitting two publishes after its swap and drains episodes of up to ~25 s before the
    # next. The back-pressure below bounds staleness anyway.
    c.scheduler.admit_lag = 2
    # Throughput is episodes in flight over episode time (Little's law), and the learner idles:
    # 3 batches in flight instead of 2 took laminar/sync from 1.93x to 2.67x at mean staleness
    # 2.7 instead of 1.9 (docs/BENCHMARKS.md, agentic workload).
    c.runtime.max_inflight_batches = 3
