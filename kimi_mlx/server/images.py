"""Images in API requests, read and prepared for the engine: OpenAI ``image_url`` parts and Anthropic ``image``
blocks (``ImageRef``s) -> ``PromptImage``s (decoded, preprocessed, digested by ``model.image_encoder.prepare``).

Where the bytes come from: a ``data:image/...;base64,`` URL (OpenAI), a ``base64`` source (Anthropic, whose
``media_type`` must be what the bytes are), or an ``http(s)`` URL, fetched only when the server allows it
(``ImageLimits.allow_urls``): at most ``max_bytes``, within ``url_timeout_s``, redirects followed only to http(s).

Checks before any pixel is decoded: the format (PNG, JPEG, GIF or WebP, read from the bytes), a still image (one
frame), and width x height from the header against ``max_pixels`` (a decompression bomb is refused here; Pillow's
own bomb check, its error and its warning, is a refusal too). Then the image is decoded and preprocessed. Every
failure is an ``ApiError`` 400 naming the part (``messages[0].content[1]``); nothing here is a 500.

Preparing runs on one worker thread (``prepare_images`` awaits it), never on the event loop or the engine thread:
one image is decoded at a time, so concurrent requests cannot multiply the memory a large image takes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from PIL import Image, UnidentifiedImageError

from ..image_prompt import PromptImage
from .errors import ApiError

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
MEDIA_TYPES = tuple(FORMATS.values())
MAX_REDIRECTS = 5
# what Pillow's parsers raise on bytes that are not a well-formed image (truncated, corrupt, inconsistent)
DECODE_ERRORS = (ValueError, OSError, EOFError, SyntaxError, IndexError, KeyError, struct.error, zlib.error)

_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimi-mlx-images")


@dataclass(frozen=True)
class ImageLimits:
    """What the server takes: ``max_pixels`` per image (width x height), ``max_images`` per request, ``max_bytes``
    per image (encoded), remote URLs (``allow_urls``) fetched within ``url_timeout_s`` seconds."""

    max_pixels: int = 1 << 25
    max_images: int = 16
    max_bytes: int = 20 << 20
    allow_urls: bool = False
    url_timeout_s: float = 10.0


@dataclass(frozen=True)
class ImageRef:
    """One image of a request as the client sent it: ``param`` names its part (``messages[0].content[1]``);
    ``url``: a ``data:`` or ``http(s)`` URL, or ``data``: base64 text with its declared ``media_type``."""

    param: str
    url: Optional[str] = None
    data: Optional[str] = None
    media_type: Optional[str] = None


async def prepare_images(refs: list[ImageRef], encoder: Any, limits: ImageLimits, no_images: str
                         ) -> list[PromptImage]:
    """The request's images, in order, prepared with ``encoder`` (``model.image_encoder``; None: a model without a
    vision tower, whose refusal says ``no_images``). ApiError 400 naming the part at fault."""
    if not refs:
        return []
    if encoder is None:
        raise ApiError(400, f"{refs[0].param}: this model takes no images ({no_images})", refs[0].param)
    if len(refs) > limits.max_images:
        param = refs[limits.max_images].param
        raise ApiError(400, f"{param}: the request holds {len(refs)} image(s); this server takes at most "
                            f"{limits.max_images} per request (--max-images-per-request)", param)
    loop = asyncio.get_running_loop()
    out = []
    for ref in refs:
        fetched = await _fetch(ref, limits) if _scheme(ref.url) in ("http", "https") else None
        out.append(await loop.run_in_executor(_worker, _prepare, ref, fetched, encoder, limits))
    return out


def _scheme(url: Optional[str]) -> str:
    return url.split(":", 1)[0].lower() if url is not None and ":" in url else ""


async def _fetch(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The image at ``ref.url`` (http or https), when the server fetches URLs."""
    if not limits.allow_urls:
        raise ApiError(400, f"{ref.param}: this server does not fetch image URLs (start it with --allow-image-urls); "
                            "send the image inline as a data: URL (data:image/png;base64,...)", ref.param)
    try:
        return await asyncio.wait_for(asyncio.to_thread(fetch, ref.url, limits), limits.url_timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        raise ApiError(400, f"{ref.param}: fetching the image took longer than {limits.url_timeout_s:g} s",
                       ref.param) from None
    except ValueError as e:
        raise ApiError(400, f"{ref.param}: {e}", ref.param) from None


def _inline(ref: ImageRef, limits: ImageLimits) -> tuple[bytes, Optional[str]]:
    """(the encoded image of a base64 source or data: URL, the media type the client declared: binding for an
    Anthropic source, None for a data URL)."""
    if ref.data is not None:
        return _base64(ref.data, ref.param, limits), ref.media_type
    if _scheme(ref.url) != "data":
        raise ApiError(400, f"{ref.param}: the image URL must be a data: URL (data:image/png;base64,...) or, when "
                            f"the server allows it, http(s); got {ref.url[:40]!r}", ref.param)
    return _data_url(ref.url, ref.param, limits), None


def _base64(text: str, param: str, limits: ImageLimits) -> bytes:
    """Base64 text (line breaks and spaces allowed) -> bytes, within ``limits.max_bytes``."""
    text = "".join(text.split())
    if len(text) // 4 * 3 > limits.max_bytes + 2:
        raise ApiError(400, f"{param}: the image is over {_mb(limits.max_bytes)} (--max-image-mb)", param)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"{param}: the image data is not valid base64 ({e})", param) from None
    if not raw:
        raise ApiError(400, f"{param}: the image data is empty", param)
    return raw


def _data_url(url: str, param: str, limits: ImageLimits) -> bytes:
    """``data:image/<type>;base64,<data>`` -> bytes (the declared type is not binding: the bytes say)."""
    head, sep, data = url.partition(",")
    parts = head[5:].split(";")
    if not sep or "base64" not in [p.strip().lower() for p in parts[1:]] or \
            not parts[0].strip().lower().startswith("image/"):
        raise ApiError(400, f"{param}: expected a data URL data:image/<type>;base64,<data>; got "
                            f"{head[:40]!r}", param)
    return _base64(data, param, limits)


class _HttpRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed only to http(s) URLs, at most ``MAX_REDIRECTS``."""

    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise ValueError(f"the image URL redirects to {newurl[:60]!r}: only http(s) redirects are followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch(url: str, limits: ImageLimits) -> bytes:
    """GET ``url`` (http or https): at most ``limits.max_bytes``, within ``limits.url_timeout_s`` (each read; the
    whole is also checked between reads). ValueError saying what went wrong."""
    deadline = time.monotonic() + limits.url_timeout_s
    opener = urllib.request.build_opener(_HttpRedirects)
    request = urllib.request.Request(url, headers={"User-Agent": "kimi-mlx", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=limits.url_timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.max_bytes:
                raise ValueError(f"the image at the URL is {int(length)} bytes, over {_mb(limits.max_bytes)} "
                                 "(--max-image-mb)")
            chunks, size = [], 0
            while chunk := resp.read1(1 << 16):
                size += len(chunk)
                if size > limits.max_bytes:
                    raise ValueError(f"the image at the URL is over {_mb(limits.max_bytes)} (--max-image-mb)")
                if time.monotonic() > deadline:
                    raise ValueError(f"fetching the image took longer than {limits.url_timeout_s:g} s")
                chunks.append(chunk)
    except urllib.error.HTTPError as e:
        raise ValueError(f"fetching the image URL failed: HTTP {e.code} {e.reason}") from None
    except (TimeoutError, urllib.error.URLError) as e:
        if isinstance(e, TimeoutError) or isinstance(e.reason, TimeoutError):
            raise ValueError(f"fetching the image took longer than {limits.url_timeout_s:g} s") from None
        raise ValueError(f"fetching the image URL failed: {e.reason}") from None
    except OSError as e:  # connection reset while reading, ...
        raise ValueError(f"fetching the image URL failed: {type(e).__name__}: {e}") from None
    if not chunks:
        raise ValueError("the image URL returned no data")
    return b"".join(chunks)


def _prepare(ref: ImageRef, fetched: Optional[bytes], encoder: Any, limits: ImageLimits) -> PromptImage:
    """The image (``fetched``, else inline in ``ref``): header checks (format, the declared media type when binding,
    pixels, frames), then decoded and preprocessed. Runs on the image worker."""
    raw, declared = (fetched, None) if fetched is not None else _inline(ref, limits)
    param = ref.param
    if len(raw) > limits.max_bytes:
        raise ApiError(400, f"{param}: the image is over {_mb(limits.max_bytes)} (--max-image-mb)", param)
    image = _open(raw, param)
    media_type = FORMATS[image.format]
    if declared is not None and declared != media_type:
        raise ApiError(400, f"{param}: media_type is {declared!r} but the data is a {image.format} image "
                            f"({media_type})", param)
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ApiError(400, f"{param}: the image is {width}x{height} = {width * height} pixels; this server takes "
                            f"at most {limits.max_pixels} (--max-image-pixels)", param)
    try:
        frames = getattr(image, "n_frames", 1)  # GIF and WebP read their frame headers
        if frames > 1:
            raise ApiError(400, f"{param}: an animated image ({frames} frames); send a still image", param)
        return encoder.prepare(image)
    except DECODE_ERRORS as e:
        why = str(e)[:200] if isinstance(e, ValueError) else f"{type(e).__name__}: {str(e)[:200]}"
        raise ApiError(400, f"{param}: the {image.format} image does not decode: {why}", param) from None


def _open(raw: bytes, param: str) -> Image.Image:
    """The image's header read (no pixels decoded yet); Pillow's decompression-bomb warning is an error here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(raw), formats=list(FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ApiError(400, f"{param}: refused as a decompression bomb ({e})", param) from None
    except (UnidentifiedImageError, *DECODE_ERRORS) as e:
        raise ApiError(400, f"{param}: not a readable PNG, JPEG, GIF or WebP image ({type(e).__name__}: "
                            f"{str(e)[:200]})", param) from None


def _mb(n: int) -> str:
    return f"{n / 2**20:g} MiB"
