"""Which drafted tokens a verify pass accepts, and the token that follows them.

The verify pass gives the target's log-probabilities at each of the ``1 + k`` positions (position i predicts the token
after ``last, d_1 .. d_i``). Both rules return ``(tokens, n)``: the ``n`` accepted drafts followed by one token of the
target's own, so every pass yields between 1 and k + 1 tokens.

- Greedy (``temp`` 0): a draft is accepted while it is the target's argmax; the token after is the argmax at the
  first mismatch (or after the last draft). The tokens are exactly those of plain greedy decoding.
- Sampled: the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023). With the target's
  distribution p_i at position i (after the logits processors, top_p / min_p / top_k and the temperature, as
  mlx-lm's sampler draws) and the drafter's q_i, draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i));
  at the first rejection the token is drawn from max(p_i - q_i, 0) renormalised; after k acceptances it is drawn from
  p_k. Each emitted token is then distributed exactly as p (the theorem). A model-free drafter's q is one-hot
  (accept with probability p_i(d_i); on rejection draw from p_i without d_i).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx

__all__ = ["TargetSampling", "accept_greedy", "accept_sampled", "processed_logprobs"]


class TargetSampling:
    """The target's per-position distribution for mlx-lm's sampler options (temp > 0; top_p, min_p, top_k)."""

    def __init__(self, temp: float, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0):
        if temp <= 0:
            raise ValueError("TargetSampling is for temp > 0 (greedy uses accept_greedy)")
        self.temp, self.top_p, self.min_p, self.top_k = temp, top_p, min_p, top_k

    def probs(self, logprobs: mx.array) -> mx.array:
        """[N, vocab] log-probabilities -> [N, vocab] probabilities the sampler draws from (float32)."""
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p  # imports transformers

        x = logprobs.astype(mx.float32)
        if 0 < self.top_p < 1.0:
            x = apply_top_p(x, self.top_p)
        if self.min_p != 0.0:
            x = apply_min_p(x, self.min_p, 1)
        if self.top_k > 0:
            x = apply_top_k(x, self.top_k)
        return mx.softmax(x * (1.0 / self.temp), axis=-1)


def processed_logprobs(processors: Sequence[Callable], history: Sequence[int], drafts: Sequence[int],
                       logits: mx.array) -> mx.array:
    """Log-probabilities [N, vocab] of ``logits`` [N, vocab], row i after the logits processors on ``history``
    extended by the first i ``drafts`` (what plain decoding would have seen there): the verify pass's rows, and a
    draft model's step (N = 1, its drafts so far in ``history``)."""
    if processors:
        rows = []
        for i in range(logits.shape[0]):
            row, seen = logits[i : i + 1], mx.array(list(history) + list(drafts[:i]), dtype=mx.int32)
            for process in processors:
                row = process(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def accept_greedy(logprobs: mx.array, drafts: Sequence[int]) -> tuple[list[int], int]:
    """logprobs: [1 + k, vocab]; drafts: k ids -> (accepted drafts + the next token, number accepted)."""
    best = mx.argmax(logprobs, axis=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return list(drafts[:n]) + [best[n]], n


def accept_sampled(probs: mx.array, drafts: Sequence[int], draft_probs: Optional[mx.array] = None,
                   key: Optional[mx.array] = None) -> tuple[list[int], int]:
    """probs: [1 + k, vocab] target distributions; drafts: k ids; draft_probs: [k, vocab] the drafter's
    distributions (None: one-hot at each draft); key: the random key to draw with (None: MLX's global generator;
    a server row passes its own) -> (accepted drafts + the next token, number accepted)."""
    k = len(drafts)
    key_u, key_draw = mx.random.split(key) if key is not None else (None, None)
    if k:
        idx = mx.array(list(drafts))[:, None]
        p_d = mx.take_along_axis(probs[:k], idx, axis=-1)[:, 0]
        q_d = mx.ones((k,)) if draft_probs is None else mx.take_along_axis(draft_probs, idx, axis=-1)[:, 0]
        u = mx.random.uniform(shape=(k,), key=key_u)
        ok = (u * q_d < p_d).tolist()  # u < p / q, without dividing by a zero q
    n = 0
    while n < k and ok[n]:
        n += 1
    if n == k:
        return list(drafts) + [_draw(probs[k], key_draw)], n
    q = draft_probs[n] if draft_probs is not None else mx.zeros_like(probs[n]).at[drafts[n]].add(1.0)
    residual = mx.maximum(probs[n] - q, 0.0)
    return list(drafts[:n]) + [_draw(residual, key_draw)], n


def _draw(weights: mx.array, key: Optional[mx.array] = None) -> int:
    """One id drawn from the (unnormalised, non-negative) ``weights`` [vocab]."""
    return int(mx.random.categorical(mx.log(weights), key=key).item())
