"""Cache bytes of one sequence for the released configs (README "Cache size"): ``parallel.accounting.cache_bytes`` at 128K
and 1M tokens, float (bf16) vs 8-bit vs 4-bit latent cache (affine, group 64, bf16 scales and biases), KDA state
included. Prints the Markdown table: ``python bench/cache_bytes_table.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kimi_mlx.config import KimiConfig
from kimi_mlx.parallel.accounting import GIB, cache_bytes

SHARED = Path(os.environ.get("KIMI_MLX_SHARED", Path(__file__).resolve().parents[2] / "shared"))
CONFIGS = {"Kimi-Linear-48B-A3B": "kimi-linear-48b-a3b-instruct.json", "Kimi-K3": "kimi-k3.json"}
CONTEXTS = {"128K": 2**17, "1M": 2**20}
LAYOUTS = {"bf16": None, "8-bit": 8, "4-bit": 4}
GROUP = 64


def table() -> str:
    lines = ["| model | tokens | KDA state | " + " | ".join(f"{name} cache" for name in LAYOUTS) + " |",
             "|---|---|---|" + "---|" * len(LAYOUTS)]
    for model, name in CONFIGS.items():
        cfg = KimiConfig.from_hf(json.loads((SHARED / "fixtures" / "configs" / name).read_text()))
        kda = cache_bytes(cfg, 0)
        for label, n in CONTEXTS.items():
            cells = [f"{cache_bytes(cfg, n, kv_bits=bits, kv_group_size=GROUP) / GIB:.2f} GiB"
                     for bits in LAYOUTS.values()]
            lines.append(f"| {model} | {label} | {kda / GIB:.3f} GiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
