"""How many tokens to draft next, from the recent acceptance rate, and when to stop drafting.

``DraftLength`` keeps an exponential average of the fraction of drafted tokens accepted. The next draft length
grows by one after a pass that accepted everything and shrinks to about what the average says would be accepted
otherwise (between ``min_k`` and ``max_k``). When the average falls below ``off_below`` (after ``warmup`` passes),
drafting pays less than it costs (a rejected draft costs a re-feed, see ``verify``): speculation is switched off for
``cooldown`` tokens, then tried again; each consecutive switch-off doubles the cool-down (up to ``max_cooldown``).
"""

from __future__ import annotations

__all__ = ["DraftLength"]


class DraftLength:
    """Adaptive draft length with an off switch (see the module docstring)."""

    def __init__(self, max_k: int, min_k: int = 1, decay: float = 0.7, off_below: float = 0.25, warmup: int = 3,
                 cooldown: int = 16, max_cooldown: int = 256):
        if max_k < 1 or not 1 <= min_k <= max_k:
            raise ValueError(f"need 1 <= min_k <= max_k, got min_k={min_k}, max_k={max_k}")
        self.max_k, self.min_k, self.decay, self.off_below = max_k, min_k, decay, off_below
        self.warmup, self.base_cooldown, self.max_cooldown = warmup, cooldown, max_cooldown
        self.k, self.rate, self.passes = max_k, 1.0, 0
        self.off_for, self.cooldown = 0, cooldown

    def next_length(self) -> int:
        """Tokens to draft for the next pass (0: speculation is off for now)."""
        return 0 if self.off_for > 0 else self.k

    def observe(self, accepted: int, proposed: int) -> None:
        """One pass's outcome (``proposed`` 0: a plain decode step, which counts down a cool-down)."""
        if proposed == 0:
            self.off_for = max(self.off_for - 1, 0)
            return
        self.passes += 1
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / proposed
        if accepted == proposed:
            self.k = min(self.k + 1, self.max_k)
        else:
            self.k = max(self.min_k, min(self.max_k, round(self.rate * self.max_k)))
        if self.passes >= self.warmup and self.rate < self.off_below:
            self.off_for, self.passes, self.rate = self.cooldown, 0, 1.0
            self.cooldown = min(2 * self.cooldown, self.max_cooldown)
        elif accepted > 0:
            self.cooldown = self.base_cooldown
