"""Multi-turn episodes on CPU: the demo's tiny model, each prompt an episode against an environment.

Variant 'latency' (the benchmark workload, also `launch/bench.py e2e --workload agentic`): the
`latency` environment, 3 policy turns per episode, log-normal latency per step (median 3 s, the
preset, or env_median_s); the reward is the share of non-empty turns. Variant 'short': the same
with a 50 ms median, for tests; 'resume': 0.5 s, so that a kill lands mid-episode. The calculator workload (word problems, tool calls, a supervised
warm-start on synthetic tool-use traces) is not built yet.
"""

from laminar_jax.config import repo_config

LATENCY_MEDIAN_S = 3.0


def get_config(variant: str = ""):
    c = repo_config("demo", "short")
    c.runtime.progress = False
    c.runtime.sft_warmup_steps = 0
    c.env.enabled = True
    c.env.default = "latency"
    c.env.turn_max_new_tokens = 16
    c.env.turn_stop = "</tool_call>"
    c.env.workers = 16
    c.env.timeout_s = 60.0
    c.rollout.max_new_tokens = 16  # the first turn's budget
    c.rollout.max_total_len = 128
    c.learner.seq_len_buckets = (64, 128)
    c.learner.pack_length = 128
    median = {"": LATENCY_MEDIAN_S, "latency": LATENCY_MEDIAN_S, "short": 0.05, "resume": 0.5}
    if variant not in median:
        raise ValueError(f"configs/agentic_demo.py: unknown variant {variant!r} (known: '', 'latency', 'short', 'resume')")
    c.env.env_kwargs = {"latency": {"turns": 3, "median_s": median[variant], "sigma": 0.5}}
    c.runtime.total_steps = 3 if variant == "short" else 6
    c.runtime.samples_per_prompt = 4
    c.runtime.prompts_per_step = 4
    return c
