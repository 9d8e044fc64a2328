"""Image input: kimi-mlx vs mlx-vlm 0.7.10 on the same weights, in the same run.

1. The K3 vision fixture (``k3-vl-tiny``: its own preprocessing limits, 400 patches), one 1024x768 image (fixed-seed
   noise): image encoding (preprocess + tower + projector, no cache) and time to first token (preprocess, tower,
   projector, merge into the prompt, prefill, first logits) on the same prompt ids (mlx-vlm's processor's).
2. One tower layer at the released widths (vision_config of k3_vision.md section 2: hidden 1024, qkv 1536, 12 heads,
   MLP 4096) on a 1024x768 image's patches at the released limits (grid 56 x 74 = 4144 patches), the same random
   weights in both, in ``--dtype`` (the model's dtype; float32 is what ``load`` gives on the CPU backend): time, peak
   memory above the inputs, and the largest |difference| of the outputs.
3. Attention memory for the largest image the released limits allow (256 x 256 = 65536 patches): ours runs its
   query blocks one at a time, so the peak of its first two blocks against all 65536 keys (measured) is that of the
   whole run; mlx-vlm attends in one ``scaled_dot_product_attention`` call, whose scores the CPU backend
   materialises (12 x N x N, computed: too large to run).

Each round runs both back to back (after one warm-up round); times are medians over ``--runs`` rounds, the ratio the
median of per-round ratios (ours / mlx-vlm: below 1 is faster). mlx-vlm is a bench dependency, not a runtime one:
``pip install mlx-vlm==0.7.10``. See bench/README.md (OpenBLAS via LD_PRELOAD on both sides).

    python bench/bench_vision.py [--runs 3] [--dtype float32|bfloat16] [--skip-layer]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_mlx_lm import blas_in_use  # noqa: E402

from kimi_mlx import load, stream_generate  # noqa: E402
from kimi_mlx.vision import tower as our_tower  # noqa: E402
from kimi_mlx.vision.config import VisionConfig  # noqa: E402
from kimi_mlx.vision.encoder import ImageEncoder  # noqa: E402
from kimi_mlx.vision.preprocess import VisionPreprocessConfig, preprocess  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
CKPT = SHARED / "fixtures" / "k3_vision" / "k3-vl-tiny"
# The released vision_config and preprocessing limits (k3_vision.md section 2; mlx-vlm's VisionConfig defaults agree)
RELEASED_VISION = {
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
    "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27, "vt_hidden_size": 1024, "vt_intermediate_size": 4096,
    "qkv_hidden_size": 1536, "merge_kernel_size": [2, 2], "mm_hidden_size": 1024, "text_hidden_size": 7168,
    "projector_ln_eps": 1e-5,
}
RELEASED_PREPROCESS = {"patch_size": 14, "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
                       "merge_kernel_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
SIZE = (1024, 768)  # (W, H)
PROMPT = "<|kimi_image_placeholder|>Describe this image."


def image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def compare(ours, theirs, runs: int) -> tuple[float, float, float]:
    """(median seconds ours, median seconds mlx-vlm, median per-round ratio): one warm-up round, then ``runs``."""
    ours(), theirs()
    a, b = [], []
    for _ in range(runs):
        for fn, out in ((ours, a), (theirs, b)):
            tic = time.perf_counter()
            fn()
            out.append(time.perf_counter() - tic)
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def peak_above(fn) -> float:
    """MiB of peak memory above what was allocated before ``fn()`` ran (its result evaluated)."""
    mx.eval(fn())  # warm
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    return (mx.get_peak_memory() - base) / 2**20


def fixture_rows(runs: int) -> list[tuple]:
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import KimiK3Processor
    from mlx_vlm.utils import load_model

    model, tok = load(CKPT, dtype=mx.float32)
    ref = load_model(CKPT, strict=True)
    ref.set_dtype(mx.float32)  # the fixture's references are float32 (bf16 weights upcast exactly)
    proc = KimiK3Processor.from_pretrained(str(CKPT))
    img = image(SIZE)
    enc0 = model.image_encoder

    def fresh() -> ImageEncoder:  # no feature cache: every run encodes
        return ImageEncoder(enc0.vision, enc0.preprocess, enc0.placeholder_id, enc0.dtype, enc0.source)

    def ours_encode():
        enc = fresh()
        return enc.features(enc.prepare(img))

    def theirs_encode():
        px = proc.image_processor([img])
        feats = ref.mm_projector(ref.vision_tower(mx.array(px["pixel_values"]).transpose(0, 2, 3, 1),
                                                  grid_thws=px["grid_thws"]))
        mx.eval(feats)
        return feats

    inputs = proc(images=[img], text=PROMPT)
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()

    def ours_ttft():
        model.image_encoder = fresh()
        return next(iter(stream_generate(model, tok, ids, 1, images=[img]))).token

    def theirs_ttft():
        x = proc(images=[img], text=PROMPT)
        logits = ref(mx.array(x["input_ids"]), mx.array(x["pixel_values"]), cache=ref.make_cache(),
                     grid_thws=x["grid_thws"], image_token_id=x["image_token_id"])
        return mx.argmax(logits.logits[0, -1]).item()

    diff = float(mx.abs(ours_encode() - theirs_encode()).max())
    assert ours_ttft() == theirs_ttft(), "the first tokens differ"
    n = fresh().prepare(img).num_tokens
    return [(f"image encoding, fixture, 1024x768 -> {n} tokens (ms)", *compare(ours_encode, theirs_encode, runs),
             f"features max|diff| {diff:.1e}"),
            (f"time to first token, fixture, {len(ids)}-token prompt (ms)", *compare(ours_ttft, theirs_ttft, runs),
             "same first token")]


def layer_rows(runs: int, dtype: mx.Dtype) -> list[tuple]:
    from mlx_vlm.models.kimi_k3.config import VisionConfig as RefConfig
    from mlx_vlm.models.kimi_k3.vision import KimiK3VisionBlock, rope_2d_angles

    cfg = VisionConfig.from_hf({"vision_config": RELEASED_VISION})
    grid = preprocess(image(SIZE), VisionPreprocessConfig.from_dict(RELEASED_PREPROCESS)).grid_thw
    t, h, w = (int(v) for v in np.asarray(grid).reshape(-1))
    n = t * h * w
    ours = our_tower.Block(cfg)
    ours.update(tree_map(lambda p: (0.02 * mx.random.normal(p.shape)).astype(dtype), ours.parameters()))
    theirs = KimiK3VisionBlock(RefConfig.from_dict(RELEASED_VISION))
    theirs.load_weights(tree_flatten(ours.parameters()), strict=True)
    x = mx.random.normal((n, cfg.hidden_size)).astype(dtype)
    cos, sin = (a.astype(dtype) for a in our_tower.rope_2d(t, h, w, cfg.head_dim))
    angles = rope_2d_angles(cfg.head_dim, t, h, w)
    rc, rs = mx.cos(angles), mx.sin(angles)
    mx.eval(ours.parameters(), theirs.parameters(), x, cos, sin, rc, rs)
    run_ours, run_theirs = (lambda: mx.eval(ours(x, cos, sin))), (lambda: mx.eval(theirs(x, rc, rs)))
    diff = float(mx.abs(ours(x, cos, sin).astype(mx.float32) - theirs(x, rc, rs).astype(mx.float32)).max())
    mem_ours, mem_theirs = peak_above(lambda: ours(x, cos, sin)), peak_above(lambda: theirs(x, rc, rs))
    name = str(dtype).rsplit(".", 1)[-1]
    return [(f"one tower layer, released widths, {n} patches, {name} (ms)", *compare(run_ours, run_theirs, runs),
             f"max|diff| {diff:.1e}"),
            ("  peak memory above inputs, that layer (MiB)", mem_ours, mem_theirs, mem_ours / mem_theirs, "")]


def largest_rows() -> list[tuple]:
    cfg = VisionConfig.from_hf({"vision_config": RELEASED_VISION})
    side = RELEASED_PREPROCESS["patch_limit_on_one_side"] * RELEASED_PREPROCESS["patch_size"]  # 7168 px
    big = Image.new("RGB", (side // 2, side // 2))  # 3584 x 3584: 256 x 256 = 65536 patches, the total limit
    t, h, w = preprocess(big, VisionPreprocessConfig.from_dict(RELEASED_PREPROCESS)).grid_thw
    n, heads, hd = t * h * w, cfg.num_heads, cfg.head_dim
    block = max(1, our_tower.ATTENTION_SCORE_BYTES // (heads * n * 4))
    q, k, v = (mx.random.normal((1, heads, n, hd)) for _ in range(3))
    mx.eval(q, k, v)
    mine = peak_above(lambda: our_tower.attention(q[:, :, : 2 * block], k, v, hd**-0.5))
    full = heads * n * n * 4 / 2**20
    return [(f"attention peak, largest image ({n} patches, float32; ours: 2 of {-(-n // block)} query blocks) "
             "(MiB)", mine, full, mine / full, "mlx-vlm: scores computed, not run")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the tower layer's dtype")
    ap.add_argument("--skip-layer", action="store_true", help="no real-width layer (the slow part on 2 cores)")
    args = ap.parse_args(argv)
    try:
        import mlx_vlm
    except ImportError:
        print("bench_vision.py compares with mlx-vlm: pip install mlx-vlm==0.7.10", file=sys.stderr)
        return 2

    print(f"BLAS: {blas_in_use()}")
    print(f"mlx {mx.__version__}, mlx-vlm {mlx_vlm.__version__}, runs {args.runs}")
    rows = fixture_rows(args.runs)
    if not args.skip_layer:
        rows += layer_rows(args.runs, getattr(mx, args.dtype))
    rows += largest_rows()
    print(f"| {'metric':<88} | {'kimi-mlx':>9} | {'mlx-vlm':>9} | {'ours/vlm':>8} | note |")
    print(f"|{'-' * 90}|{'-' * 10}:|{'-' * 10}:|{'-' * 9}:|---|")
    for name, a, b, ratio, note in rows:
        scale = 1000 if name.endswith("(ms)") else 1
        print(f"| {name:<88} | {a * scale:9.1f} | {b * scale:9.1f} | {ratio:8.3f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
