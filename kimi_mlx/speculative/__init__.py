"""Speculative decoding on the hybrid cache (issue 24): see the package's modules.
"""

from .accept import TargetSampling, accept_greedy, accept_sampled
from .adaptive import DraftLength
from .drafts import Drafter, PromptLookup, make_drafter
from .loop import Speculation, check_speculative_sampling, speculative_steps
from .verify import rollback, verify_pass

__all__ = [
    "Drafter", "DraftLength", "PromptLookup", "Speculation", "TargetSampling", "accept_greedy", "accept_sampled",
    "check_speculative_sampling", "make_drafter", "rollback", "speculative_steps", "verify_pass",
]
