"""Images in chat messages: the image content part, preparing a conversation's images once, and K3's media sequence.

An image goes in a message's ``content`` list as ``{"type": "image", "image": X}``, X a path, encoded bytes, a PIL
image, a uint8 array ``[H, W, 3|4]`` or a :class:`~kimi_mlx.image_prompt.PromptImage` already prepared. Those are
the only image parts: OpenAI's ``image_url`` and Anthropic's ``image`` blocks are the server's to convert, and video
(``video`` / ``video_url`` parts, a list or a ``[T, H, W, C]`` array of frames) is refused.

:func:`prepare_images` ``(messages, encoder) -> (messages, images)`` runs every raw image through the model's
``ImageEncoder`` (``model.image_encoder``) once: the returned messages hold ``PromptImage`` parts (the given ones are
left untouched), ``images`` lists them in prompt order, which is what ``stream_generate(images=)`` and
``ImageRows`` take. The chat format then renders each image part with :func:`media_segments`, as Moonshot's K3
processor expands its image placeholder::

    <|media_begin|>image {W}x{H}<|media_content|>  n x <|media_pad|>  <|media_end|>

W x H the ORIGINAL image size, n = ``PromptImage.num_tokens``; only the four markers are special tokens.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
from PIL import Image

from ..image_prompt import PromptImage

MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"

IMAGE_PART_HELP = "{'type': 'image', 'image': X} with X a path, bytes, a PIL image, a uint8 array or a PromptImage"
_VIDEO_TYPES = ("video", "video_url", "input_video")
_CONVERTED_TYPES = ("image_url", "input_image")  # client formats the server converts into image parts


def image_in_part(part: Mapping[str, Any], where: str) -> Optional[Any]:
    """The image of content part ``part`` (``where``: "message i, content part j" for errors), or None for a part
    that is not an image. ``ValueError`` for an image part without an image, a client-format or video part."""
    kind = part.get("type")
    if kind in _VIDEO_TYPES:
        raise ValueError(f"{where}: video parts are not supported (Kimi-K3 here takes still images only)")
    if kind in _CONVERTED_TYPES or (kind is None and "image_url" in part):
        raise ValueError(f"{where}: {kind or 'image_url'!r} parts are a client format (the server converts them); "
                         f"give {IMAGE_PART_HELP}")
    if kind != "image" and not (kind is None and "image" in part):
        return None
    if part.get("image") is None:
        raise ValueError(f"{where}: an image part without its image; expected {IMAGE_PART_HELP}")
    return part["image"]


def _where(i: int, j: int) -> str:
    return f"message {i}, content part {j}"


def prepare_images(messages: Sequence[Mapping[str, Any]], encoder) -> tuple[list, list[PromptImage]]:
    """``(messages, images)``: a copy of ``messages`` whose image parts hold ``PromptImage``s (``encoder.prepare``
    of each raw image; a ``PromptImage`` is kept), and those images in prompt order. ``messages`` itself is not
    changed; a message without image parts is the same object in the copy. ``encoder``: the model's
    ``ImageEncoder``, or None for a model without a vision tower (then only text is accepted). ``ValueError``
    naming the message and part for an unreadable image, an image for a model without a tower, or a bad part."""
    out, images = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, (list, tuple)):
            out.append(msg)
            continue
        parts, changed = [], False
        for j, part in enumerate(content):
            image = image_in_part(part, _where(i, j)) if isinstance(part, Mapping) else None
            if image is None:
                parts.append(part)
                continue
            prepared = prepare_image(image, encoder, _where(i, j))
            images.append(prepared)
            parts.append({"type": "image", "image": prepared})
            changed = True
        out.append({**msg, "content": parts} if changed else msg)
    return out, images


def prepare_image(image: Any, encoder, where: str) -> PromptImage:
    """One image (path, bytes, PIL image, uint8 array ``[H, W, 3|4]``) -> ``encoder.prepare(image)``; a
    ``PromptImage`` is returned as is. ``ValueError`` starting with ``where`` for an unreadable image, several frames
    (a list, a ``[T, H, W, C]`` array, an animated image) or a model without a tower (``encoder`` None)."""
    if isinstance(image, PromptImage):
        return image
    if isinstance(image, (list, tuple)) or getattr(image, "ndim", 3) == 4:  # an animated file: load_image says so
        raise ValueError(f"{where}: several frames (video) are not supported; give one still image")
    if encoder is None:
        raise ValueError(f"{where}: an image, and this model has no vision tower (it takes text only)")
    try:
        return encoder.prepare(image)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def media_segments(image: PromptImage) -> list[tuple[bool, str]]:
    """K3's media sequence of one prepared image as chat-format segments ``(is_special, text)``."""
    width, height = image.size
    return [(True, MEDIA_BEGIN), (False, f"image {width}x{height}"), (True, MEDIA_CONTENT),
            *[(True, MEDIA_PAD)] * image.num_tokens, (True, MEDIA_END)]


def prompt_image(part: Any, where: str) -> Optional[PromptImage]:
    """The ``PromptImage`` of a content part about to be rendered, None for a text part. ``ValueError`` when the
    part holds an image not prepared yet (render with ``image_encoder=``, or :func:`prepare_images` first)."""
    image = image_in_part(part, where) if isinstance(part, Mapping) else None
    if image is None or isinstance(image, PromptImage):
        return image
    raise ValueError(f"{where}: an image not prepared for the prompt; pass image_encoder= (the model's "
                     "model.image_encoder) or prepare the messages with prepare_images(messages, encoder)")


def image_file(image: Any) -> Optional[bytes]:
    """The bytes of an image file that decodes to exactly ``image``'s pixels, to store it (a saved chat): a path's
    file, encoded bytes as given, a PIL image or a uint8 array written losslessly (PNG, or TIFF for the modes PNG
    cannot hold); None for a ``PromptImage`` (its original is not at hand)."""
    if isinstance(image, PromptImage):
        return None
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, (str, Path)):
        return Path(image).read_bytes()
    pil = image if isinstance(image, Image.Image) else Image.fromarray(np.ascontiguousarray(image))
    buf = io.BytesIO()
    try:
        pil.save(buf, format="PNG")
    except (OSError, ValueError, KeyError):
        buf = io.BytesIO()
        pil.save(buf, format="TIFF")
    return buf.getvalue()
