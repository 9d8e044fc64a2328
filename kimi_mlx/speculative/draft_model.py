"""A draft model: a (smaller) Kimi model sharing the target's tokenizer proposes the tokens a verify pass checks.

``DraftModel(model)`` is a ``Drafter`` with its own ``HybridCache`` and the ids that cache holds (``tokens``,
``len(tokens) == cache.offset``). ``propose(history, k)``:

1. brings the cache to ``history[:-1]`` (the last token is the first draft step's input, as the target's ``last``
   is its verify pass's first): what the cache holds beyond the common prefix of ``tokens`` and ``history`` is
   dropped by ``HybridCache.trim`` back to the latest checkpoint at or before that prefix (the KDA states restored,
   the MLA latent cut by length), then the ids of ``history`` after that point are fed in one pass (chunks of
   ``prefill_step_size``). With no checkpoint that far back (the history changed before the kept ones) the cache is
   emptied and refilled. So the drafter can be used from any loop, skipped for a while and resumed.
2. drafts ``k`` tokens, one decode step each (the history's last token, then each draft but the last), taking a
   checkpoint before each step.

That checkpoint is the rollback: after a verify pass accepted n of the k drafts, the next history is ``history,
d_1 .. d_n, t``; its prefix ``history, d_1 .. d_n`` is what the cache held before the step that fed d_{n+1}, so the
trim restores that checkpoint and nothing is re-fed (re-feeding happens only where a history differs from what was
drafted in some other way). A checkpoint copies nothing: it keeps the KDA state arrays that step had produced anyway
(the draft model's k + 1 states stay alive; the cache keeps ``max(8, k + 1)`` checkpoints). The cache after a
rollback is that of the same segments fed to a fresh cache (tests/test_speculative_draft_model.py).

Proposals. The loop calls ``prepare(target, sampling, processors)`` before the first pass: the vocabulary sizes must
match (the drafts are the target's ids and q is compared with p position by position), and the draft then follows
the target's sampling options. Greedy (``sampling`` None): each draft is the argmax. Sampled: each draft is drawn
from the draft model's own distribution under the same options (``TargetSampling.probs``: temperature, top_p, min_p,
top_k), and ``draft_probs`` ([k, vocab] float32, row i the distribution d_i was drawn from) hands q to the
speculative-sampling rule (``accept_sampled``), which then accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)).

Logits processors (penalties, ``logit_bias``): the draft applies the target's processors to its own logits, on the
history extended by the drafts before each position (the same rows the verify pass processes). The output is the
target's either way (greedy: drafts are only checked; sampled: the rule is exact for any q); applying them gives the
better acceptance, since the target's tokens are the processed ones: a repetition penalty moves the target's argmax
away from a repeated token that an unprocessed draft would propose again.

Batch of one; token ids only (no images: the target's ``stream_generate`` refuses ``images=`` with ``draft=``; a
draft model's vision tower is not used).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cache import HybridCache, check_kv_quant
from .accept import TargetSampling, processed_logprobs

__all__ = ["DraftModel", "check_draft_vocab"]


def _vocab_size(model) -> int:
    return int(model.args.vocab_size)


def check_draft_vocab(target: nn.Module, draft: nn.Module) -> None:
    """Refuse a draft model whose vocabulary size differs from the target's (naming both)."""
    if _vocab_size(draft) != _vocab_size(target):
        raise ValueError(f"the draft model's vocabulary has {_vocab_size(draft)} ids, the target's "
                         f"{_vocab_size(target)}: a draft model must share the target's tokenizer and vocabulary")


class DraftModel:
    """A ``Drafter`` over a Kimi model (Kimi Linear or K3, as ``kimi_mlx.load`` gives it) with its own cache.

    kv_bits / kv_group_size / quantized_kv_start: the latent-cache quantization (as ``stream_generate``'s: 8 or 4
    bits, None for float; quantized from the start when ``quantized_kv_start`` is 0, else converted once the cache
    holds that many tokens); prefill_step_size: the chunk size of a catch-up feed. See the module docstring."""

    def __init__(self, model: nn.Module, *, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                 quantized_kv_start: int = 0, prefill_step_size: int = 2048):
        if not callable(getattr(model, "make_cache", None)) or not hasattr(getattr(model, "args", None),
                                                                          "vocab_size"):
            raise ValueError(f"a draft model must be a Kimi model as kimi_mlx.load gives it (with make_cache and "
                             f"args.vocab_size), got {type(model).__name__}")
        check_kv_quant(kv_bits, kv_group_size)
        if quantized_kv_start < 0 or prefill_step_size < 1:
            raise ValueError(f"need quantized_kv_start >= 0 and prefill_step_size >= 1, got {quantized_kv_start}, "
                             f"{prefill_step_size}")
        self.model, self.prefill_step_size = model, prefill_step_size
        self.kv_bits, self.kv_group_size, self.quantized_kv_start = kv_bits, kv_group_size, quantized_kv_start
        self.sampling: Optional[TargetSampling] = None
        self.processors: Sequence[Callable] = ()
        self.draft_probs: Optional[mx.array] = None
        self.cache = self._new_cache()
        self.tokens: list[int] = []

    @property
    def vocab_size(self) -> int:
        return _vocab_size(self.model)

    def _new_cache(self) -> HybridCache:
        quantized_now = self.kv_bits is not None and self.quantized_kv_start == 0
        return self.model.make_cache(kv_bits=self.kv_bits if quantized_now else None,
                                     kv_group_size=self.kv_group_size)

    def prepare(self, target: nn.Module, sampling: Optional[TargetSampling] = None,
                processors: Sequence[Callable] = ()) -> None:
        """Before the first pass: check the vocabulary against ``target``'s and follow the target's sampling
        (``sampling`` None: greedy) and logits processors."""
        check_draft_vocab(target, self.model)
        self.sampling, self.processors = sampling, tuple(processors)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Bring the cache to ``history[:-1]``, then draft ``k`` tokens (``draft_probs``: their q when sampling)."""
        history = [int(t) for t in history]
        self.draft_probs = None
        if not history:
            raise ValueError("a draft model needs a non-empty history (the prompt at least)")
        self._catch_up(history[:-1])
        if k <= 0:
            return []
        self.cache.max_checkpoints = max(self.cache.max_checkpoints, k + 1)
        drafts, probs, token = [], [], history[-1]
        for _ in range(k):
            self._checkpoint()
            logits = self._forward([token])[-1:]
            lp = processed_logprobs(self.processors, history + drafts, (), logits)
            if self.sampling is None:
                token = int(mx.argmax(lp[0]).item())
            else:
                q = self.sampling.probs(lp)[0]
                token = int(mx.random.categorical(mx.log(q)).item())
                probs.append(q)
            drafts.append(token)
        if probs:
            self.draft_probs = mx.stack(probs)
        return drafts

    def observe(self, accepted: int, proposed: int) -> None:
        """Nothing to do here: the next ``propose`` rolls the cache back to the history it is given."""

    def _catch_up(self, ids: list[int]) -> None:
        """Make the cache hold exactly ``ids``: back to the common prefix, then feed the rest."""
        common = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            common += 1
        if common < len(self.tokens):
            self._back_to(common)
        rest = ids[len(self.tokens):]
        for s in range(0, len(rest), self.prefill_step_size):
            self._forward(rest[s : s + self.prefill_step_size])

    def _back_to(self, n: int) -> None:
        """Roll the cache back to at most ``n`` tokens: the latest checkpoint at or before ``n`` (``trim``), or an
        empty cache when none is kept that far back."""
        cp = next((c for c in reversed(self.cache.checkpoints) if c.offset <= n), None)
        if cp is None:
            self.cache = self._new_cache()
            self.tokens = []
            return
        self.cache.trim(self.cache.offset - cp.offset)
        del self.tokens[cp.offset:]

    def _checkpoint(self) -> None:
        """A checkpoint at the current offset, unless the newest one is already there (it then holds this state:
        a restore drops the checkpoints after the one it restores)."""
        cps = self.cache.checkpoints
        if not cps or cps[-1].offset != self.cache.offset:
            self.cache.checkpoint()

    def _forward(self, ids: list[int]) -> mx.array:
        """Feed ``ids`` (one pass) -> their logits [T, vocab]; the cache quantized as configured, evaluated."""
        from mlx_lm.generate import maybe_quantize_kv_cache  # imports transformers: load on first use

        logits = self.model(mx.array([ids], dtype=mx.int32), cache=self.cache)[0]
        self.tokens += ids
        maybe_quantize_kv_cache(self.cache, self.quantized_kv_start, self.kv_group_size, self.kv_bits)
        mx.eval(logits, [c.state for c in self.cache])
        return logits
