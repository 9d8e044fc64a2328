"""Images on a distributed model: the vision tower runs where its weights are (rank 0), its features reach the ranks
that embed.

    attach_image_encoder(model, attach, group, everywhere)   # in load(): rank 0 reads the tower, all get an encoder

Rank 0 alone runs ``attach()`` (the loader's step that reads the checkpoint's tower into ``model.image_encoder``),
as a step every rank passes or fails together (``health.agree``); then it sends the other ranks what they need to
take images without a tower, as JSON (``broadcast_text``): the preprocessing config, the placeholder id, the text
width, the compute dtype, where the tower was read from (or why images are refused). Every rank then holds a
``GroupImageEncoder`` as ``model.image_encoder``.

``GroupImageEncoder.prepare`` preprocesses on every rank (the digest and the placeholder count need the pixels, not
the tower). ``features(image)`` must be called on every rank in the same order (as ``ImageRows.embed`` does in the
lockstep forwards): rank 0 takes its encoder's features (its tower, or its cache by digest), and with ``everywhere``
(tensor parallel: every rank embeds) they reach every rank as one ``all_sum`` to which the other ranks add zeros
(exact), evaluated at once, so one evaluation never mixes it with a forward's collectives. Without ``everywhere``
(pipeline: only rank 0 embeds; ``PipelineStage.embed`` gives zeros elsewhere and ``enter`` reads only the shape of
the embeddings) the other ranks get zeros of the right shape and nothing is sent. The last image's broadcast
features are kept on every rank alike, so the prefill chunks that cut one image share one broadcast. Ranks > 0 never
read pixels: an image given to them as a ``PromptImage`` without pixels (``PromptImage.from_json``: what a request
passed between ranks would carry) is enough there.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..image_prompt import PromptImage
from ..vision.encoder import ImageEncoder, prepare_image
from ..vision.preprocess import ImageLike, TransparentBg, VisionPreprocessConfig
from . import comm
from .health import agree


class GroupImageEncoder:
    """An ``ImageEncoder`` for rank ``group.rank()`` of a distributed model. local: rank 0's encoder (None on the
    other ranks); preprocess, placeholder_id, hidden_size (the text width), dtype (the features' dtype), source: as
    rank 0's encoder has them; everywhere: every rank needs the features (tensor parallel), else only rank 0."""

    def __init__(self, group: mx.distributed.Group, local: Optional[ImageEncoder], preprocess: VisionPreprocessConfig,
                 placeholder_id: int, hidden_size: int, dtype: mx.Dtype, source: str, everywhere: bool):
        if (local is not None) != (group.rank() == 0):
            raise ValueError(f"rank {group.rank()}: the vision tower belongs on rank 0 only")
        self.group, self.local, self.preprocess, self.placeholder_id = group, local, preprocess, placeholder_id
        self.hidden_size, self.dtype, self.source, self.everywhere = hidden_size, dtype, source, everywhere
        self._last: Optional[tuple[str, mx.array]] = None  # (digest, features) of the last image broadcast

    @property
    def encoded(self) -> int:
        """Tower runs on this rank (rank 0's; 0 elsewhere)."""
        return self.local.encoded if self.local is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the tower's and projector's weights on this rank (all on rank 0)."""
        return self.local.nbytes if self.local is not None else 0

    def prepare(self, image: ImageLike | PromptImage) -> PromptImage:
        """One image -> ``PromptImage`` (digest, placeholder count, pixels), the same on every rank."""
        return prepare_image(image, self.preprocess)

    def features(self, image: PromptImage) -> mx.array:
        """The image's features [num_tokens, hidden] (evaluated): rank 0's tower output on rank 0, and on the other
        ranks with ``everywhere`` (zeros there without it). Every rank must call this, in the same order."""
        if self._last is not None and self._last[0] == image.digest:
            return self._last[1]
        if self.local is not None:
            mine = self.local.features(image)  # [n, hidden]: the tower's, or rank 0's cache by digest
        else:
            mine = mx.zeros((image.num_tokens, self.hidden_size), self.dtype)
        if not self.everywhere:
            return mine
        shared = comm.all_sum(mine, self.group)
        mx.eval(shared)
        self._last = (image.digest, shared)
        return shared


def attach_image_encoder(model: nn.Module, attach: Callable[[], None], group: Optional[mx.distributed.Group],
                         everywhere: bool) -> None:
    """Give ``model`` its ``image_encoder`` on every rank of ``group``: ``attach()`` (sets ``model.image_encoder``, an
    ``ImageEncoder`` or None with ``model.no_images_reason``) runs on rank 0 only, the others learn its result (see
    the module docstring). ``group`` None or of size 1: ``attach()`` alone. Every rank must call this."""
    if group is None or group.size() == 1:
        attach()
        return
    text = None
    with agree(group, "loading the vision tower"):
        if group.rank() == 0:
            attach()
            text = _describe(model)
    described = json.loads(comm.broadcast_text(text, group))
    if described["reason"] is not None:
        model.image_encoder, model.no_images_reason = None, described["reason"]
        return
    local = model.image_encoder if group.rank() == 0 else None
    model.image_encoder = GroupImageEncoder(
        group, local, _preprocess_config(described["preprocess"]), described["placeholder_id"],
        described["hidden_size"], getattr(mx, described["dtype"]), described["source"], everywhere)


def _describe(model: nn.Module) -> str:
    """Rank 0's ``model.image_encoder`` as JSON (what the other ranks need), or why images are refused."""
    enc: Optional[ImageEncoder] = model.image_encoder
    if enc is None:
        return json.dumps({"reason": getattr(model, "no_images_reason", "this model has no vision tower")})
    return json.dumps({"reason": None, "preprocess": dataclasses.asdict(enc.preprocess),
                       "placeholder_id": enc.placeholder_id, "hidden_size": enc.hidden_size,
                       "dtype": str(enc.dtype).rsplit(".", 1)[-1], "source": enc.source})


def _preprocess_config(d: dict) -> VisionPreprocessConfig:
    """``dataclasses.asdict`` of a ``VisionPreprocessConfig`` (through JSON) -> the config."""
    bg = d["transparent_bg"]
    return VisionPreprocessConfig(**{
        **d, "merge_kernel_size": tuple(d["merge_kernel_size"]), "image_mean": tuple(d["image_mean"]),
        "image_std": tuple(d["image_std"]), "transparent_bg": TransparentBg(**bg) if bg is not None else None})
