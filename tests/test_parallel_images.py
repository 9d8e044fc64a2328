"""Images on a distributed K3 (``parallel/images.py``): the vision tower is read and run on rank 0 only, and the
model's logits with an image equal one process's.

Launched check (2 ``ring`` ranks under ``mlx.launch``, pipeline and tensor): each rank loads the K3 vision fixture with
``parallel=`` (on ranks > 0 the tower loader is replaced by one that fails, so reading the tower there is an error),
then the single-process model, and compares the first step's log-probabilities of ``stream_generate(images=...)`` on
mlx-vlm's chat prompts (one image; two images in one message) with prefill chunks of 2048 tokens and of 7 (chunks
that end inside each image's placeholders), and against mlx-vlm's own logits. A checkpoint without a tower refuses
images on every rank with rank 0's reason. Ranks > 0 take images without pixels (``PromptImage.from_json``: digest,
count and size, as a request would carry them between ranks).
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
from conftest import SHARED
from distributed import run_ranks

from kimi_mlx import load
from kimi_mlx.parallel.images import GroupImageEncoder

ROOT = SHARED / "fixtures" / "k3_vision"
CKPT = ROOT / "k3-vl-tiny"

# Pipeline: bit-exact in the existing pipeline tests (the stages run the same kernels); tensor: the partial sums
# add up in another order (test_parallel_tensor.py's bound). Measured here, every rank: pipeline 0 everywhere, tensor
# 2.9e-6 .. 5.2e-6; against mlx-vlm 4.6e-6 .. 7.5e-6.
TOL = {"pipeline": 1e-6, "tensor": 1e-4}
VS_MLX_VLM = 1e-4  # test_vision_chat_logits.py's bound against mlx-vlm's logits

RANK_CODE = """
import numpy as np
from pathlib import Path
import kimi_mlx.vision.model as vision_model
from kimi_mlx import load, stream_generate
from kimi_mlx.image_prompt import PromptImage

mode, ckpt, text_only = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ref_dir, images = ckpt.parent / "mlx_vlm", ckpt.parent / "images"
real_load_vision = vision_model.load_vision
if group.rank() > 0:
    def refuse(*a, **k):
        raise AssertionError(f"rank {group.rank()} read the vision tower")
    vision_model.load_vision = refuse
model, tok = load(ckpt, dtype=mx.float32, parallel=mode, group=group)
vision_model.load_vision = real_load_vision
plain, _ = load(ckpt, dtype=mx.float32)

def first(m, prompt, files, step):
    ids = np.load(ref_dir / f"{prompt}.chat.input_ids.npy").reshape(-1).tolist()
    out = next(iter(stream_generate(m, tok, ids, 1, images=[images / f for f in files], prefill_step_size=step)))
    return np.array(out.logprobs, np.float64)

def mlx_vlm(prompt):
    ref = np.load(ref_dir / f"{prompt}.chat.last_logits.npy").reshape(-1).astype(np.float64)
    return ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())

cases = {"img3_large_500x380": ["img3_large_500x380.png"],
         "two_images": ["img0_rgb_224x168.png", "img2_palette_150x90.png"]}
out = {"diff": {}, "vs_mlx_vlm": {}}
for prompt, files in cases.items():
    for step in (2048, 7):
        got, ref = first(model, prompt, files, step), first(plain, prompt, files, step)
        out["diff"][f"{prompt}/{step}"] = float(np.abs(got - ref).max())
        out["vs_mlx_vlm"][f"{prompt}/{step}"] = float(np.abs(got - mlx_vlm(prompt)).max())
enc = model.image_encoder
# ranks > 0 need no pixels: an image as a request carries it between ranks (digest, count, size; no pixels)
files = cases["two_images"]
as_sent = [PromptImage.from_json(enc.prepare(images / f).to_json()) for f in files]
ids = np.load(ref_dir / "two_images.chat.input_ids.npy").reshape(-1).tolist()
given = [images / f for f in files] if group.rank() == 0 else as_sent
got = next(iter(stream_generate(model, tok, ids, 1, images=given, prefill_step_size=7)))
out["diff"]["two_images/7/no pixels off rank 0"] = float(np.abs(np.array(got.logprobs, np.float64) -
                                                          first(plain, "two_images", files, 7)).max())
out.update(encoded=enc.encoded, tower_bytes=enc.nbytes, has_local=enc.local.vision is not None, source=enc.source)
bare, _ = load(text_only, dtype=mx.float32, parallel=mode, group=group)
out["text_only"] = [bare.image_encoder is None, bare.no_images_reason]
report(out)
"""


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_match_one_process_with_images(mode, k3_dir, tmp_path):
    """Every rank, every case: log-probabilities within TOL of one process and within 1e-4 of mlx-vlm; the tower is
    on rank 0 only (rank 1 never read it: its loader would have raised), and rank 0 ran it once per image."""
    text_only = k3_dir / "hf" if (k3_dir / "hf").is_dir() else k3_dir
    results = run_ranks(RANK_CODE, 2, tmp_path, args=(mode, CKPT, text_only), timeout=600)
    for rank, r in enumerate(results):
        where = f"{mode} rank {rank}"
        assert max(r["diff"].values()) <= TOL[mode], f"{where}: {r['diff']}"
        assert max(r["vs_mlx_vlm"].values()) <= VS_MLX_VLM, f"{where}: {r['vs_mlx_vlm']}"
        assert r["has_local"] == (rank == 0) and (r["tower_bytes"] > 0) == (rank == 0), where
        assert r["source"] == str(CKPT), where
        assert r["text_only"][0] and "has no vision tower" in r["text_only"][1], f"{where}: {r['text_only']}"
    assert results[0]["encoded"] == 3 and results[1]["encoded"] == 0  # 3 images, each cached after its first run


def test_group_of_one_gives_the_towers_features_once_per_image():
    """On a group of one, ``features`` is the local encoder's, and an image asked for again (a prefill chunk that
    cuts it) is neither encoded nor sent again."""
    model, _ = load(CKPT, dtype=mx.float32)
    enc = model.image_encoder
    group = mx.distributed.init()
    shared = GroupImageEncoder(group, enc, everywhere=True)
    pixels = np.random.default_rng(5).integers(0, 255, (90, 150, 3), dtype=np.uint8)
    image = shared.prepare(pixels)
    assert image == enc.prepare(pixels)  # same digest, count and size as the tower's own encoder gives
    before = enc.encoded
    a, b = shared.features(image), shared.features(image)
    assert enc.encoded == before + 1 and a is b
    assert mx.array_equal(a, enc.features(image)).item() and a.shape == (image.num_tokens, enc.hidden_size)
