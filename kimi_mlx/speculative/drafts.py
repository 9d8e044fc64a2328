"""Drafters: who proposes the tokens a verify pass checks.

A ``Drafter`` proposes up to ``k`` next tokens after ``history`` (the prompt and every token generated so far, ids)
and hears back, after each verify pass, how many of its proposals were accepted (``observe``), so that it can adapt.
Two optional parts: ``prepare(target, sampling, processors)``, called by the loop before the first pass (the
target model, its ``TargetSampling`` or None for greedy, its logits processors: a model drafter checks its
vocabulary and drafts under the same options), and ``draft_probs``, set by ``propose`` to the distributions
``[len(drafts), vocab]`` the drafts were drawn from (None, or no such attribute: deterministic drafts, one-hot q),
which the sampled acceptance rule then uses. The model-free drafters here propose deterministic tokens;
``draft_model.DraftModel`` (a Kimi model) gives both parts.

``PromptLookup`` is model-free: it finds the most recent earlier occurrence of the history's last n tokens (n tried
from the largest of ``ngram_sizes`` down) and proposes the tokens that followed it. Given a ``reference`` (an API
request's predicted output: text the reply is expected to repeat), it looks there first, in reading order from
where the last accepted drafts from it ended, and proposes the reference's start when nothing is generated yet.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import mlx.nn as nn

from .draft_model import DraftModel

__all__ = ["Drafter", "InContext", "PromptLookup", "make_drafter"]


class Drafter(Protocol):
    """What the speculative loop asks of a drafter."""

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft ids to follow ``history`` (may be fewer, or none)."""

    def observe(self, accepted: int, proposed: int) -> None:
        """The last proposal's outcome: ``accepted`` of its ``proposed`` tokens were accepted."""


class PromptLookup:
    """N-gram lookup over the prompt and the generated text (model-free drafts).

    ngram_sizes: the match lengths tried, largest first (a longer match is a better predictor); max_draft: at most this
    many tokens proposed per call (``k`` caps it further). Matches are searched from the most recent backwards, the
    last ``window`` tokens of the history only (bounded cost per call). reference: ids the continuation is expected
    to repeat, searched before the history for each n (the first match at or after where the last accepted drafts
    from it ended, else its first match); reference_at: the history's length where the reference begins (the
    prompt's), where its first tokens are proposed."""

    def __init__(self, ngram_sizes: Sequence[int] = (3, 2, 1), max_draft: int = 16, window: int = 8192,
                 reference: Sequence[int] = (), reference_at: Optional[int] = None):
        sizes = sorted({int(n) for n in ngram_sizes}, reverse=True)
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"ngram_sizes must be positive integers, got {ngram_sizes}")
        if max_draft < 1 or window < 2:
            raise ValueError(f"max_draft must be >= 1 and window >= 2, got {max_draft}, {window}")
        self.ngram_sizes, self.max_draft, self.window = tuple(sizes), max_draft, window
        self.reference, self.reference_at = list(reference[:window]), reference_at
        self._cursor = 0  # where the reply is in the reference, as far as accepted drafts tell
        self._from = None  # the reference position the last proposal started at (None: it came from the history)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        k = min(k, self.max_draft)
        self._from = None
        if k <= 0:
            return []
        if self.reference and len(history) == self.reference_at:
            self._from = 0
            return self.reference[:k]
        h = list(history[-self.window :])
        for n in self.ngram_sizes:
            if len(h) <= n:
                continue
            tail = h[-n:]
            at = self._in_reference(tail)
            if at is not None:
                self._from = at
                return self.reference[at : at + k]
            # most recent earlier occurrence whose continuation is non-empty
            for start in range(len(h) - n - 1, -1, -1):
                if h[start : start + n] == tail:
                    return h[start + n : start + n + k]
        return []

    def _in_reference(self, tail: list[int]) -> Optional[int]:
        """Where the continuation of ``tail`` starts in the reference: after its first occurrence ending at or after
        the cursor, else after its first occurrence (None: no occurrence with a continuation)."""
        ref, n = self.reference, len(tail)
        starts = [s for s in range(len(ref) - n) if ref[s : s + n] == tail]
        return next((s + n for s in starts if s + n >= self._cursor), starts[0] + n if starts else None)

    def observe(self, accepted: int, proposed: int) -> None:
        """Moves the reference cursor past the accepted drafts taken from it (the history needs no state)."""
        if self._from is not None:
            self._cursor = self._from + accepted


class InContext:
    """``drafter`` seeing ``context`` (ids already in the cache before the prompt a generation was given, e.g. a
    chat's earlier turns) before each history it is asked about: a continued conversation drafts from all of it,
    and a drafter with a cache of its own (``DraftModel``) follows the whole conversation."""

    def __init__(self, drafter: Drafter, context: Sequence[int]):
        self.drafter, self.context = drafter, list(context)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return self.drafter.propose(self.context + list(history), k)

    def observe(self, accepted: int, proposed: int) -> None:
        self.drafter.observe(accepted, proposed)

    def __getattr__(self, name: str):  # the inner drafter's extras (``prepare``, ``draft_probs``)
        if name == "drafter":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.drafter, name)


def make_drafter(draft, max_draft: int, **model_options) -> Optional[Drafter]:
    """``draft`` as a drafter: None (no speculation), "lookup" (``PromptLookup`` with ``max_draft``), a loaded Kimi
    model (an ``nn.Module``: ``DraftModel(draft, **model_options)``, e.g. the latent-cache options ``kv_bits``,
    ``kv_group_size``, ``quantized_kv_start``), or a drafter."""
    if draft is None:
        return None
    if isinstance(draft, str):
        if draft == "lookup":
            return PromptLookup(max_draft=max_draft)
        raise ValueError(f"draft={draft!r}: the only named drafter is 'lookup'; load a draft model with "
                         f"kimi_mlx.loading.load_draft(path, tokenizer) and pass the model")
    if isinstance(draft, nn.Module):
        return DraftModel(draft, **model_options)
    if hasattr(draft, "propose") and hasattr(draft, "observe"):
        return draft
    raise ValueError(f"draft must be None, 'lookup', a loaded Kimi model or a drafter (propose/observe), "
                     f"got {type(draft).__name__}")
