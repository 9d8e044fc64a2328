"""Per-request sampling inside a shared decode batch: each request keeps its own ``SamplingParams``
(``kimi_mlx.sampling``), token history and random key, so its draws do not depend on which other requests share the
batch.

The draws are those of ``kimi_mlx.generate.stream_generate`` with the same params (its ``seed`` is
``mx.random.seed(seed)``): the same logits processors and candidate filters (mlx-lm's), and a key sequence split the
way MLX's global generator splits its own.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..sampling import SamplingParams, make_sampling

HISTORY = 64  # tokens of history the penalties see (mlx-lm's processors look at the last 20)


class RowSampler:
    """Samples one request's tokens from its row of the batch's logits.

    history: the request's tokens so far (prompt, then each sampled token via ``record``). ``params.seed`` None: a
    random seed; ``params.sampler`` is not used (the row draws with its own key; ``GenerationRequest`` refuses one).
    """

    def __init__(self, params: SamplingParams, history: list[int]):
        self.params = params
        _, self.processors = make_sampling(params)
        self.history = list(history[-HISTORY:])
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        self.key = mx.random.key(seed % 2**64)

    def logprobs(self, logits: mx.array) -> mx.array:
        """logits: [1, vocab] (one row) -> log-probabilities [1, vocab] after the logits processors."""
        if self.processors:
            past = mx.array(self.history, dtype=mx.int32)
            for proc in self.processors:
                logits = proc(past, logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def draw(self, logprobs: mx.array) -> mx.array:
        """A token id [1] from ``logprobs`` [1, vocab] (lazy)."""
        p = self.params
        if p.temp == 0:
            return mx.argmax(logprobs, axis=-1)
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / p.temp), key=sub)

    def record(self, token: int) -> None:
        self.history.append(token)
        del self.history[:-HISTORY]


def top_logprobs(logprobs: mx.array, k: int) -> mx.array:
    """The k most likely ids of ``logprobs`` [vocab], most likely first (lazy)."""
    ids = mx.argpartition(-logprobs, k - 1)[:k]
    return ids[mx.argsort(-logprobs[ids])]
