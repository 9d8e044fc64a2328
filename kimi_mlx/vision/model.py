"""Tower + projector together, and strict loading from an HF Kimi-K3 directory.

``VisionModel`` has the checkpoint's top-level names (``vision_tower``, ``mm_projector``), so after ``sanitize`` the
``vision_tower.*`` / ``mm_projector.*`` tensors load with ``load_weights`` by name. One image per call.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def load_vision_weights(model: VisionModel, weights: dict[str, mx.array], dtype=None) -> None:
    """Strict: every vision tensor present once with the expected shape; a missing, extra or misshaped one is an
    error naming it. ``weights`` holds HF names; entries outside vision_tower./mm_projector. are ignored."""
    weights = VisionModel.sanitize({k: v for k, v in weights.items() if k.startswith(PREFIXES)})
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
    model.load_weights([(k, v.astype(dt)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())


def has_vision(path: str | Path) -> bool:
    """Whether the HF / MLX directory ``path`` describes a vision tower (``vision_config`` in its config.json). A
    checkpoint without one loads text-only, whatever vision tensors it holds."""
    return "vision_config" in json.loads((Path(path) / "config.json").read_text())


def load_vision(path: str | Path, dtype=None) -> VisionModel:
    """Vision tower + projector of the HF Kimi-K3 directory ``path`` (config.json's ``vision_config`` and the
    ``vision_tower.*`` / ``mm_projector.*`` tensors), strict; weights cast to ``dtype`` (default float32)."""
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
    load_vision_weights(model, weights, dtype)
    return model
