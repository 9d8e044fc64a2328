"""llama.cpp's Kimi-K3 mmproj GGUF (``convert_hf_to_gguf.py --mmproj``, projector type ``kimik3``) as a
``VisionModel`` with the HF checkpoint's numbers, and the mmproj files that sit beside a K3 GGUF.

    mm = open_mmproj("mmproj-K3-F16.gguf")  # header only: config, preprocessing, every tensor checked
    vision = load_mmproj(mm, dtype=mx.float32)  # the weights, in the HF layout

Keys (``clip.vision.*``) -> ``VisionConfig``: ``embedding_length`` D, ``feed_forward_length`` I, ``block_count`` L,
``attention.head_count`` H, ``attention.head_dim`` (Q = H * head_dim), ``patch_size`` P, ``projection_dim`` T,
``projector.scale_factor`` (the merge kernel, square), ``attention.layer_norm_epsilon`` (the projector's post-norm
eps ONLY: the tower's RMSNorms keep ``config.TOWER_NORM_EPS`` = 2^-7 as Moonshot's bf16 tower and mlx-vlm have it;
llama.cpp applies the file's 1e-5 to every norm, which moves image features by up to 0.1); the position table's
(H0, W0) from ``v.position_embd.weight`` (ne [D, W0, H0]).
Tensors (GGUF -> HF name, numpy shapes as the HF ones): ``v.patch_embd`` (the conv [D, 3, P, P]),
``v.position_embd`` [H0, W0, D], ``v.blk.{i}.{ln1, attn_qkv, attn_out, ln2, ffn_up, ffn_down}`` ->
``blocks.{i}.{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1}``, ``v.post_ln`` -> ``final_layernorm``, ``mm.1`` / ``mm.2``
/ ``mm.post_norm`` -> ``mm_projector.proj.0`` / ``proj.2`` / ``post_norm``. The converter permutes the q and k rows
of ``attn_qkv`` within each head, ``[hd/4, 2 (x|y), 2] -> [2 (x|y), hd/4, 2]`` (llama.cpp's NORMAL rope on each
half); they are put back in the HF order ([x0, y0, x1, y1, ...] pairs). Any GGUF tensor type loads (decoded to
float32). Strict: a missing, extra or misshaped tensor is an error naming it.
Preprocessing: mean / std / patch size / merge from the keys, ``in_patch_limit`` = ``image_max_pixels`` / P^2;
what the file does not store takes the released ``preprocessor_config.json`` values (``RELEASED_*`` below).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
import numpy as np

from ..convert.gguf.arch import decode_float
from ..convert.gguf.reader import GGUFFile, GGUFFormatError
from .config import VisionConfig
from .model import VisionModel, load_vision_weights
from .preprocess import TransparentBg, VisionPreprocessConfig

PROJECTOR_TYPE = "kimik3"
# Released Kimi-K3 media_proc_cfg values the mmproj does not store.
RELEASED_PATCH_LIMIT_ON_ONE_SIDE = 512
RELEASED_IN_PATCH_LIMIT = 65536  # only when the file lacks clip.vision.image_max_pixels
RELEASED_BACKGROUND = TransparentBg("chessboard", 8, True, 255, 180)  # filled after the resize
MMPROJ_NAME = re.compile(r"^mmproj.*\.gguf$", re.IGNORECASE)

_BLOCK = {"ln1": "norm0.weight", "attn_qkv": "wqkv.weight", "attn_out": "wo.weight", "ln2": "norm1.weight",
          "ffn_up": "mlp.fc0.weight", "ffn_down": "mlp.fc1.weight"}
_TOP = {"v.patch_embd.weight": "vision_tower.patch_embed.proj.weight",
        "v.position_embd.weight": "vision_tower.patch_embed.pos_emb.weight",
        "v.post_ln.weight": "vision_tower.encoder.final_layernorm.weight",
        "mm.1.weight": "mm_projector.proj.0.weight", "mm.2.weight": "mm_projector.proj.2.weight",
        "mm.post_norm.weight": "mm_projector.post_norm.weight"}


@dataclass
class MMProj:
    """An opened, checked mmproj: ``cfg`` and ``preprocess`` from its keys, ``names`` GGUF tensor -> HF name."""

    gguf: GGUFFile
    cfg: VisionConfig
    preprocess: VisionPreprocessConfig
    names: dict[str, str]

    @property
    def source(self) -> str:
        return self.gguf.source


def hf_names(num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF checkpoint name, for a tower of ``num_layers`` blocks."""
    out = dict(_TOP)
    for i in range(num_layers):
        for g, h in _BLOCK.items():
            out[f"v.blk.{i}.{g}.weight"] = f"vision_tower.encoder.blocks.{i}.{h}"
    return out


def mmproj_file(path: Union[str, Path]) -> Path:
    """``path`` as a Path, or GGUFFormatError when it is not a file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise GGUFFormatError(f"mmproj {path}: no such file (expected llama.cpp's Kimi-K3 mmproj GGUF)")
    return file


def open_mmproj(path: Union[str, Path]) -> MMProj:
    """Read and check an mmproj's header (no tensor data is read): GGUFFormatError naming the file and the key or
    tensor when it is not a Kimi-K3 mmproj, lacks a key, or holds a missing, extra or misshaped tensor."""
    g = GGUFFile(mmproj_file(path))
    kind = g.values.get("clip.projector_type")
    if kind != PROJECTOR_TYPE:
        what = "has no 'clip.projector_type' key (not an mmproj GGUF: general.architecture " \
               f"{g.values.get('general.architecture')!r})" if kind is None else f"is a {kind!r} mmproj"
        raise GGUFFormatError(f"{g.source}: {what}; expected a Kimi-K3 mmproj (clip.projector_type "
                              f"{PROJECTOR_TYPE!r}, written by llama.cpp's convert_hf_to_gguf.py --mmproj)")
    if not g.get_bool("clip.has_vision_encoder", True):
        g._fail("clip.has_vision_encoder", False, "true (a vision encoder)")
    cfg = _vision_config(g)
    names = hf_names(cfg.num_layers)
    _check_tensors(g, cfg, names)
    return MMProj(g, cfg, _preprocess_config(g, cfg), names)


def _vision_config(g: GGUFFile) -> VisionConfig:
    key = "clip.vision."
    d, heads = g.get_int(key + "embedding_length", minimum=2), g.get_int(key + "attention.head_count", minimum=1)
    head_dim = g.get_int(key + "attention.head_dim", minimum=4)
    if head_dim % 4:
        g._fail(key + "attention.head_dim", head_dim, "a multiple of 4 (2-D rotary on head_dim/4 pairs each)")
    if d % 2:
        g._fail(key + "embedding_length", d, "an even number")
    merge = g.get_int(key + "projector.scale_factor", minimum=1)
    pos = g.tensors.get("v.position_embd.weight")
    if pos is None or len(pos.shape) != 3 or pos.shape[2] != d:
        found = "missing" if pos is None else f"numpy shape {tuple(pos.shape)}"
        raise GGUFFormatError(f"{g.source}: tensor 'v.position_embd.weight' is {found}; expected the 3-D position "
                              f"table [H0, W0, {d}] (ne [{d}, W0, H0])")
    return VisionConfig(
        patch_size=g.get_int(key + "patch_size", minimum=1), pos_emb_height=pos.shape[0], pos_emb_width=pos.shape[1],
        num_heads=heads, num_layers=g.get_int(key + "block_count", minimum=1), hidden_size=d,
        intermediate_size=g.get_int(key + "feed_forward_length", minimum=1), qkv_hidden_size=heads * head_dim,
        merge_kernel=(merge, merge), mm_hidden_size=d,
        projector_ln_eps=_positive_float(g, key + "attention.layer_norm_epsilon"),
        text_hidden_size=g.get_int(key + "projection_dim", minimum=1),
    )


def _positive_float(g: GGUFFile, key: str) -> float:
    """A positive float key, as the shortest decimal of its float32 (1e-05, not 9.99999974738e-06: the value the
    converter was given)."""
    v = g.get_float(key)
    if not v > 0:
        g._fail(key, v, "a positive float")
    return float(str(np.float32(v))) if g.types[key][0].name == "FLOAT32" else v


def _preprocess_config(g: GGUFFile, cfg: VisionConfig) -> VisionPreprocessConfig:
    p = cfg.patch_size
    max_pixels = g.get_int("clip.vision.image_max_pixels", RELEASED_IN_PATCH_LIMIT * p * p, minimum=p * p)
    mean, std = (g.get_array(f"clip.vision.image_{k}", "float", length=3) for k in ("mean", "std"))
    if any(s == 0 for s in std):
        g._fail("clip.vision.image_std", std, "3 non-zero floats")
    return VisionPreprocessConfig(
        patch_size=p, in_patch_limit=max_pixels // (p * p), patch_limit_on_one_side=RELEASED_PATCH_LIMIT_ON_ONE_SIDE,
        merge_kernel_size=cfg.merge_kernel, image_mean=tuple(mean), image_std=tuple(std),
        transparent_bg=RELEASED_BACKGROUND, transparent_bg_fill_stage="after_resize",
    )


def _expected_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (the HF tensor's shape; ne is its reverse)."""
    d, q, i, p, m, t = (cfg.hidden_size, cfg.qkv_hidden_size, cfg.intermediate_size, cfg.patch_size,
                        cfg.merged_size, cfg.text_hidden_size)
    out = {"v.patch_embd.weight": (d, 3, p, p), "v.position_embd.weight": (cfg.pos_emb_height, cfg.pos_emb_width, d),
           "v.post_ln.weight": (d,), "mm.1.weight": (m, m), "mm.2.weight": (t, m), "mm.post_norm.weight": (t,)}
    block = {"ln1": (d,), "attn_qkv": (3 * q, d), "attn_out": (d, q), "ln2": (d,), "ffn_up": (i, d), "ffn_down": (d, i)}
    for n in range(cfg.num_layers):
        out.update({f"v.blk.{n}.{k}.weight": s for k, s in block.items()})
    return out


def _check_tensors(g: GGUFFile, cfg: VisionConfig, names: dict[str, str]) -> None:
    expected = _expected_shapes(cfg)
    missing = [n for n in expected if n not in g.tensors]
    if missing:
        raise GGUFFormatError(f"{g.source}: mmproj tensor '{missing[0]}' is missing (expected ne "
                              f"{list(reversed(expected[missing[0]]))})"
                              + (f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else ""))
    extra = sorted(n for n in g.tensors if n not in expected)
    if extra:
        raise GGUFFormatError(f"{g.source}: unexpected tensor '{extra[0]}' for a Kimi-K3 mmproj of "
                              f"{cfg.num_layers} blocks" + (f" (and {', '.join(extra[1:])})" if len(extra) > 1 else ""))
    for name, shape in expected.items():
        found = tuple(g.tensors[name].shape)
        if found != shape:
            raise GGUFFormatError(f"{g.source}: tensor '{name}' has ne {list(reversed(found))}; expected ne "
                                  f"{list(reversed(shape))} (from the clip.vision.* keys)")


def unpermute_qk(w: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """``attn_qkv`` rows [3 * H * hd, D] from the converter's order back to the HF order: in the q and k parts each
    head's rows [2 (x|y), hd/4, 2 (re, im)] become [hd/4, 2 (x|y), 2]; the v rows are as stored."""
    q = num_heads * head_dim
    qk = w[: 2 * q].reshape(2, num_heads, 2, head_dim // 4, 2, -1).transpose(0, 1, 3, 2, 4, 5)
    return np.concatenate([qk.reshape(2 * q, -1), w[2 * q:]], axis=0)


def mmproj_weights(mm: MMProj) -> dict[str, np.ndarray]:
    """The mmproj's tensors as float32 numpy arrays under their HF names, in the HF layout."""
    out = {}
    for name, hf in mm.names.items():
        w = decode_float(mm.gguf.tensors[name])
        if name.endswith(".attn_qkv.weight"):
            w = unpermute_qk(w, mm.cfg.num_heads, mm.cfg.head_dim)
        out[hf] = w
    return out


def load_mmproj(mm: MMProj, dtype: Optional[mx.Dtype] = None) -> VisionModel:
    """The tower + projector of an opened mmproj, weights cast to ``dtype`` (default float32)."""
    model = VisionModel(mm.cfg)
    load_vision_weights(model, {k: mx.array(v) for k, v in mmproj_weights(mm).items()}, dtype)
    return model


def find_mmproj(gguf: Union[str, Path]) -> Optional[Path]:
    """The ``mmproj*.gguf`` beside a text GGUF (as llama.cpp's users lay them out), None when there is none;
    ValueError naming them when there are several."""
    gguf = Path(gguf).expanduser()
    found = sorted(f for f in gguf.parent.iterdir() if MMPROJ_NAME.match(f.name) and f.is_file() and f != gguf)
    if len(found) > 1:
        raise ValueError(f"{gguf.parent}: {len(found)} mmproj files beside {gguf.name} "
                         f"({', '.join(f.name for f in found)}); pass the one to use with --mmproj FILE "
                         "(load(..., mmproj=FILE))")
    return found[0] if found else None
