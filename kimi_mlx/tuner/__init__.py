"""LoRA / DoRA fine-tuning for Kimi Linear and Kimi-K3 (``kimi-mlx lora``, ``kimi-mlx fuse``).

- ``adapters``: projection groups, wrapping (mlx-lm's LoRA/DoRA layers), adapter files in mlx-lm's format, fusing.
- ``datasets``: jsonl data in mlx-lm's forms, rendered with the model's chat format.
- ``trainer``: the training loop (progress bar, metrics jsonl, checkpoints, loss curve).
"""

from .adapters import (
    PROJECTION_GROUPS,
    AdapterError,
    apply_adapters,
    fuse_adapters,
    load_adapters,
    save_adapters,
    select_modules,
)
from .datasets import DataError, load_datasets

__all__ = [
    "PROJECTION_GROUPS",
    "AdapterError",
    "DataError",
    "apply_adapters",
    "fuse_adapters",
    "load_adapters",
    "load_datasets",
    "save_adapters",
    "select_modules",
]
