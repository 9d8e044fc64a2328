"""Tower + projector together, and strict loading from an HF Kimi-K3 directory.

``VisionModel`` has the checkpoint's top-level names (``vision_tower``, ``mm_projector``), so after ``sanitize`` the
``vision_tower.*`` / ``mm_projector.*`` tensors load with ``load_weights`` by name. One image per call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import VisionConfig
from .projector import Projector
from .tower import VisionTower

PREFIXES = ("vision_tower.", "mm_projector.")


class VisionModel(nn.Module):
    """pixel_values [N, 3, P, P] + grid_thw (t, h, w) of one image -> image features [N/(kh*kw), text_hidden]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg)
        self.mm_projector = Projector(cfg)

    def __call__(self, pixel_values: mx.array, grid_thw) -> mx.array:
        return self.mm_projector(self.vision_tower(pixel_values, grid_thw))

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF layout -> MLX layout: the patch conv weight [D, 3, P, P] (torch OIHW) becomes [D, P, P, 3] (OHWI)."""
        out = dict(weights)
        key = "vision_tower.patch_embed.proj.weight"
        w = out.get(key)
        if w is not None and w.ndim == 4 and w.shape[1] == 3 and w.shape[3] != 3:
            out[key] = w.transpose(0, 2, 3, 1)
        return out


def _vision_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted({f for k, f in weight_map.items() if k.startswith(PREFIXES)})
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def load_vision_weights(model: VisionModel, weights: dict[str, mx.array], dtype=None,
                        quantization: Optional[dict] = None) -> None:
    """Strict: every vision tensor present once with the expected shape; a missing, extra or misshaped one is an
    error naming it. ``weights`` holds HF names; entries outside vision_tower./mm_projector. are ignored.
    MLX-quantized modules (``<module>.scales`` present, as mlx-vlm's convert writes the projector) are made
    quantized first with ``quantization`` (mlx-lm's entry: ``group_size``, ``bits``, ``mode``, per-module
    overrides). Float tensors are cast to ``dtype`` (default float32)."""
    weights = VisionModel.sanitize({k: v for k, v in weights.items() if k.startswith(PREFIXES)})
    _quantize_stored(model, weights, quantization)
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"vision checkpoint: missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more: "
                         f"{', '.join(missing[1:])})" if len(missing) > 1 else ""))
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ValueError(f"vision checkpoint: unexpected tensor {extra[0]}" + (f" (and {len(extra) - 1} more: "
                         f"{', '.join(extra[1:])})" if len(extra) > 1 else ""))
    for name, want in expected.items():
        if tuple(weights[name].shape) != tuple(want.shape):
            raise ValueError(f"vision checkpoint: tensor {name} has shape {tuple(weights[name].shape)}; "
                             f"expected {tuple(want.shape)} (after layout conversion)")
    dt = dtype if dtype is not None else mx.float32
    model.load_weights([(k, v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v)
                        for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())


def _quantize_stored(model: VisionModel, weights: dict[str, mx.array], quantization: Optional[dict]) -> None:
    """Quantize the modules whose ``.scales`` the checkpoint holds, as ``quantization`` says."""
    paths = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    if not paths:
        return
    if not quantization:
        raise ValueError(f"vision checkpoint: tensor {paths[0]}.scales is MLX-quantized but config.json has no "
                         "'quantization' entry (group_size, bits) to read it with")
    modules = dict(model.named_modules())
    for path in paths:
        if not hasattr(modules.get(path), "to_quantized"):
            raise ValueError(f"vision checkpoint: unexpected tensor {path}.scales ({path} is not a quantizable "
                             "Linear of the tower or projector)")

    def spec(path: str, module: nn.Module):
        if path not in paths:
            return False
        override = quantization.get(path)
        return override if isinstance(override, dict) else True

    nn.quantize(model, group_size=quantization.get("group_size", 64), bits=quantization.get("bits", 4),
                mode=quantization.get("mode", "affine"), class_predicate=spec)


def has_vision(path: str | Path) -> bool:
    """Whether the HF / MLX directory ``path`` describes a vision tower (``vision_config`` in its config.json). A
    checkpoint without one loads text-only, whatever vision tensors it holds."""
    return "vision_config" in json.loads((Path(path) / "config.json").read_text())


def load_vision(path: str | Path, dtype=None, quantization: Optional[dict] = None) -> VisionModel:
    """Vision tower + projector of the HF Kimi-K3 directory ``path`` (config.json's ``vision_config`` and the
    ``vision_tower.*`` / ``mm_projector.*`` tensors), strict; float weights cast to ``dtype`` (default float32);
    ``quantization``: the checkpoint's mlx-lm entry, for MLX-quantized vision modules."""
    path = Path(path)
    cfg = VisionConfig.from_hf(json.loads((path / "config.json").read_text()), source=str(path / "config.json"))
    model = VisionModel(cfg)
    weights: dict[str, mx.array] = {}
    for f in _vision_files(path):
        for k, v in mx.load(str(f)).items():
            if k.startswith(PREFIXES):
                if k in weights:
                    raise ValueError(f"vision checkpoint: tensor {k} appears in more than one file")
                weights[k] = v
    load_vision_weights(model, weights, dtype, quantization)
    return model
