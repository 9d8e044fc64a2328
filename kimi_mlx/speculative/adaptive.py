"""How many tokens to draft next, from the recent acceptance rate, and when drafting does not pay.

``DraftLength`` starts at ``start`` drafts, doubles the length after a pass that accepted every draft (up to
``max_k``) and after a pass with a rejection drafts one more than were accepted (a drafter that was right for n
tokens is likely right for about n again; a pass costs more the longer it is).

Switching off is cost-aware. With a per-draft acceptance rate ``a`` (each draft right with probability ``a`` once the
ones before it were), a pass of k drafts yields ``E(a, k) = (1 - a^(k+1)) / (1 - a)`` tokens on average and costs
``C(a, k) = 1 + draft_cost * k + refeed_cost * (1 - a^k)`` decode steps (the forward pass of 1 + k tokens, plus the
rollback's re-feed when some draft is rejected). Speculation pays while ``E / C > 1``. ``a`` is estimated from the
last ``window`` drafting passes as ``(accepted + 1) / (accepted + rejections + 2)`` (rejections: passes that stopped
at a wrong draft; the + 1 / + 2 keep one pass from deciding on 0 or 1). After each drafting pass, speculation is
switched off when ``E / C`` at the next length is below 1 or the window accepted less than ``off_below`` of what it
drafted. ``off_below`` 0 keeps it on whatever happens (benchmarks and tests that force speculation).

Off means ``cooldown`` plain decode steps, then a probe: one pass at ``min_k``. The probe's outcome joins a fresh
window; if speculation still does not pay, it is off again for twice the previous cool-down (up to
``max_cooldown``). The cool-down returns to ``cooldown`` only after a run of at least ``window + 1`` drafting passes
that paid, so a drafter that is right now and then (a probe that happens to hit, then misses) keeps backing off
instead of being retried every ``cooldown`` tokens. At zero acceptance the drafting passes of n generated tokens are
about log2(n / cooldown) + 1.

A drafter with nothing to propose (prompt lookup without a match) costs a plain step, but one that cannot be
pipelined (the next token must be read to look it up): after ``EMPTY_OFF`` such steps in a row speculation is off as
after a pass that did not pay, so that the steps run pipelined until the next probe.

``draft_cost`` and ``refeed_cost`` are in units of one decode step: the defaults (0.25, 1.0) are a weight-bound
accelerator's order of magnitude (a pass of 1 + k tokens reads the weights once, a re-feed is another pass); a
compute-bound CPU pays more per draft (``bench/bench_speculative.py`` measures the curve and prints the fitted
values). The decisions depend on acceptance counts only (never on timings), so seeded sampled runs reproduce.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DraftLength"]

EMPTY_OFF = 8  # consecutive passes for which the drafter had nothing to propose: off, as after a pass that did not pay


class DraftLength:
    """Adaptive draft length with a cost-aware off switch (see the module docstring)."""

    def __init__(self, max_k: int, min_k: int = 1, start: int = 2, window: int = 2, off_below: float = 0.3,
                 cooldown: int = 64, max_cooldown: int = 1024, draft_cost: float = 0.25, refeed_cost: float = 1.0):
        if max_k < 1 or not 1 <= min_k <= max_k or window < 1:
            raise ValueError(f"need 1 <= min_k <= max_k and window >= 1, got min_k={min_k}, max_k={max_k}, "
                             f"window={window}")
        if draft_cost < 0 or refeed_cost < 0 or cooldown < 1:
            raise ValueError(f"need draft_cost >= 0, refeed_cost >= 0 and cooldown >= 1, got {draft_cost}, "
                             f"{refeed_cost}, {cooldown}")
        self.max_k, self.min_k, self.off_below = max_k, min_k, off_below
        self.draft_cost, self.refeed_cost = draft_cost, refeed_cost
        self.base_cooldown, self.max_cooldown = cooldown, max_cooldown
        self.k = max(min_k, min(start, max_k))
        self.recent: deque = deque(maxlen=window)
        self.off_for, self.cooldown, self.paying, self.backing_off, self.empty = 0, cooldown, 0, False, 0

    @property
    def rate(self) -> float:
        """Accepted / drafted over the recent drafting passes (1 before any)."""
        drafted = sum(p for _, p in self.recent)
        return sum(a for a, _ in self.recent) / drafted if drafted else 1.0

    @property
    def acceptance(self) -> float:
        """The per-draft acceptance estimate ``(accepted + 1) / (accepted + rejections + 2)`` over the window."""
        accepted = sum(a for a, _ in self.recent)
        rejections = sum(a < p for a, p in self.recent)
        return (accepted + 1) / (accepted + rejections + 2)

    def gain(self, k: int, a: float) -> float:
        """Expected tokens per pass of ``k`` drafts at acceptance ``a``, over its cost in decode steps."""
        tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        return tokens / (1 + self.draft_cost * k + self.refeed_cost * (1 - a**k))

    def next_length(self) -> int:
        """Tokens to draft for the next pass (0: speculation is off for now)."""
        return 0 if self.off_for > 0 else self.k

    def observe(self, accepted: int, proposed: int) -> None:
        """One pass's outcome (``proposed`` 0: a plain decode step, which counts down a cool-down)."""
        if proposed == 0:
            if self.off_for > 0:
                self.off_for -= 1
            else:  # asked for drafts, the drafter had none (no lookup match)
                self.empty += 1
                if self.empty >= EMPTY_OFF and self.off_below > 0:
                    self._off()
            return
        self.empty = 0
        self.recent.append((accepted, proposed))
        full = accepted == proposed
        self.k = min(2 * self.k, self.max_k) if full else max(self.min_k, min(accepted + 1, self.max_k))
        if self.off_below <= 0:
            return
        if self.rate < self.off_below or self.gain(self.k, self.acceptance) < 1:
            self._off()
            return
        self.paying += 1
        if self.paying > self.recent.maxlen:  # a run that paid: the next cool-down starts from the base again
            self.backing_off, self.cooldown = False, self.base_cooldown

    def _off(self) -> None:
        """Switch speculation off for a cool-down (twice the last one when the run since the last probe did not
        pay); the next drafting pass is a probe at ``min_k``."""
        if self.backing_off:
            self.cooldown = min(2 * self.cooldown, self.max_cooldown)
        self.off_for, self.backing_off = self.cooldown, True
        self.k, self.paying, self.empty = self.min_k, 0, 0
        self.recent.clear()
