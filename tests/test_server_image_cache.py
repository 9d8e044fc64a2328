"""The serving engine with images (``kimi_mlx.server.scheduler`` on the K3 vision fixture, in process): a prompt
with an image gives mlx-vlm's first-step logits; prefill chunks may end inside an image; the prefix cache keys images
by content: two different images with the same text never share an entry past the text before them, the same image
re-sent resumes from the cache (``cached_tokens`` covers it) with the log-probabilities of a cold engine and without
running the vision tower again.

References: mlx-vlm 0.7.10's logits (``fixtures/k3_vision/mlx_vlm``) and a fresh engine with the prefix cache off
(cold prefill). Prompts are mlx-vlm's rendered chat ids (they hold the placeholders).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import SHARED

from kimi_mlx.image_prompt import ImageRows, PromptImage
from kimi_mlx.loading import load
from kimi_mlx.server.scheduler import FinishEvent, GenerationRequest, Scheduler, _request_from_json, _request_to_json

ROOT = SHARED / "fixtures" / "k3_vision"
REF = ROOT / "mlx_vlm"
IMG0 = ROOT / "images" / "img0_rgb_224x168.png"
N = 4
TOP = 20


@pytest.fixture(scope="module")
def k3():
    return load(ROOT / "k3-vl-tiny", dtype=mx.float32)


@pytest.fixture
def engine(k3):
    engines = []

    def make(**kw):
        e = Scheduler(k3[0], **kw).start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.stop()


def _ids(prompt: str) -> list[int]:
    return np.load(REF / f"{prompt}.chat.input_ids.npy").reshape(-1).tolist()


def _ref_logprobs(prompt: str) -> np.ndarray:
    ref = np.load(REF / f"{prompt}.chat.last_logits.npy").reshape(-1).astype(np.float64)  # [vocab]
    return ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())


def _other(seed: int) -> np.ndarray:
    """An image of img0's size (224x168: the same prompt text and placeholder count) with other pixels."""
    return np.random.default_rng(seed).integers(0, 256, (168, 224, 3), dtype=np.uint8)


def _run(e: Scheduler, ids: list[int], images: list) -> tuple[list, FinishEvent]:
    """(each step's top-TOP [(id, logprob)], the finish event) of a greedy request."""
    enc = e.model.image_encoder
    req = GenerationRequest(ids, N, top_logprobs=TOP, images=tuple(enc.prepare(im) for im in images))
    events = list(e.submit(req))
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "length", events[-1]
    return [ev.top_logprobs for ev in events[:-1]], events[-1]


def _max_delta(a: list, b: list) -> float:
    """Largest log-probability difference of two runs' top lists (which must name the same tokens)."""
    assert [[t for t, _ in step] for step in a] == [[t for t, _ in step] for step in b]
    return max(abs(x - y) for sa, sb in zip(a, b) for (_, x), (_, y) in zip(sa, sb))


def _rows(k3, ids: list[int], images: list) -> ImageRows:
    enc = k3[0].image_encoder
    return ImageRows(ids, [enc.prepare(im) for im in images], enc.placeholder_id)


@pytest.mark.parametrize("chunk", [512, 7, 31])
def test_first_step_matches_mlx_vlm(engine, chunk):
    """Two images in one message; chunks of 7 and 31 tokens end inside each image's placeholders."""
    e = engine(prefill_chunk=chunk, prompt_cache_bytes=0)
    images = [IMG0, ROOT / "images" / "img2_palette_150x90.png"]
    top, fin = _run(e, _ids("two_images"), images)
    ref = _ref_logprobs("two_images")
    assert [t for t, _ in top[0]] == np.argsort(-ref)[:TOP].tolist()
    assert max(abs(lp - ref[t]) for t, lp in top[0]) < 1e-4
    assert fin.prompt_tokens == len(_ids("two_images")) and fin.cached_tokens == 0


def test_different_images_never_share_an_entry(k3, engine):
    """The same text with another image of the same size: different log-probabilities, and the cache gives the
    second request only the text before the image (also from snapshots taken inside the first image: checkpoint
    interval 20); its log-probabilities are a cold engine's."""
    ids = _ids("img0_rgb_224x168")
    first = _rows(k3, ids, [IMG0]).positions[0]
    warm = engine(prefill_chunk=64, checkpoint_interval=20)
    cold = engine(prefill_chunk=64, prompt_cache_bytes=0)
    a, fin_a = _run(warm, ids, [IMG0])
    b, fin_b = _run(warm, ids, [_other(1)])
    assert fin_a.cached_tokens == 0 and 0 < fin_b.cached_tokens <= first
    assert abs(a[0][0][1] - b[0][0][1]) > 1e-3 or a[0][0][0] != b[0][0][0]
    assert _max_delta(b, _run(cold, ids, [_other(1)])[0]) <= 1e-5


def test_same_image_resumes_from_cache_without_the_tower(k3, engine):
    """The same image re-sent (as new bytes: equal pixels, equal digest) after another image evicted its features
    from the encoder: the prefix cache covers the image, the tower does not run, log-probabilities equal a cold
    engine's."""
    enc = k3[0].image_encoder
    ids = _ids("img0_rgb_224x168")
    end = _rows(k3, ids, [IMG0]).end
    warm = engine(prefill_chunk=64)
    cold = engine(prefill_chunk=64, prompt_cache_bytes=0)
    budget, enc.cache_bytes = enc.cache_bytes, 1  # the encoder keeps one image's features
    try:
        _run(warm, ids, [_other(2)])
        _run(warm, ids, [_other(3)])  # the prompt's own snapshot of image 2 stays; its features are gone
        encoded = enc.encoded
        again, fin = _run(warm, ids, [_other(2).copy()])
        assert enc.encoded == encoded
        assert fin.cached_tokens == len(ids) - 1 >= end
        assert _max_delta(again, _run(cold, ids, [_other(2)])[0]) <= 1e-5
    finally:
        enc.cache_bytes = budget


def test_plan_json_carries_the_images(k3):
    """What rank 0 sends the other ranks: each image's digest, placeholder count and size (no pixels)."""
    req = GenerationRequest(_ids("img0_rgb_224x168"), N, images=(k3[0].image_encoder.prepare(IMG0),))
    back = _request_from_json(_request_to_json(req))
    assert back.images == req.images and back.images[0].pixels is None
    assert back.tokens == req.tokens


def test_submit_refuses_mismatched_images(k3, engine):
    e = engine()
    ids = _ids("img0_rgb_224x168")
    with pytest.raises(ValueError, match="48 image placeholder tokens.*take 0"):
        e.submit(GenerationRequest(ids, N))
    with pytest.raises(ValueError, match="take 24"):
        e.submit(GenerationRequest(ids, N, images=(PromptImage("ab" * 16, 24, (150, 90)),)))


def test_text_only_model_refuses_images(k3_dir):
    model, _ = load(k3_dir / "hf", dtype=mx.float32)
    e = Scheduler(model).start()
    try:
        with pytest.raises(ValueError, match="no vision tower"):
            e.submit(GenerationRequest([1, 2, 3], N, images=(PromptImage("ab" * 16, 1, (28, 28)),)))
    finally:
        e.stop()
