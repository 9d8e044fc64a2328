"""Images on a distributed model: the vision tower runs where its weights are (rank 0), its features reach the ranks
that embed.

    model.image_encoder = GroupImageEncoder(group, model.image_encoder, everywhere)   # in load(), on every rank

Every rank's loader builds an ``ImageEncoder`` from the same checkpoint or mmproj (its config, preprocessing and
placeholder id); only rank 0's reads the tower's weights. ``GroupImageEncoder`` wraps it for the group.
``prepare`` preprocesses on every rank (the digest and the placeholder count need the pixels, not the tower).
``features(image)`` must be called on every rank in the same order (as ``ImageRows.embed`` does in the lockstep
forwards): rank 0 takes its encoder's features (its tower, or its cache by digest), and with ``everywhere`` (tensor
parallel: every rank embeds) they reach every rank as one ``all_sum`` to which the other ranks add zeros (exact),
evaluated at once, so one evaluation never mixes it with a forward's collectives. Without ``everywhere`` (pipeline:
only rank 0 embeds; ``PipelineStage.embed`` gives zeros elsewhere and ``enter`` reads only the shape of the
embeddings) the other ranks get zeros of the right shape and nothing is sent. The last image's broadcast features
are kept on every rank alike, so the prefill chunks that cut one image share one broadcast. Ranks > 0 never read
pixels: an image given to them as a ``PromptImage`` without pixels (``PromptImage.from_json``: what a request passed
between ranks carries) is enough there.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..image_prompt import PromptImage
from ..vision.encoder import ImageEncoder
from ..vision.preprocess import ImageLike
from . import comm


class GroupImageEncoder:
    """The ``ImageEncoder`` of rank ``group.rank()`` of a distributed model, shared across the group. local: this
    rank's encoder (the tower's weights on rank 0 only); everywhere: every rank needs the features (tensor
    parallel), else only rank 0."""

    def __init__(self, group: mx.distributed.Group, local: ImageEncoder, everywhere: bool):
        if (local.vision is not None) != (group.rank() == 0):
            raise ValueError(f"rank {group.rank()}: the vision tower belongs on rank 0 only")
        self.group, self.local, self.everywhere = group, local, everywhere
        self.preprocess, self.placeholder_id, self.hidden_size = local.preprocess, local.placeholder_id, local.hidden_size
        self.dtype, self.source = local.dtype, local.source
        self._last: Optional[tuple[str, mx.array]] = None  # (digest, features) of the last image broadcast

    @property
    def encoded(self) -> int:
        """Tower runs on this rank (rank 0's; 0 elsewhere)."""
        return self.local.encoded

    @property
    def nbytes(self) -> int:
        """Bytes of the tower's and projector's weights on this rank (all on rank 0)."""
        return self.local.nbytes

    def prepare(self, image: ImageLike | PromptImage) -> PromptImage:
        """One image -> ``PromptImage`` (digest, placeholder count, pixels), the same on every rank."""
        return self.local.prepare(image)

    def features(self, image: PromptImage) -> mx.array:
        """The image's features [num_tokens, hidden] (evaluated): rank 0's tower output on rank 0, and on the other
        ranks with ``everywhere`` (zeros there without it). Every rank must call this, in the same order."""
        if self._last is not None and self._last[0] == image.digest:
            return self._last[1]
        if self.group.rank() == 0:
            mine = self.local.features(image)  # [n, hidden]: the tower's, or rank 0's cache by digest
        else:
            mine = mx.zeros((image.num_tokens, self.hidden_size), self.dtype)
        if not self.everywhere:
            return mine
        shared = comm.all_sum(mine, self.group)
        mx.eval(shared)
        self._last = (image.digest, shared)
        return shared
