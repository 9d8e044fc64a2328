"""Per GGML type: which MLX layout ``kimi_mlx.convert.gguf.quant.to_mlx`` gives, the size ratio, and the error
against gguf-py's own dequantization of the same blocks.

Blocks are random but well-formed: the test suite's encoders (tests/test_gguf_quant.py) for the exact and K types;
random bytes with a finite fp16 super-block scale (1e-3) for the codebook (IQ*) types. Errors are
max |MLX dequantization - gguf-py dequantization| / max |w| over a [64, 4096] tensor, for float32 scales (default)
and float16 scales (MLX then dequantizes in float16, as a float16 model does).

    python bench/bench_gguf_quant_error.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_gguf_quant import ENCODERS  # noqa: E402  (the suite's block encoders)

from kimi_mlx.convert.gguf.quant import CODEBOOK, SUPPORTED_EXACT, SUPPORTED_REQUANT, to_mlx  # noqa: E402

T = gguf.GGMLQuantizationType
SHAPE = (64, 4096)


def codebook_blocks(qtype: T, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = int(np.prod(SHAPE)) // block
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    d = int(np.float16(1e-3).reshape(1).view(np.uint16)[0])
    if qtype == T.IQ1_M:  # the fp16 scale is the top nibbles of the 4 uint16 scale words (the last 8 bytes)
        words = raw[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
        return raw.reshape(-1)
    raw[:, :2] = np.float16(1e-3).reshape(1).view(np.uint8)  # d (fp16) leads every other IQ block
    return raw.reshape(-1)


def blocks(qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype in CODEBOOK:
        return codebook_blocks(qtype, rng)
    raw, _ = ENCODERS[qtype](rng, int(np.prod(SHAPE)) // gguf.GGML_QUANT_SIZES[qtype][0])
    return np.ascontiguousarray(raw).reshape(-1)


def measure(qtype: T, raw: np.ndarray, scale_dtype) -> tuple[str, float, float]:
    ref = gguf.quants.dequantize(raw.reshape(SHAPE[0], -1), qtype).astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = to_mlx("w", qtype, raw, SHAPE, requantize=True, scale_dtype=scale_dtype)
    # affine: dequantized in the scales' dtype, as a model in that dtype computes; mxfp4 (uint8 scales): float32
    out_dtype = mx.float32 if o["mode"] == "mxfp4" else o["scales"].dtype
    got = np.array(mx.dequantize(o["weight"], o["scales"], o.get("biases"), group_size=o["group_size"],
                                 bits=o["bits"], mode=o["mode"], dtype=out_dtype).astype(mx.float32))
    nbytes = sum(o[k].nbytes for k in ("weight", "scales", "biases") if k in o)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    return f"{o['mode']} {o['bits']}-bit g{o['group_size']}", nbytes / raw.nbytes, err


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"tensor {SHAPE}; error = max|MLX - gguf-py| / max|w|; size = MLX bytes / GGUF bytes")
    print(f"{'type':8} {'path':12} {'MLX layout':18} {'size f32':>9} {'err f32':>9} {'size f16':>9} {'err f16':>9}")
    for group, path in ((SUPPORTED_EXACT, "exact"), (SUPPORTED_REQUANT, "requantized"), (CODEBOOK, "requantize=1")):
        for qtype in group:
            raw = blocks(qtype, rng)
            layout, size32, err32 = measure(qtype, raw, mx.float32)
            _, size16, err16 = measure(qtype, raw, mx.float16)
            print(f"{qtype.name:8} {path:12} {layout:18} {size32:9.2f} {err32:9.2e} {size16:9.2f} {err16:9.2e}")


if __name__ == "__main__":
    main()
