"""``kimi-mlx serve`` on the K3 vision fixture (float32, ``--allow-image-urls``) with images, driven by the official
``openai`` and ``anthropic`` clients, whole and streamed.

References: mlx-vlm 0.7.10's logits for the fixture's chat prompt ([image, "Describe this image."], which the server
renders as mlx-vlm does); greedy ``stream_generate`` in this process on ``render_chat``'s prompt with the same
image; the server's own first (uncached) answer. The prefix cache keys images by content: two different images with
the same text never share an entry past the text before them, the same image re-sent (inline or by URL) is served
from the cache with the cold log-probabilities and without running the tower again. Image URLs are fetched from a
local HTTP server: within the byte and time limits, redirects only to http(s).
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import anthropic
import httpx2 as httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from conftest import SHARED
from PIL import Image
from serve_helpers import Server

from kimi_mlx.chat.format import render_chat
from kimi_mlx.chat.parser import parse_reply
from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load

ROOT = SHARED / "fixtures" / "k3_vision"
CKPT = ROOT / "k3-vl-tiny"
IMG0 = ROOT / "images" / "img0_rgb_224x168.png"
N = 8
TEXT = "Describe this image."
TIMEOUT = 2  # --image-url-timeout


def _png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, "PNG")
    return out.getvalue()


def _noise(seed: int, shape=(168, 224, 3)) -> bytes:
    """A PNG of img0's size (the same prompt text and placeholder count) with other pixels."""
    return _png(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8))


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _openai_messages(url: str) -> list:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "high"}},
                                         {"type": "text", "text": TEXT}]}]


def _anthropic_messages(png: bytes) -> list:
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}
    return [{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": TEXT}]}]


REDIRECTS = {"/to-img0": "/img0.png", "/to-file": "file:///etc/passwd", "/to-ftp": "ftp://127.0.0.1/img0.png"}


class _Images(http.server.BaseHTTPRequestHandler):
    """The test's image host: /img0.png, /big.png (over the byte limit), /slow.png (past the time limit),
    redirects (``REDIRECTS``), anything else 404."""

    def do_GET(self):
        if self.path == "/img0.png":
            self._send(IMG0.read_bytes())
        elif self.path == "/big.png":
            self._send(_noise(0, (700, 700, 3)))
        elif self.path == "/slow.png":
            time.sleep(TIMEOUT + 2)
            self._send(IMG0.read_bytes())
        elif self.path in REDIRECTS:
            self.send_response(302)
            self.send_header("Location", REDIRECTS[self.path])
            self.end_headers()
        else:
            self.send_error(404)

    def _send(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Host(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the server gives up on /slow.png before it answers: a broken pipe here is expected


@pytest.fixture(scope="module")
def host():
    httpd = _Host(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--model", str(CKPT), "--served-model-name", "k3v", "--dtype", "float32", "--max-tokens", str(N),
             "--allow-image-urls", "--image-url-timeout", str(TIMEOUT), "--max-image-mb", "1"]
    with Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield s


@pytest.fixture(scope="module")
def ref():
    return load(CKPT, dtype=mx.float32)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)


def expected(ref, image) -> tuple[list[int], object]:
    """(prompt ids, parsed greedy reply) of [image, TEXT] in this process."""
    model, tok = ref
    prompt = render_chat(tok, [{"role": "user", "content": [{"type": "image", "image": image},
                                                            {"type": "text", "text": TEXT}]}],
                         image_encoder=model.image_encoder)
    text = "".join(r.text for r in stream_generate(model, tok, prompt, N, images=[image]))
    return prompt, parse_reply(text, "kimi_k3", thinking=True)


def _reasoning(message) -> str:
    return (message.model_extra or {}).get("reasoning_content") or ""


def _top(reply) -> list[list[tuple[str, float]]]:
    """Each generated token's top log-probabilities, [(token, logprob)]."""
    return [[(t.token, t.logprob) for t in c.top_logprobs] for c in reply.choices[0].logprobs.content]


def _delta(a: list, b: list) -> float:
    assert [[t for t, _ in s] for s in a] == [[t for t, _ in s] for s in b]
    return max(abs(x - y) for sa, sb in zip(a, b) for (_, x), (_, y) in zip(sa, sb))


def _encoded(server) -> int:
    return httpx.get(server.base + "/health").json()["stats"]["images_encoded"]


def test_first_step_matches_mlx_vlm(oai, ref):
    """The fixture's chat prompt with img0: the first token's top-20 log-probabilities are mlx-vlm's logits."""
    r = oai.chat.completions.create(model="k3v", messages=_openai_messages(_data_url(IMG0.read_bytes())),
                                    max_tokens=1, logprobs=True, top_logprobs=20)
    logits = np.load(ROOT / "mlx_vlm" / "img0_rgb_224x168.chat.last_logits.npy").reshape(-1).astype(np.float64)
    want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    tok = ref[1]
    top = r.choices[0].logprobs.content[0].top_logprobs
    order = np.argsort(-want)[:20]
    assert [bytes(t.bytes) for t in top] == [tok.token_bytes(int(i)) for i in order]
    assert max(abs(t.logprob - want[i]) for t, i in zip(top, order)) < 1e-4
    assert r.usage.prompt_tokens == len(np.load(ROOT / "mlx_vlm" / "img0_rgb_224x168.chat.input_ids.npy").reshape(-1))
    assert r.usage.prompt_tokens_details.image_tokens == 48  # img0's placeholders (mlx-vlm's prompt)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_client_sends_an_image(oai, ref, stream):
    png = _noise(11)
    prompt, want = expected(ref, png)
    kwargs = {"model": "k3v", "messages": _openai_messages(_data_url(png))}
    if not stream:
        r = oai.chat.completions.create(**kwargs)
        assert (_reasoning(r.choices[0].message), r.choices[0].message.content or "") == (want.reasoning, want.content)
        assert r.usage.prompt_tokens == len(prompt)
        return
    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
                        if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == (want.reasoning, want.content)
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(prompt) - 1  # sent whole just before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_client_sends_an_image(anth, ref, stream):
    png = _noise(12)
    prompt, want = expected(ref, png)
    kwargs = {"model": "k3v", "max_tokens": N, "messages": _anthropic_messages(png)}
    if stream:
        with anth.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = anth.messages.create(**kwargs)
    thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
    text = "".join(b.text for b in m.content if b.type == "text")
    assert (thinking, text) == (want.reasoning, want.content)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt)
    assert anth.messages.count_tokens(model="k3v", messages=_anthropic_messages(png)).input_tokens == len(prompt)


def test_different_images_never_share_a_cache_entry(oai, ref, server):
    """The same text with two images of the same size: different log-probabilities; the second takes from the
    cache at most the text before its image."""
    model, tok = ref
    prompt, _ = expected(ref, IMG0)
    first_pad = prompt.index(model.image_encoder.placeholder_id)
    kwargs = {"model": "k3v", "max_tokens": 3, "logprobs": True, "top_logprobs": 5}
    a = oai.chat.completions.create(messages=_openai_messages(_data_url(IMG0.read_bytes())), **kwargs)
    b = oai.chat.completions.create(messages=_openai_messages(_data_url(_noise(22))), **kwargs)
    assert b.usage.prompt_tokens_details.cached_tokens <= first_pad
    assert _top(a)[0] != _top(b)[0]


def test_same_image_resent_is_served_from_cache(oai, server, host):
    """A new image, then the same bytes again, then the same image by URL: the repeats take the whole prompt but its
    last token from the cache, with the first answer's log-probabilities (<= 1e-5), and the tower ran once."""
    png = _noise(31)
    kwargs = {"model": "k3v", "max_tokens": 3, "logprobs": True, "top_logprobs": 5}
    before = _encoded(server)
    cold = oai.chat.completions.create(messages=_openai_messages(_data_url(png)), **kwargs)
    again = oai.chat.completions.create(messages=_openai_messages(_data_url(png)), **kwargs)
    assert _encoded(server) == before + 1
    n = cold.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1
    assert _delta(_top(cold), _top(again)) <= 1e-5
    by_data = oai.chat.completions.create(messages=_openai_messages(_data_url(IMG0.read_bytes())), **kwargs)
    by_url = oai.chat.completions.create(messages=_openai_messages(host + "/to-img0"), **kwargs)
    assert by_url.usage.prompt_tokens_details.cached_tokens == by_url.usage.prompt_tokens - 1
    assert _delta(_top(by_data), _top(by_url)) <= 1e-5


@pytest.mark.parametrize("path,message", [
    ("/big.png", "over 1 MiB"),
    ("/slow.png", f"longer than {TIMEOUT} s"),
    ("/to-file", "file:///etc/passwd' is not allowed"),
    ("/to-ftp", "only http(s) redirects are followed"),
    ("/missing.png", "HTTP 404"),
])
def test_image_urls_within_limits(oai, server, host, path, message):
    tic = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="k3v", messages=_openai_messages(host + path), max_tokens=1)
    assert time.monotonic() - tic < TIMEOUT + 1.5
    err = e.value.body
    assert err["param"] == "messages[0].content[0]" and message in err["message"], err
    assert httpx.get(server.base + "/health").status_code == 200


def test_still_serving_without_a_traceback(oai, server):
    r = oai.chat.completions.create(model="k3v", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.usage.prompt_tokens_details.model_extra.get("image_tokens") is None
    assert "Traceback" not in server.log(), server.log()
