"""Malformed images against a real ``kimi-mlx serve`` on the K3 vision fixture (small limits: 1,000,000 pixels,
3 images per request, 256 KiB per image, no image URLs): each of the corpus gets a 400 naming the message and part
(OpenAI's ``param``, the start of Anthropic's message) with what is wrong, never a 500; the server keeps serving,
its log holds no traceback, and a good image still gets its answer. Decompression bombs (a real 5000x5000 PNG of
72 KiB, headers claiming 10^8 and 4x10^8 pixels) are refused from the header.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx2 as httpx
import numpy as np
import pytest
from conftest import SHARED
from PIL import Image
from serve_helpers import Server

ROOT = SHARED / "fixtures" / "k3_vision"
GOOD = (ROOT / "images" / "img0_rgb_224x168.png").read_bytes()
MAX_PIXELS = 1_000_000


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kw)
    return out.getvalue()


def _noise(w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` (8-bit RGB) and whose pixel data is one empty row."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0")) + _chunk(b"IEND", b"")


def _bomb(side: int) -> bytes:
    """A well-formed ``side`` x ``side`` black PNG (compresses about 1000:1)."""
    raw = zlib.compress(b"\0" * (side * 3 + 1) * side, 9)
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", raw) + _chunk(b"IEND", b"")


def _corrupt(png: bytes) -> bytes:
    """``png`` with bytes inside its first IDAT chunk's data flipped (the chunk's CRC no longer matches)."""
    at = png.index(b"IDAT") + 40
    return png[:at] + bytes(b ^ 0x5A for b in png[at:at + 64]) + png[at + 64:]


def _animated_gif() -> bytes:
    frames = [Image.new("RGB", (32, 32), (80 * i, 0, 0)) for i in range(3)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50)
    return out.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _oai(*parts, role: str = "user", before: list = ()) -> dict:
    """A chat request whose last message (after ``before``) holds ``parts`` (URLs become image_url parts)."""
    content = [p if isinstance(p, dict) else {"type": "image_url", "image_url": {"url": p}} for p in parts]
    return {"model": "k3v", "max_tokens": 2, "messages": [*before, {"role": role, "content": content}]}


def _anth(*blocks, before: list = ()) -> dict:
    content = [{"type": "image", "source": b} if b["type"] in ("base64", "url") else b for b in blocks]
    return {"model": "k3v", "max_tokens": 2, "messages": [*before, {"role": "user", "content": content}]}


def _b64(data: bytes, media: str = "image/png") -> dict:
    return {"type": "base64", "media_type": media, "data": base64.b64encode(data).decode()}


TEXT = {"type": "text", "text": "What is this?"}
TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
# (id, route, body, the part the error names, what the message says)
CORPUS = [
    ("not base64", "/v1/chat/completions", _oai(TEXT, "data:image/png;base64,@@@@"), "messages[0].content[1]",
     "not valid base64"),
    ("base64 marker missing", "/v1/chat/completions", _oai("data:image/png,iVBORw0KGgo="), "messages[0].content[0]",
     "expected a data URL"),
    ("data URL of text", "/v1/chat/completions", _oai("data:text/plain;base64,aGk="), "messages[0].content[0]",
     "expected a data URL"),
    ("empty data", "/v1/chat/completions", _oai("data:image/png;base64,"), "messages[0].content[0]", "empty"),
    ("random bytes", "/v1/chat/completions", _oai(_url(np.random.default_rng(1).bytes(3000))),
     "messages[0].content[0]", "not a readable PNG, JPEG, GIF or WebP image"),
    ("truncated PNG", "/v1/chat/completions", _oai(_url(GOOD[: len(GOOD) // 2])), "messages[0].content[0]",
     "PNG image does not decode: PIL image is not readable (OSError: image file is truncated"),
    ("truncated JPEG", "/v1/chat/completions", _oai(_url(_encode(_noise(64, 48), "JPEG")[:900], "image/jpeg")),
     "messages[0].content[0]", "JPEG image does not decode"),
    ("truncated WebP", "/v1/chat/completions", _oai(_url(_encode(_noise(64, 48), "WEBP")[:600], "image/webp")),
     "messages[0].content[0]", "not a readable PNG, JPEG, GIF or WebP image"),
    ("corrupt PNG data", "/v1/chat/completions", _oai(_url(_corrupt(GOOD))), "messages[0].content[0]",
     "PNG image does not decode"),
    ("BMP", "/v1/chat/completions", _oai(_url(_encode(_noise(8, 8), "BMP"), "image/bmp")), "messages[0].content[0]",
     "not a readable PNG, JPEG, GIF or WebP image"),
    ("SVG", "/v1/chat/completions", _oai(_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml")),
     "messages[0].content[0]", "not a readable PNG, JPEG, GIF or WebP image"),
    ("bomb 5000x5000", "/v1/chat/completions", _oai(_url(_bomb(5000))), "messages[0].content[0]",
     "5000x5000 = 25000000 pixels; this server takes at most 1000000 (--max-image-pixels)"),
    ("header 20000x20000", "/v1/chat/completions", _oai(_url(_png_header(20000, 20000))), "messages[0].content[0]",
     "decompression bomb"),
    ("header 10000x10000 (Pillow's warning)", "/v1/chat/completions", _oai(_url(_png_header(10000, 10000))),
     "messages[0].content[0]", "decompression bomb"),
    ("over max pixels", "/v1/chat/completions",
     _oai(_url(_encode(Image.new("RGB", (1200, 1000)), "JPEG"), "image/jpeg")), "messages[0].content[0]",
     "1200x1000 = 1200000 pixels"),
    ("over max image size", "/v1/chat/completions", _oai(_url(_encode(_noise(320, 320), "PNG"))),
     "messages[0].content[0]", "over 0.25 MiB (--max-image-mb)"),
    ("animated GIF", "/v1/chat/completions", _oai(_url(_animated_gif(), "image/gif")), "messages[0].content[0]",
     "an animated image (3 frames)"),
    ("4 images, 3 allowed", "/v1/chat/completions", _oai(*[_url(GOOD)] * 4), "messages[0].content[3]",
     "the request holds 4 image(s); this server takes at most 3 per request (--max-images-per-request)"),
    ("http URL", "/v1/chat/completions", _oai("http://127.0.0.1:9/cat.png", before=TURNS), "messages[2].content[0]",
     "start it with --allow-image-urls"),
    ("file URL", "/v1/chat/completions", _oai("file:///etc/passwd"), "messages[0].content[0]",
     "must be a data: URL"),
    ("image in a system message", "/v1/chat/completions", _oai(_url(GOOD), role="system"), "messages[0].content[0]",
     "images go in user messages"),
    ("bad detail", "/v1/chat/completions",
     _oai({"type": "image_url", "image_url": {"url": _url(GOOD), "detail": "ultra"}}), "messages[0].content[0]",
     "expected auto, low or high"),
    ("anthropic media_type not the bytes", "/v1/messages", _anth(TEXT, _b64(GOOD, "image/jpeg")),
     "messages[0].content[1]", "media_type is 'image/jpeg' but the data is a PNG image"),
    ("anthropic media_type not allowed", "/v1/messages", _anth(_b64(GOOD, "image/bmp")), "messages[0].content[0]",
     "source.media_type is 'image/bmp'"),
    ("anthropic url source", "/v1/messages", _anth({"type": "url", "url": "https://example.com/cat.png"}),
     "messages[0].content[0]", "--allow-image-urls"),
    ("anthropic truncated, third message", "/v1/messages", _anth(TEXT, _b64(GOOD[:5000]), before=TURNS),
     "messages[2].content[1]", "PNG image does not decode"),
    ("anthropic image in an assistant message", "/v1/messages",
     {"model": "k3v", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": [
                                                        {"type": "image", "source": _b64(GOOD)}]}]},
     "messages[1].content[0]", "a assistant message takes"),
    ("count_tokens corrupt image", "/v1/messages/count_tokens", _anth(_b64(_corrupt(GOOD))),
     "messages[0].content[0]", "PNG image does not decode"),
    ("completion with placeholder ids", "/v1/completions", {"model": "k3v", "prompt": [1, 405, 2]}, "prompt",
     "token id 405 is the image placeholder"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--model", str(ROOT / "k3-vl-tiny"), "--served-model-name", "k3v", "--max-tokens", "2",
             "--max-image-pixels", str(MAX_PIXELS), "--max-images-per-request", "3", "--max-image-mb", "0.25"]
    with Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield s


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 15


@pytest.mark.parametrize("name,route,body,param,message", CORPUS, ids=[c[0] for c in CORPUS])
def test_malformed_image_is_a_400_naming_the_part(server, name, route, body, param, message):
    r = httpx.post(server.base + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if route.startswith("/v1/messages"):
        assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"
    else:
        assert err["param"] == param, err
    assert err["message"].startswith(param + ": ") and message in err["message"], err
    assert httpx.get(server.base + "/health").status_code == 200


def test_still_serving_images_without_a_traceback(server):
    r = httpx.post(server.base + "/v1/chat/completions", json=_oai(TEXT, _url(GOOD)), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["image_tokens"] == 48, r.text
    r = httpx.post(server.base + "/v1/messages", json=_anth(_b64(GOOD)), timeout=60)
    assert r.status_code == 200, r.text
    assert "Traceback" not in server.log(), server.log()
