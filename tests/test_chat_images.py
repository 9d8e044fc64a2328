"""Images in the chat format (kimi_mlx.chat.images, render_chat's image parts) against two independent references:
mlx-vlm 0.7.10's chat prompts for the K3 vision fixture (``mlx_vlm/*.chat.input_ids.npy``: one user message
[image(s), text], thinking on, effort max, generation prompt), and Moonshot's K3 encoder (``encoding_k3.py`` as
mlx-vlm ports it) with its image placeholder expanded to the media sequence mlx-vlm's processor wrote for each fixture
image (``manifest.json``), byte for byte and id for id over several conversations. Also: ``prepare_images`` leaves
the given messages alone and names the message and part of every bad image; Kimi Linear refuses image parts."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from chat_references import k3_reference
from conftest import SHARED
from PIL import Image

from kimi_mlx import load
from kimi_mlx.chat.format import render_chat, render_chat_text
from kimi_mlx.chat.images import prepare_images
from kimi_mlx.image_prompt import PromptImage

ROOT = SHARED / "fixtures" / "k3_vision"
REF = ROOT / "mlx_vlm"
IMAGES = ROOT / "images"
NAMES = ["img0_rgb_224x168", "img1_rgba_100x300", "img2_palette_150x90", "img3_large_500x380"]
MLX_VLM = json.loads((ROOT / "manifest.json").read_text())["mlx_vlm"]


@pytest.fixture(scope="module")
def k3vl():
    return load(ROOT / "k3-vl-tiny", dtype=mx.float32)


def _img(name: str) -> dict:
    return {"type": "image", "image": IMAGES / f"{name}.png"}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _reference(messages: list, names: list[str], **options) -> tuple[str, list]:
    """Moonshot's encoder on ``messages`` (image parts as its bare ``{"type": "image"}``), its placeholder expanded
    to mlx-vlm's media sequence of each image ``names[i]``: (text, segments)."""
    bare = [{**m, "content": [p if p.get("type") != "image" else {"type": "image"} for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]
    prompts = [MLX_VLM["images"][n]["image_prompt"] for n in names]
    segments = k3_reference(bare, image_prompts=prompts, **options)
    return "".join(s.text for s in segments), segments


def _reference_ids(segments, tok) -> list[int]:
    """Ids as mlx-vlm's processor encodes the segments: specials parsed in the segments that may hold them."""
    ids = []
    for s in segments:
        ids += tok.encode(s.text, allowed_special="all") if s.allow_special else tok.encode(s.text)
    return ids


@pytest.mark.parametrize("prompt", [*NAMES, "two_images"])
def test_fixture_prompts_equal_mlx_vlm_input_ids(k3vl, prompt):
    model, tok = k3vl
    messages = MLX_VLM["chat"]["messages_two_images" if prompt == "two_images" else "messages_single"]
    names = ["img0_rgb_224x168", "img2_palette_150x90"] if prompt == "two_images" else [prompt]
    images = iter(names)
    filled = [{**m, "content": [_img(next(images)) if p["type"] == "image" else p for p in m["content"]]}
              for m in messages]
    ids = render_chat(tok, filled, image_encoder=model.image_encoder)
    assert ids == np.load(REF / f"{prompt}.chat.input_ids.npy").reshape(-1).tolist()
    prepared, prompt_images = prepare_images(filled, model.image_encoder)
    assert render_chat(tok, prepared) == ids  # PromptImage parts need no encoder
    assert tok.apply_chat_template(filled, add_generation_prompt=True, image_encoder=model.image_encoder) == ids
    assert [(im.size, im.num_tokens) for im in prompt_images] == [
        (tuple(MLX_VLM["images"][n]["size_wh"]), MLX_VLM["images"][n]["n_image_tokens"]) for n in names]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATIONS = {
    "image after text": ([{"role": "user", "content": [_text("What is this?"), _img(NAMES[3])]}], [NAMES[3]], {}),
    "text between two images": (
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [_img(NAMES[1]), _text("and"), _img(NAMES[2]), _text("compare")]}],
        [NAMES[1], NAMES[2]], {"thinking_effort": "low"}),
    "images in earlier turns, thinking off": (
        [{"role": "user", "content": [_img(NAMES[0]), _text("Describe it.")]},
         {"role": "assistant", "content": "A gradient."},
         {"role": "user", "content": [_text("And this one?"), _img(NAMES[2])]},
         {"role": "assistant", "content": "A palette."},
         {"role": "user", "content": "Thanks."}],
        [NAMES[0], NAMES[2]], {"thinking": False}),
    "with tools and an image in a tool result": (
        [{"role": "user", "content": [_img(NAMES[1]), _text("Where is this? Check the weather there.")]},
         {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
          "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "c1", "name": "get_weather",
          "content": [_text("Radar:"), _img(NAMES[0])]}],
        [NAMES[1], NAMES[0]], {"tools": [WEATHER], "thinking_effort": "high"}),
}


@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_conversations_equal_moonshots_encoder(k3vl, case):
    model, tok = k3vl
    messages, names, options = CONVERSATIONS[case]
    thinking = options.get("thinking", True)
    ref_options = {"thinking": thinking, "thinking_effort": options.get("thinking_effort", "max")}
    text, segments = _reference(messages, names, tools=options.get("tools"), **ref_options)
    prepared, images = prepare_images(messages, model.image_encoder)
    ours = dict(tools=options.get("tools"), thinking=thinking, thinking_effort=options.get("thinking_effort"))
    assert render_chat_text(tok, prepared, **ours) == text
    assert render_chat(tok, messages, image_encoder=model.image_encoder, **ours) == _reference_ids(segments, tok)
    assert len(images) == len(names)


def test_multi_turn_render_extends_the_previous_prompt(k3vl):
    """The session's incremental rule holds with images: a turn's prompt + reply + the next render from k + 1."""
    model, tok = k3vl
    turn1 = [{"role": "user", "content": [_img(NAMES[2]), _text("Describe it.")]}]
    reply = {"role": "assistant", "content": "A palette.", "reasoning_content": "Colours."}
    turn2 = [*turn1, reply, {"role": "user", "content": [_text("Now this:"), _img(NAMES[0])]}]
    enc = model.image_encoder
    first = render_chat(tok, turn1, image_encoder=enc)
    reply_ids = render_chat(tok, [*turn1, reply], image_encoder=enc, add_generation_prompt=False)[len(first):]
    assert render_chat(tok, turn2, image_encoder=enc) == (
        first + reply_ids + render_chat(tok, turn2, image_encoder=enc, start=2))


def test_prepare_images_leaves_the_messages_alone(k3vl):
    model, _ = k3vl
    enc = model.image_encoder
    arr = np.asarray(Image.open(IMAGES / f"{NAMES[0]}.png").convert("RGB"))
    given = [{"role": "system", "content": "hi"},
             {"role": "user", "content": [_img(NAMES[2]), {"type": "image", "image": arr},
                                          {"type": "image", "image": (IMAGES / f"{NAMES[1]}.png").read_bytes()},
                                          {"type": "image", "image": Image.open(IMAGES / f"{NAMES[3]}.png")}]}]
    before = [dict(m) for m in given]
    out, images = prepare_images(given, enc)
    assert [dict(m) for m in given] == before and given[1]["content"][0]["image"] == IMAGES / f"{NAMES[2]}.png"
    assert out[0] is given[0]
    assert all(isinstance(p["image"], PromptImage) for p in out[1]["content"])
    assert [im.size for im in images] == [(150, 90), (224, 168), (100, 300), (500, 380)]
    assert images[1] == enc.prepare(IMAGES / f"{NAMES[0]}.png")  # the same pixels from an array: the same digest
    again, images2 = prepare_images(out, None)  # prepared parts pass without an encoder
    assert images2 == images and again[1]["content"] == out[1]["content"]


def test_bad_image_parts_are_named(k3vl, tmp_path, kl_dir):
    model, tok = k3vl
    enc = model.image_encoder
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    frames = [Image.new("RGB", (28, 28), c) for c in ("red", "blue")]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])

    def user(*parts):
        return [{"role": "system", "content": "s"}, {"role": "user", "content": [_text("x"), *parts]}]

    cases = [
        ({"type": "image", "image": tmp_path / "missing.png"}, "message 1, content part 1: image file .*missing.png"),
        ({"type": "image", "image": tmp_path / "bad.png"}, "message 1, content part 1: image file .* not a readable"),
        ({"type": "image", "image": b"abc"}, "message 1, content part 1: image bytes .* not a readable"),
        ({"type": "image"}, "message 1, content part 1: an image part without its image"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}, "'image_url' parts are a client"),
        ({"type": "video", "video": "v.mp4"}, "message 1, content part 1: video parts are not supported"),
        ({"type": "image", "image": np.zeros((2, 28, 28, 3), np.uint8)}, "several frames"),
        ({"type": "image", "image": [IMAGES / f"{NAMES[0]}.png"] * 2}, "several frames"),
        ({"type": "image", "image": tmp_path / "anim.gif"}, "content part 1: image file .*anim.gif' has 2 frames"),
        ({"type": "image", "image": Image.open(tmp_path / "anim.gif")}, "content part 1: PIL image has 2 frames"),
        ({"type": "image", "image": np.zeros((28, 28, 3), np.float32)}, "content part 1: image array has dtype"),
    ]
    for part, message in cases:
        with pytest.raises(ValueError, match=message):
            render_chat(tok, user(part), image_encoder=enc)
    with pytest.raises(ValueError, match="content part 1: an image not prepared for the prompt"):
        render_chat(tok, user(_img(NAMES[0])))
    with pytest.raises(ValueError, match="content part 1: an image, and this model has no vision tower"):
        prepare_images(user(_img(NAMES[0])), None)
    _, kltok = load(kl_dir / "hf", dtype=mx.float32)
    with pytest.raises(ValueError, match="message 1, content part 1: the Kimi Linear chat format is text-only"):
        render_chat(kltok, user(_img(NAMES[0])))


def test_reordered_tool_results_with_images_are_refused(k3vl):
    model, tok = k3vl
    calls = [{"id": c, "function": {"name": "f", "arguments": {}}} for c in ("a", "b")]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": [_img(NAMES[0])]},
                {"role": "tool", "tool_call_id": "a", "content": "ok"}]
    with pytest.raises(ValueError, match="message 2: a tool result with an image must come in the order of the calls"):
        render_chat(tok, messages, image_encoder=model.image_encoder)
    in_order = [*messages[:2], messages[3], messages[2]]
    assert model.image_encoder.placeholder_id in render_chat(tok, in_order, image_encoder=model.image_encoder)


def test_stream_generate_takes_a_conversation(k3vl, kl_dir):
    """A list of messages is rendered with its images (the format's defaults, generation prompt): mlx-vlm's prompt,
    so the first token is mlx-vlm's argmax, and the tokens equal generation from the rendered ids."""
    from kimi_mlx import generate, stream_generate

    model, tok = k3vl
    messages = [{"role": "user", "content": [_img(NAMES[1]), _text("Describe this image.")]}]
    out = list(stream_generate(model, tok, messages, 4))
    assert out[0].prompt_tokens == MLX_VLM["prompts"][NAMES[1]]["n_tokens"]
    assert out[0].token == MLX_VLM["prompts"][NAMES[1]]["argmax_last"]
    ids = np.load(REF / f"{NAMES[1]}.chat.input_ids.npy").reshape(-1).tolist()
    from_ids = stream_generate(model, tok, ids, 4, images=[IMAGES / f"{NAMES[1]}.png"])
    assert [r.token for r in out] == [r.token for r in from_ids]
    assert generate(model, tok, messages, 4) == "".join(r.text for r in out)
    with pytest.raises(ValueError, match="images= with a list of messages"):
        list(stream_generate(model, tok, messages, 1, images=[IMAGES / f"{NAMES[1]}.png"]))
    klmodel, kltok = load(kl_dir / "hf", dtype=mx.float32)
    with pytest.raises(ValueError, match="message 0, content part 0: an image, and this model has no vision tower"):
        list(stream_generate(klmodel, kltok, messages, 1))
