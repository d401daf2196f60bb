"""The warm-start's packed rows: each example's tokens, loss mask and logprobs as if it were alone."""

import jax.numpy as jnp
import numpy as np

from laminar_jax.learner.sft import pack_examples, pack_rows
from laminar_jax.model import build_model, token_logprobs
from laminar_jax.model.config import ModelSection


def _pairs():
    rng = np.random.default_rng(0)
    out = []
    for n in (3, 9, 1, 14, 5, 7, 2, 11):
        p, r = list(rng.integers(3, 100, 4)), list(rng.integers(3, 100, n))
        out.append((p, r) if n != 9 else (p, r, [1] * 4 + [0] * 3 + [1] * 2))  # a masked observation
    return out


def test_packed_rows_hold_every_example_with_its_own_mask_positions_and_segment():
    pairs, L = _pairs(), 32
    tokens, mask, segs, pos = pack_rows(pairs, L, range(len(pairs)))
    alone_t, alone_m = pack_examples(pairs, L)
    assert tokens.shape[0] < len(pairs)  # several examples share a row
    found = 0
    for row in range(tokens.shape[0]):
        for s in range(1, segs[row].max() + 1):
            at = np.flatnonzero(segs[row] == s)
            i = next(i for i in range(len(pairs)) if list(alone_t[i][:len(at)]) == list(tokens[row, at])
                     and alone_t[i][len(at):].sum() == 0)
            assert list(pos[row, at]) == list(range(len(at)))
            assert list(mask[row, at]) == list(alone_m[i][:len(at)])
            assert mask[row, at[-1]] == 0  # the last token predicts nothing: no loss across examples
            found += 1
    assert found == len(pairs)


def test_packed_logprobs_equal_each_example_alone():
    model = build_model(ModelSection(preset="tiny"))
    pairs, L = _pairs(), 32
    tokens, mask, segs, pos = pack_rows(pairs, L, range(len(pairs)))
    packed = np.asarray(token_logprobs(model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(segs))[:, :-1],
                                       jnp.asarray(tokens[:, 1:])))
    alone_t, alone_m = pack_examples(pairs, L)
    alone = np.asarray(token_logprobs(model(jnp.asarray(alone_t), None, jnp.asarray((alone_t != 0).astype(np.int32)))
                                      [:, :-1], jnp.asarray(alone_t[:, 1:])))
    got, want = np.sort(packed[mask[:, :-1] > 0]), np.sort(alone[alone_m[:, :-1] > 0])
    assert len(got) == len(want) and np.allclose(got, want, atol=2e-3)
