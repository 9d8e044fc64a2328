"""How many tokens to draft next, from the recent acceptance rate, and when to stop drafting.

``DraftLength`` starts at ``start`` drafts, doubles the length after a pass that accepted every draft (up to
``max_k``) and after a pass with a rejection drafts one more than were accepted (a drafter that was right for n
tokens is likely right for about n again; a pass costs more the longer it is). Speculation switches itself off when
it does not pay: when the last ``window`` drafting passes accepted less than ``off_below`` of what they drafted, it is
off for ``cooldown`` tokens (plain decode steps), then probed with one pass at length ``min_k``: a probe that accepts
nothing switches it off again for twice the cool-down (up to ``max_cooldown``), one that accepts something turns it
back on. At zero acceptance the probes' cost shrinks towards nothing (bench/bench_speculative.py: the low-acceptance
rows).
"""

from __future__ import annotations

from collections import deque

__all__ = ["DraftLength"]


class DraftLength:
    """Adaptive draft length with an off switch (see the module docstring)."""

    def __init__(self, max_k: int, min_k: int = 1, start: int = 2, window: int = 2, off_below: float = 0.3,
                 cooldown: int = 32, max_cooldown: int = 1024):
        if max_k < 1 or not 1 <= min_k <= max_k or window < 1:
            raise ValueError(f"need 1 <= min_k <= max_k and window >= 1, got min_k={min_k}, max_k={max_k}, "
                             f"window={window}")
        self.max_k, self.min_k, self.off_below = max_k, min_k, off_below
        self.base_cooldown, self.max_cooldown = cooldown, max_cooldown
        self.k = max(min_k, min(start, max_k))
        self.recent: deque = deque(maxlen=window)
        self.off_for, self.cooldown, self.probing = 0, cooldown, False

    @property
    def rate(self) -> float:
        """Accepted / drafted over the recent drafting passes (1 before any)."""
        drafted = sum(p for _, p in self.recent)
        return sum(a for a, _ in self.recent) / drafted if drafted else 1.0

    def next_length(self) -> int:
        """Tokens to draft for the next pass (0: speculation is off for now)."""
        return 0 if self.off_for > 0 else self.k

    def observe(self, accepted: int, proposed: int) -> None:
        """One pass's outcome (``proposed`` 0: a plain decode step, which counts down a cool-down)."""
        if proposed == 0:
            self.off_for = max(self.off_for - 1, 0)
            return
        self.recent.append((accepted, proposed))
        full = accepted == proposed
        self.k = min(2 * self.k, self.max_k) if full else max(self.min_k, min(accepted + 1, self.max_k))
        if self.probing:
            self.probing = False
            if accepted == 0:  # the probe found nothing: off again, for longer
                self._off(min(2 * self.cooldown, self.max_cooldown))
                return
            self.cooldown = self.base_cooldown
        if len(self.recent) == self.recent.maxlen and self.rate < self.off_below:
            self._off(self.cooldown)

    def _off(self, cooldown: int) -> None:
        """Switch speculation off for ``cooldown`` tokens; the next drafting pass is a probe at ``min_k``."""
        self.off_for = self.cooldown = cooldown
        self.k, self.probing = self.min_k, True
        self.recent.clear()
