"""synthetic_skew: heavy-tailed required length, short prompts, graded reward, SFT examples."""

import numpy as np

from laminar_jax.data import DataSection, build_prompt_source, default_registry
from laminar_jax.data import synthetic_skew as sk
from laminar_jax.model.tokenizer import BuiltinTokenizer

TOK = BuiltinTokenizer()


def _prompts(n, seed=0):
    return list(build_prompt_source(DataSection(dataset_size=n, seed=seed, num_epochs=1), TOK))


def test_required_length_is_heavy_tailed():
    for seed in (0, 1):
        lengths = np.array([sk.target_length(p.ground_truth) for p in _prompts(2000, seed)])
        median, p99 = np.median(lengths), np.percentile(lengths, 99)
        print(f"seed={seed} median={median} p99={p99} ratio={p99 / median:.2f} max={lengths.max()}")
        assert p99 / median >= 8.0
        assert lengths.max() <= 32 * 4  # clipped: max_repeats * (pattern_max + 1)


def test_prompts_are_short_and_self_describing():
    for p in _prompts(500):
        text = p.prompt_text
        assert len(text) < 24 and p.data_source == "synthetic_skew"
        pattern, repeats = sk.parse_prompt(text)
        assert p.ground_truth == sk.make_target(pattern, repeats)
        assert sk.target_length_for_prompt(text) == len(p.ground_truth)
        assert TOK.UNK not in p.prompt_ids and TOK.UNK not in TOK.encode(p.ground_truth)
        assert TOK.decode(TOK.encode(p.ground_truth)) == p.ground_truth
    assert sk.make_target("ab", 4) == "ab3ab2ab1ab0" and sk.make_prompt("ab", 4) == "ab*4="


def test_reward_is_graded():
    target = sk.make_target("xyz", 12)
    t = len(target)
    reward = default_registry().get_reward_fn("synthetic_skew")
    assert reward(target, target, {}) == 1.0
    assert reward(target + "\n", target, {}) == 1.0  # surrounding whitespace is not penalised
    assert reward("", target, {}) == 0.0
    prefix_scores = [reward(target[:m], target, {}) for m in (4, 16, 30, t - 1)]
    assert all(0 < a < b < 1 for a, b in zip(prefix_scores, prefix_scores[1:]))
    assert abs(prefix_scores[0] - 4 / t) < 1e-9
    over = [reward(target + "xyz0" * k, target, {}) for k in (1, 3)]
    assert 1 > over[0] > over[1] > 0  # overshoot (no EOS) costs per extra character
    assert reward(target + "q" * (2 * t), target, {}) == 0.0
    wrong_counter = target.replace("B", "9", 1)
    assert reward(wrong_counter, target, {}) == 1 - 1 / t
    assert reward("garbage", target, {}) < 0.2


def test_levenshtein_matches_definition():
    assert sk.levenshtein("kitten", "sitting") == 3
    assert sk.levenshtein("", "abc") == 3 and sk.levenshtein("abc", "abc") == 0
    assert sk.levenshtein("abcdef", "ab", limit=2) == 2


def _table_distance(a, b):
    """The textbook dynamic-programming table, as the reference for the bit-vector version."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
        prev = cur
    return prev[-1]


def test_levenshtein_equals_the_table_on_random_strings():
    rng = np.random.default_rng(0)
    for n in range(1500):
        alphabet = "ab" if n % 2 else "abcde*=9"
        a, b = ("".join(rng.choice(list(alphabet), int(rng.integers(0, hi)))) for hi in (30, 30))
        if n % 50 == 0:  # longer than a machine word
            a, b = ("".join(rng.choice(list(alphabet), int(rng.integers(60, 150)))) for _ in range(2))
        d = _table_distance(a, b)
        assert sk.levenshtein(a, b) == d, (a, b)
        limit = int(rng.integers(1, 20))
        assert sk.levenshtein(a, b, limit=limit) == min(d, limit), (a, b, limit)


def test_sft_examples_are_deterministic_and_correct():
    a, b = sk.sft_examples(300, seed=7), sk.sft_examples(300, seed=7)
    assert a == b and a != sk.sft_examples(300, seed=8)
    for prompt, response in a:
        pattern, repeats = sk.parse_prompt(prompt)
        assert response == sk.make_target(pattern, repeats) and len(prompt) < 24
    rl_prompts = [p.prompt_text for p in _prompts(300, seed=7)]
    assert [x for x, _ in a] != rl_prompts  # a separate random stream from the RL prompts
