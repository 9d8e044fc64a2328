"""ChatSession with images on the K3 vision fixture: ``send(text, images=)`` renders mlx-vlm's prompt and its first
reply token is mlx-vlm's argmax; later turns reuse the cache (the earlier images are not encoded again) and leave it
as a fresh prefill of the whole conversation with every image in place would; an image that differs only in pixels
is never served from the cache; save/load restores the same pixels, digests and tokens; text-only models refuse.

The reference for a session's cache is one forward pass of its tokens with the images' features on their
placeholders (``ImageRows.embed``), read through the logits of a probe token after it (float32: prefill chunks and
decode steps vs one pass differ by ~1e-5)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import SHARED

from kimi_mlx import load
from kimi_mlx.chat.format import render_chat
from kimi_mlx.chat.images import prepare_images
from kimi_mlx.chat.session import ChatSession
from kimi_mlx.generate import stream_generate
from kimi_mlx.image_prompt import ImageRows
from kimi_mlx.prompt_cache import PromptCacheError

ROOT = SHARED / "fixtures" / "k3_vision"
IMAGES = ROOT / "images"
IMG0, IMG2 = IMAGES / "img0_rgb_224x168.png", IMAGES / "img2_palette_150x90.png"
PROMPTS = json.loads((ROOT / "manifest.json").read_text())["mlx_vlm"]["prompts"]
N = 6
PROBE = 7  # an ordinary token fed after the session's tokens
ATOL = 1e-4


@pytest.fixture(scope="module")
def k3vl():
    return load(ROOT / "k3-vl-tiny", dtype=mx.float32)


def _probe_logits_fresh(session: ChatSession) -> np.ndarray:
    """Logits after ``session.tokens`` + PROBE in one pass, the conversation's images placed."""
    model, enc = session.model, session.image_encoder
    _, images = prepare_images(session.conversation(), enc)
    tokens = session.tokens + [PROBE]
    x = mx.array(tokens)[None]
    h = ImageRows(tokens, images, enc.placeholder_id).embed(model.embed, x, 0, enc.features)
    return np.array(model(x, input_embeddings=h)[0, -1])


def _probe_logits(session: ChatSession) -> np.ndarray:
    """Logits of PROBE fed to the session's cache (the cache is changed: call last)."""
    return np.array(session.model(mx.array([[PROBE]]), cache=session.cache)[0, -1])


def _assert_cache_holds_the_conversation(session: ChatSession) -> None:
    want = _probe_logits_fresh(session)
    assert np.abs(_probe_logits(session) - want).max() < ATOL


def test_first_turn_is_mlx_vlms_prompt(k3vl):
    model, tok = k3vl
    s = ChatSession(model, tok, max_tokens=N)
    list(s.send("Describe this image.", images=[IMG0]))
    ref = PROMPTS["img0_rgb_224x168"]
    assert s.tokens[: ref["n_tokens"]] == ref["input_ids"]
    assert s.last.tokens[0] == ref["argmax_last"]
    greedy = [r.token for r in stream_generate(model, tok, ref["input_ids"], N, images=[IMG0],
                                               stop_tokens=s.stop_tokens)]
    assert s.last.tokens == greedy
    _assert_cache_holds_the_conversation(s)


def _forced(script: list[int]):
    """A logits processor making the model emit ``script`` (mlx-lm passes the tokens fed since the prompt's last)."""

    def force(tokens, logits):
        i = min(len(tokens) - 1, len(script) - 1)
        return mx.where(mx.arange(logits.shape[-1]) == script[i], 0.0, -1e9)[None].astype(logits.dtype)

    return force


def _send_well_formed(s: ChatSession, text: str, images: list) -> None:
    """A turn whose reply is forced to the tokens the renderer writes for ANSWER (the random model's own replies do
    not render back as generated), so the next turn can reuse the whole cache."""
    user = {"role": "user", "content": [*({"type": "image", "image": im} for im in images), {"type": "text",
                                                                                              "text": text}]}
    conv, _ = prepare_images([*s.conversation(), user], s.image_encoder)
    opts = dict(thinking=s.thinking, thinking_effort=s.thinking_effort)
    prompt = render_chat(s.tokenizer, conv, **opts)
    script = render_chat(s.tokenizer, [*conv, ANSWER], add_generation_prompt=False, **opts)[len(prompt):]
    s.sampling = {"logits_processors": [_forced(script)]}
    list(s.send(text, len(script) + 2, images=images))
    s.sampling = {}
    assert s.last.tokens == script and s.messages[-1] == ANSWER


ANSWER = {"role": "assistant", "reasoning_content": "Colours.", "content": "A palette."}


def test_second_turn_reuses_the_cache_and_places_the_new_image(k3vl):
    model, tok = k3vl
    enc = model.image_encoder
    s = ChatSession(model, tok, max_tokens=N, thinking_effort="low")
    _send_well_formed(s, "Describe this image.", [IMG2])
    first_len = len(s.tokens)
    encoded = enc.encoded
    list(s.send("And this one, compared?", images=[_rgb(IMG0)]))
    assert s.last.stats.reused_tokens == first_len
    assert enc.encoded <= encoded + 1  # at most the new image; the first one's features are in the cache
    prompt = s.tokens[: s.last.stats.prompt_tokens]
    _, images = prepare_images(s.conversation(), enc)
    greedy = [r.token for r in stream_generate(model, tok, prompt, N, images=images, stop_tokens=s.stop_tokens)]
    assert s.last.tokens == greedy
    assert sum(1 for t in s.tokens if t == enc.placeholder_id) == 24 + 48
    _assert_cache_holds_the_conversation(s)


def _rgb(path):
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def test_same_size_other_pixels_is_not_served_from_the_cache(k3vl):
    """Undo a turn with image A, send the same text with image B of A's size: the token ids are the same, the cache
    key is not, so the session rolls back before the image instead of reusing A's state."""
    model, tok = k3vl
    a = _rgb(IMG0)
    b = a[::-1].copy()  # same size, other pixels
    s = ChatSession(model, tok, max_tokens=N)
    list(s.send("What is this?", images=[a]))
    first_prompt_len = s.last.stats.prompt_tokens
    s.undo()
    list(s.send("What is this?", images=[b]))
    assert s.last.stats.prompt_tokens == first_prompt_len
    first_placeholder = s.tokens.index(model.image_encoder.placeholder_id)
    assert s.last.stats.reused_tokens <= first_placeholder
    _assert_cache_holds_the_conversation(s)


def test_save_and_load_restore_the_images(k3vl, tmp_path):
    model, tok = k3vl
    s = ChatSession(model, tok, max_tokens=N)
    _send_well_formed(s, "Describe this image.", [IMG2])
    _send_well_formed(s, "And now?", [_rgb(IMG0)])
    s.save(tmp_path / "chat.safetensors")
    t = ChatSession(model, tok, max_tokens=N)
    t.load(tmp_path / "chat.safetensors")
    assert t.render() == s.render() and t.tokens == s.tokens and t.keys == s.keys
    digests = [p["image"].digest for m in t.messages if isinstance(m["content"], list) for p in m["content"]
               if p.get("type") == "image"]
    assert digests == [p["image"].digest for m in s.messages if isinstance(m["content"], list)
                       for p in m["content"] if p.get("type") == "image"]
    assert all(p["image"].pixels is not None for m in t.messages if isinstance(m["content"], list)
               for p in m["content"] if p.get("type") == "image")
    # the next turn: the loaded session replies as the original one, reusing the loaded cache
    list(s.send("Thanks.")), list(t.send("Thanks."))
    assert t.last.tokens == s.last.tokens and t.last.stats.reused_tokens == s.last.stats.reused_tokens
    # a full re-prefill from the restored pixels (the load keeps one checkpoint; undo twice goes before it)
    t.undo(), t.undo()
    list(t.send("And now?", images=[_rgb(IMG0)]))
    assert t.last.stats.reused_tokens < t.tokens.index(model.image_encoder.placeholder_id)
    _assert_cache_holds_the_conversation(t)


def test_saved_images_are_checked_on_load(k3vl, tmp_path):
    model, tok = k3vl
    s = ChatSession(model, tok, max_tokens=2)
    list(s.send("Hi", images=[IMG2]))
    s.save(tmp_path / "a.safetensors")
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(tmp_path / "a.safetensors"), "np") as f:
        arrays, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    state = json.loads(meta["user.chat_session"])
    state["messages"][0]["content"][0]["image"]["data"] = "bm90IGFuIGltYWdl"  # "not an image"
    save_file(arrays, str(tmp_path / "b.safetensors"), {**meta, "user.chat_session": json.dumps(state)})
    with pytest.raises(PromptCacheError, match="b.safetensors: message 0, content part 0: image bytes"):
        ChatSession(model, tok).load(tmp_path / "b.safetensors")
    p = ChatSession(model, tok, max_tokens=2)
    prepared = model.image_encoder.prepare(IMG0)
    p.image_files.clear()
    list(p.send("Hi", images=[prepared]))
    with pytest.raises(ValueError, match="message 0, content part 0: an image given as a PromptImage"):
        p.save(tmp_path / "c.safetensors")


def test_text_only_models_refuse_images(kl_dir, k3_dir):
    for path, reason in ((kl_dir / "hf", "Kimi Linear is a text-only model"), (k3_dir / "hf", "has no vision tower")):
        model, tok = load(path, dtype=mx.float32)
        s = ChatSession(model, tok, max_tokens=2)
        with pytest.raises(ValueError, match=f"image 0: .*{reason}"):
            s.send("Hi", images=[IMG0])
        assert s.messages == []


def test_bad_images_are_named(k3vl, tmp_path):
    model, tok = k3vl
    s = ChatSession(model, tok, max_tokens=2)
    with pytest.raises(ValueError, match="image 1: image file .*nope.png.* does not exist"):
        s.send("Hi", images=[IMG0, tmp_path / "nope.png"])
    with pytest.raises(ValueError, match="image 0: several frames"):
        s.send("Hi", images=[np.zeros((3, 28, 28, 3), np.uint8)])
    assert s.messages == [] and s.tokens == []
