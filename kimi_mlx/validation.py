"""Checks on what is fed to a model, shared by the models, the generators and the chat session.

- ``check_token_ids``: every id inside ``[0, vocab_size)`` (an id past the embedding gives NaN or garbage silently).
  One reduction evaluated on the host; only when it finds a bad id are the ids copied to name the first one.
- ``check_context``: a prompt (plus what a cache already holds) no longer than the model's ``model_max_length``.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary."""


class ContextLengthError(ValueError):
    """A prompt longer than the model's context length."""


def check_token_ids(ids: mx.array, vocab_size: int, what: str = "token id") -> None:
    """Raise ``TokenIdError`` naming the first id of ``ids`` ([T] or [B, T]) outside ``[0, vocab_size)``, its
    position (and row) and the vocabulary size."""
    if not mx.any((ids < 0) | (ids >= vocab_size)).item():
        return
    host = np.array(ids).reshape(-1, ids.shape[-1] if ids.ndim else 1)
    row, pos = (int(i[0]) for i in np.nonzero((host < 0) | (host >= vocab_size)))
    where = f"position {pos}" if ids.ndim < 2 else f"row {row}, position {pos}"
    raise TokenIdError(f"{what} {int(host[row, pos])} at {where} is outside the vocabulary: ids must be in "
                       f"[0, {vocab_size}) (vocab_size {vocab_size})")


def check_context(prompt_tokens: int, max_length: Optional[int], cached: int = 0) -> None:
    """Raise ``ContextLengthError`` when ``cached`` tokens already in a cache plus a ``prompt_tokens``-token prompt
    exceed ``max_length`` (the model's ``model_max_length``; None: no limit known)."""
    if max_length is None or cached + prompt_tokens <= max_length:
        return
    held = f" after the {cached} tokens already in the cache" if cached else ""
    raise ContextLengthError(f"the prompt is {prompt_tokens} tokens{held}: {cached + prompt_tokens} tokens exceed "
                             f"the model's context length (model_max_length {max_length})")
