"""The speculative decoding loop (batch of one): draft, verify in one pass, accept, roll back, adapt.

``speculative_steps`` yields one ``(token, logprobs, Speculation)`` per generated token, in the order plain decoding
would give them; ``Speculation`` says whether the token was a draft the target accepted and the running counts of
drafted and accepted tokens. Greedy output is token for token that of plain decoding; sampled output has the
target's distribution (``accept``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cache import HybridCache
from ..sampling import SamplingParams
from .accept import TargetSampling, accept_greedy, accept_sampled, processed_logprobs
from .adaptive import DraftLength
from .drafts import Drafter
from .verify import rollback, verify_pass

__all__ = ["Speculation", "check_speculative_sampling", "propose_drafts", "speculative_steps", "verify_step"]


@dataclass(frozen=True)
class Speculation:
    """Per token: ``from_draft`` (a drafted token the target accepted), and the counts so far of ``drafted`` tokens
    (proposed to a verify pass) and ``accepted`` ones."""

    from_draft: bool
    drafted: int
    accepted: int


def check_speculative_sampling(params: SamplingParams) -> None:
    """Refuse sampling options the acceptance rule cannot reproduce: a custom ``sampler`` (its distribution is
    unknown)."""
    if params.sampler is not None:
        raise ValueError("speculative decoding needs the target's distribution: a custom sampler= is not supported "
                         "with draft=")


def propose_drafts(drafter: Drafter, history: list[int], k: int, vocab: int) -> tuple[list[int], Optional[mx.array]]:
    """Up to ``k`` drafts and their q ([len(drafts), vocab]: the drafter's ``draft_probs`` after ``propose``, None
    for a drafter without one: one-hot)."""
    if k <= 0:
        return [], None
    drafts = list(drafter.propose(history, k))[:k]
    q = getattr(drafter, "draft_probs", None)
    if q is None or not drafts:
        return drafts, None
    if q.ndim != 2 or q.shape[0] < len(drafts) or q.shape[1] != vocab:
        raise ValueError(f"the drafter's draft_probs must be [{len(drafts)} drafts, {vocab} (the target's "
                         f"vocabulary)], got {list(q.shape)}")
    return drafts, q[: len(drafts)]


def verify_step(model: nn.Module, cache: HybridCache, history: list[int], drafts: Sequence[int], *,
                processors: Sequence[Callable] = (), target: Optional[TargetSampling] = None,
                draft_probs: Optional[mx.array] = None,
                key: Optional[mx.array] = None) -> tuple[list[int], int, mx.array]:
    """One verify pass and its acceptance, before the rollback: ``history[-1]`` (the newest token, not yet in
    ``cache``) and ``drafts`` through the target in one pass, the logits processors applied per position
    (``processors`` see ``history``, which may be the recent tokens only, as a sampler's), then the greedy rule
    (``target`` None) or the speculative-sampling rule with the drafts' q (``draft_probs`` [k, vocab], None:
    one-hot), drawing with ``key`` (None: the global generator).

    Returns ``(tokens, n, logprobs)``: the n accepted drafts and the target's next token, and the log-probabilities
    [1 + k, vocab] after the processors (row i: the distribution of ``tokens[i]``). The cache still holds every
    draft: the caller cuts the run where it must (a stop token) and calls ``rollback(model, cache, history[-1],
    drafts, kept)`` with ``kept`` <= n."""
    logits = verify_pass(model, cache, history[-1], drafts)
    logprobs = processed_logprobs(processors, history, drafts, logits)
    if target is None:
        tokens, n = accept_greedy(logprobs, drafts)
    else:
        tokens, n = accept_sampled(target.probs(logprobs), drafts, draft_probs, key=key)
    return tokens, n, logprobs


def _prefill(model: nn.Module, cache: HybridCache, ids: list[int], step: int, after: Callable) -> None:
    """Feed ``ids`` into ``cache`` in chunks of ``step`` tokens."""
    for s in range(0, len(ids), step):
        model(mx.array([ids[s : s + step]], dtype=mx.int32), cache=cache)
        after(cache)
        mx.eval([c.state for c in cache])


def _plain_run(model: nn.Module, cache: HybridCache, last: int, n: int, target: Optional[TargetSampling],
               after_forward: Callable) -> Iterator[tuple[int, mx.array]]:
    """``n`` plain decode steps after ``last`` (not yet in ``cache``), each launched before the previous token is read
    (as mlx-lm's ``generate_step``: the next forward is built while this one runs). Yields (token, logprobs [vocab]).
    Greedy: the argmax; sampled: a draw from the target's distribution (what a pass without drafts accepts)."""

    def step(y: mx.array) -> tuple[mx.array, mx.array]:
        logits = model(y.reshape(1, 1), cache=cache)[0, -1]
        after_forward(cache)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if target is None:
            return mx.argmax(logprobs), logprobs
        return mx.random.categorical(mx.log(target.probs(logprobs[None])[0])), logprobs

    y, logprobs = step(mx.array(last, dtype=mx.int32))
    mx.async_eval(y, logprobs)
    for i in range(n):
        if i + 1 < n:
            y_next, logprobs_next = step(y)
            mx.async_eval(y_next, logprobs_next)
        yield int(y.item()), logprobs
        if i + 1 < n:
            y, logprobs = y_next, logprobs_next


def speculative_steps(model: nn.Module, prompt: Sequence[int], cache: HybridCache, drafter: Drafter, *,
                      params: SamplingParams, processors: Sequence[Callable] = (), max_tokens: int = 256,
                      num_draft_tokens: int = 8, prefill_step_size: int = 2048,
                      length: Optional[DraftLength] = None, after_forward: Callable = lambda cache: None,
                      rank0: Optional[Callable[[list[int]], list[int]]] = None,
                      ) -> Iterator[tuple[int, mx.array, Speculation]]:
    """Generate up to ``max_tokens`` tokens after ``prompt`` (ids not yet in ``cache``) with drafts from ``drafter``.

    params: the sampling options (temp 0: greedy; else temp / top_p / min_p / top_k as mlx-lm's sampler; no custom
    sampler); processors: the logits processors (penalties, logit bias), applied per position; length: the adaptive
    draft length (default ``DraftLength(num_draft_tokens)``); after_forward: called with the cache after each forward
    pass (latent-cache quantization); rank0: on the ranks of a distributed model (every rank runs this loop in
    lockstep), ids -> rank 0's ids on every rank (a collective); every rank then verifies rank 0's drafts and keeps
    rank 0's outcome (accepted count and tokens), so the ranks' caches, draft lengths and outputs never part, even
    where their drafters or draws could differ. Yields (token, logprobs [vocab], Speculation).

    While ``length`` has speculation off (its ``off_for`` > 1), with no logits processors and no ``rank0``, the steps
    run pipelined (``_plain_run``): then, as with ``generate_step``, the cache already holds the token just yielded
    when the consumer stops early."""
    check_speculative_sampling(params)
    length = length or DraftLength(num_draft_tokens)
    target = TargetSampling(params.temp, params.top_p, params.min_p, params.top_k) if params.temp > 0 else None
    if callable(getattr(drafter, "prepare", None)):
        drafter.prepare(model, target, processors)
    history = list(prompt)
    _prefill(model, cache, history[:-1], prefill_step_size, after_forward)
    last, produced, drafted, accepted = history[-1], 0, 0, 0
    while produced < max_tokens:
        off = min(getattr(length, "off_for", 0), max_tokens - produced)
        if off > 1 and not processors and rank0 is None:  # off for a while: plain steps, pipelined
            for token, logprobs in _plain_run(model, cache, last, off, target, after_forward):
                length.observe(0, 0)
                produced += 1
                yield token, logprobs, Speculation(False, drafted, accepted)
                history.append(token)
                last = token
            continue
        k = min(length.next_length(), max_tokens - produced - 1)
        drafts, q = propose_drafts(drafter, history, k, model.args.vocab_size)
        if rank0 is not None:
            mine, drafts = drafts, rank0(drafts)
            if drafts != mine:  # rank 0's drafts: this rank's q is not theirs (its outcome is rank 0's anyway)
                q = None
        tokens, n, logprobs = verify_step(model, cache, history, drafts, processors=processors, target=target,
                                          draft_probs=q)
        if rank0 is not None:
            n, *tokens = rank0([n, *tokens])
        rollback(model, cache, last, drafts, n)
        after_forward(cache)
        length.observe(n, len(drafts))
        drafter.observe(n, len(drafts))
        drafted, accepted = drafted + len(drafts), accepted + n
        for i, token in enumerate(tokens):
            yield token, logprobs[i], Speculation(i < n, drafted, accepted)
        history += tokens
        last, produced = tokens[-1], produced + len(tokens)
