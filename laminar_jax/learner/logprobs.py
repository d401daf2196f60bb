"""Per-token log-probs and entropy from final hidden states, a chunk of positions at a time.

Full logits are f32[B, T, V]; with Qwen's V = 151,936 that is 0.6 MB per token (10 GB for
16 x 1024 tokens, 10 GB for one 16K-token response), before softmax and its gradient. Here the
lm_head projection, the log-softmax and the entropy run inside `lax.map` over chunks of C
positions (all rows of the batch at once, so the row sharding over ('data', 'fsdp') is kept), and
the chunk body is rematerialized (`jax.checkpoint`, nothing saved): the backward pass recomputes
one chunk's logits at a time. Peak logits memory is O(rows_per_device x C x V) instead of
O(rows_per_device x T x V), for one extra lm_head matmul (2 D V FLOPs per token) in the backward.

Per token (z = lm_head(h) / temperature, in float32):
    logp    = token_logprobs(z, target) = z[target] - logsumexp(z)    (laminar_jax.model's definition)
    entropy = logsumexp(z) - sum_v softmax(z)_v z_v                   (losses.entropy_from_logits)
so the chunked and unchunked paths compute the same per-token formulas on the same logits rows.
"""

from __future__ import annotations

from typing import Callable, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp

from laminar_jax.learner.losses import entropy_from_logits
from laminar_jax.model.build import token_logprobs

EntropyMode = Literal["none", "value", "grad"]
"""'none': not computed (zeros); 'value': computed without gradient (metrics); 'grad': differentiable."""


class TokenScores(NamedTuple):
    logp: jax.Array  # f32[B, T] log-prob of targets under softmax(logits / temperature)
    entropy: jax.Array  # f32[B, T] (zeros when entropy == 'none')


def chunk_positions(chunk_tokens: int, rows_per_device: int, seq_len: int) -> int:
    """Positions per chunk C for a budget of `chunk_tokens` tokens per device (0 = one chunk).

    C0 = max(1, chunk_tokens // rows_per_device); with n = ceil(T / C0) chunks, C = ceil(T / n)
    (<= C0), so the padding to n * C is under n positions. Returns T when one chunk suffices.
    """
    if chunk_tokens <= 0:
        return seq_len
    c0 = max(1, chunk_tokens // max(1, rows_per_device))
    if c0 >= seq_len:
        return seq_len
    n = -(-seq_len // c0)
    return -(-seq_len // n)


def _score(project: Callable[[jax.Array], jax.Array], h: jax.Array, targets: jax.Array, temperature: float,
           entropy: EntropyMode) -> TokenScores:
    logits = project(h).astype(jnp.float32) / temperature  # f32[B, C, V]
    logp = token_logprobs(logits, targets)
    if entropy == "none":
        ent = jnp.zeros_like(logp)
    else:
        ent = entropy_from_logits(logits if entropy == "grad" else jax.lax.stop_gradient(logits))
    return TokenScores(logp, ent)


def score_tokens(project: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                 temperature: float, chunk_len: Optional[int] = None, entropy: EntropyMode = "value") -> TokenScores:
    """Log-prob (and entropy) of `targets` from final hidden states, C = chunk_len positions at a time.

    project: f[B, C, D] -> f[B, C, V] logits (the model's `logits_from_hidden`; closes over params).
    hidden: f[B, T, D]; targets: i32[B, T]. chunk_len None or >= T: one chunk, no scan.
    """
    if entropy not in ("none", "value", "grad"):
        raise ValueError(f"entropy={entropy!r}: must be 'none', 'value' or 'grad'")
    b, t, d = hidden.shape
    if chunk_len is None or chunk_len >= t:
        return _score(project, hidden, targets, temperature, entropy)
    if chunk_len < 1:
        raise ValueError(f"chunk_len={chunk_len}: must be >= 1")
    n = -(-t // chunk_len)
    pad = n * chunk_len - t
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk_len, d).swapaxes(0, 1)  # f[n, B, C, D]
    tg = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk_len).swapaxes(0, 1)  # i32[n, B, C]

    # Nothing saved: the backward pass recomputes one chunk's logits from its hidden states.
    body = jax.checkpoint(lambda xs: _score(project, xs[0], xs[1], temperature, entropy),
                          policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    out = jax.lax.map(body, (h, tg))  # TokenScores of f32[n, B, C]
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk_len)[:, :t]
    return TokenScores(unchunk(out.logp), unchunk(out.entropy))
