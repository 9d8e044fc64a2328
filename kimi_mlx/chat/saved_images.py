"""A chat session's images as JSON, for ``ChatSession.save`` / ``load``.

Each image part of the conversation is stored as ``{"type": "image", "image": {"digest", "num_tokens", "size",
"data"}}``, ``data`` the base64 of the original file's bytes (``chat.images.image_file``), so a restored session
decodes and preprocesses the same pixels: its ``PromptImage`` gets the same digest (checked) and the conversation
renders the same tokens. The cache's own image positions are stored as runs ``[start, length, key_id]`` over its
token history (``ImageRows.key`` of the tokens it has seen), so that prefix reuse after a load still tells two
images of the same size apart.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

from ..image_prompt import PromptImage


def dump_messages(messages: Sequence[Mapping[str, Any]], files: Mapping[str, bytes]) -> list:
    """``messages`` as JSON data: each ``PromptImage`` part with its file from ``files`` (digest -> bytes).
    ``ValueError`` naming the message and part for an image whose file is not at hand (given as a PromptImage)."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            if not _is_image(part):
                parts.append(part)
                continue
            image: PromptImage = part["image"]
            if image.digest not in files:
                raise ValueError(f"message {i}, content part {j}: an image given as a PromptImage without its file "
                                 "cannot be saved; send the image as a path, bytes, a PIL image or an array")
            data = base64.b64encode(files[image.digest]).decode("ascii")
            parts.append({"type": "image", "image": {**image.to_json(), "data": data}})
        out.append({**msg, "content": parts})
    return out


def load_messages(messages: Sequence[Any], encoder, source: str) -> tuple[list, dict[str, bytes]]:
    """(messages with ``PromptImage`` parts, digest -> file bytes) of :func:`dump_messages`'s data, each image
    decoded and prepared again by ``encoder``. ``ValueError`` naming ``source``, the message and the part for a
    malformed entry, a model without a vision tower, or pixels that no longer give the saved digest."""
    out, files = [], {}
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list) or not any(isinstance(p, Mapping) and p.get("type") == "image"
                                                    for p in content):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "image"):
                parts.append(part)
                continue
            image, data = _load_image(part.get("image"), encoder, f"{source}: message {i}, content part {j}")
            files[image.digest] = data
            parts.append({"type": "image", "image": image})
        out.append({**msg, "content": parts})
    return out, files


def _load_image(saved: Any, encoder, where: str) -> tuple[PromptImage, bytes]:
    if not isinstance(saved, Mapping) or not isinstance(saved.get("data"), str) or "digest" not in saved:
        raise ValueError(f"{where}: a saved image needs 'digest' and 'data' (base64 of the image file)")
    if encoder is None:
        raise ValueError(f"{where}: the saved chat holds an image, and this model has no vision tower")
    try:
        data = base64.b64decode(saved["data"], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the saved image's data is not valid base64") from None
    try:
        image = encoder.prepare(data)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if image.digest != saved["digest"]:
        raise ValueError(f"{where}: the saved image gives digest {image.digest}, saved as {saved['digest']} (another "
                         "model's image preprocessing?)")
    return image, data


def key_runs(tokens: Sequence[int], keys: Sequence[int]) -> list[list[int]]:
    """``[[start, length, key_id], ...]``: the runs where ``keys`` (the cache key of ``tokens``) differs from it."""
    runs: list[list[int]] = []
    for p, (t, k) in enumerate(zip(tokens, keys)):
        if t == k:
            continue
        if runs and runs[-1][0] + runs[-1][1] == p and runs[-1][2] == k:
            runs[-1][1] += 1
        else:
            runs.append([p, 1, k])
    return runs


def keys_from_runs(tokens: Sequence[int], runs: Any, placeholder_id: int | None, source: str) -> list[int]:
    """The cache key of ``tokens`` from :func:`key_runs`'s data; ``ValueError`` naming ``source`` when a run is
    malformed or covers a token other than the placeholder."""
    keys = list(tokens)
    for run in runs or []:
        ok = isinstance(run, list) and len(run) == 3 and all(isinstance(x, int) for x in run)
        if not ok or run[0] < 0 or run[1] < 1 or run[0] + run[1] > len(keys) or run[2] >= 0:
            raise ValueError(f"{source}: malformed saved image run {run!r} (expected [start, length, negative key])")
        if any(t != placeholder_id for t in tokens[run[0]: run[0] + run[1]]):
            raise ValueError(f"{source}: saved image run {run[:2]} covers tokens that are not image placeholders")
        keys[run[0]: run[0] + run[1]] = [run[2]] * run[1]
    return keys


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and isinstance(part.get("image"), PromptImage)
