"""Random well-formed GGML blocks of the types kept as blocks (``kimi_mlx.ops.ggml.FORMATS``), for tests.

Every byte is random except the fp16 super-block scales, which are set to finite values that bring the largest
|weight| (by gguf-py's dequantization) near ``max_abs``: indices, signs, sub-scales and high bits take any value.
"""

from __future__ import annotations

import gguf
import numpy as np

# byte offsets of the fp16 scale fields of each block (IQ1_M keeps its fp16 scale in the top nibbles of its four
# u16 sub-scale words at byte 48: handled apart)
FP16_FIELDS = {
    "Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,),
    "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "IQ1_M": (),
}


def set_scale(blocks: np.ndarray, name: str, d: np.ndarray) -> None:
    """Write fp16 scales ``d`` [nb] into blocks [nb, type_bytes] (in place)."""
    bits = d.astype(np.float16).view(np.uint16)
    if name == "IQ1_M":
        words = blocks[:, 48:56].copy().view(np.uint16)  # [nb, 4]
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
        return
    for off in FP16_FIELDS[name]:
        blocks[:, off:off + 2] = bits.view(np.uint8).reshape(-1, 2)


def random_blocks(name: str, shape: tuple[int, ...], rng: np.random.Generator, max_abs: float = 0.1) -> np.ndarray:
    """uint8 [..., rows, row_bytes] blocks of type ``name`` for a weight of numpy ``shape`` (last axis = columns),
    with per-block scales drawn so that the largest |weight| of a block is between ``max_abs`` / 4 and ``max_abs``."""
    qtype = gguf.GGMLQuantizationType[name]
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"{name}: {shape[-1]} columns is not a multiple of the block size {block}")
    nb = int(np.prod(shape)) // block
    blocks = rng.integers(0, 256, (nb, type_bytes), dtype=np.uint8)
    set_scale(blocks, name, np.ones(nb))
    unit = np.abs(gguf.quants.dequantize(blocks, qtype).reshape(nb, block)).max(axis=1)  # max |w| at scale 1
    unit = np.where(unit > 0, unit, 1.0)
    set_scale(blocks, name, max_abs * rng.uniform(0.25, 1.0, nb) / unit)
    return blocks.reshape(*shape[:-1], shape[-1] // block * type_bytes)
