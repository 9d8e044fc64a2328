"""``kimi-mlx fuse``: merge LoRA/DoRA adapters into the base model and write an MLX model directory.

    kimi-mlx fuse --model DIR|FILE.gguf --adapter-path adapters --save-path fused_model [--dequantize]

A quantized base is re-quantized to its own layout after merging (``--dequantize`` writes float weights instead). A
GGML-block base (GGUF types MLX has no layout for, kept as blocks) has no exact re-encoding: each projection with an
adapter becomes float32 (its exact dequantization + the update), the others keep their blocks (``--dequantize``:
float32 too).
The output is written like ``kimi-mlx convert`` (mlx-lm's key layout, ``config.json`` with the ``quantization``
entry, the base's tokenizer files) and loads with ``kimi_mlx.load``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .flags import DTYPES


def add_parser(commands) -> None:
    p = commands.add_parser(
        "fuse",
        description="Merge LoRA/DoRA adapters (from kimi-mlx lora or mlx_lm.lora) into a Kimi Linear / Kimi-K3 "
        "model and write an MLX model directory.",
    )
    p.add_argument("--model", required=True, help="base model directory, HF repo id, 'demo', or a GGUF")
    p.add_argument(
        "--adapter-path", default="adapters", help="directory with adapters.safetensors + adapter_config.json"
    )
    p.add_argument("--save-path", default="fused_model", help="output model directory (absent or empty)")
    p.add_argument("--dequantize", action="store_true", help="write float weights even if the base is quantized")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="float type of the base while merging and of the output (default: as kimi_mlx.load gives "
        "it: float32 on the CPU backend, as stored on the GPU)",
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    p.set_defaults(run=run)


def fuse_model(
    model_src: str, adapter_path: str, save_path: str, dequantize: bool = False, force: bool = False, dtype=None
) -> Path:
    """Load ``model_src`` (a model directory, HF repo id, 'demo' or a GGUF; float weights in ``dtype``, see
    ``kimi_mlx.load``), apply and fuse the adapters, write the MLX model directory; returns it."""
    from collections import Counter

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..convert.writer import hf_config, to_mlx_lm_layout, write_model_dir
    from ..loading import quantization_entry
    from ..tuner.adapters import adapters_on_ggml_blocks, dequantize_all, fuse_adapters, load_adapters
    from .convert import DTYPE_NAMES, _check_out, _load_source, ggml_note, keep_tower

    out = Path(save_path).expanduser()
    _check_out(out, force)
    model, cfg, base, files, _, path = _load_source(model_src, dtype)
    config = load_adapters(model, adapter_path)
    on_blocks = adapters_on_ggml_blocks(model)
    n = fuse_adapters(model, dequantize=dequantize)
    if dequantize:
        model = dequantize_all(model)
    mx.eval(model.parameters())
    params = dict(tree_flatten(model.parameters()))
    weights, quantization = to_mlx_lm_layout(params, cfg, quantization_entry(model))
    floats = Counter(v.dtype for v in params.values() if mx.issubdtype(v.dtype, mx.floating))
    torch_dtype = DTYPE_NAMES.get(floats.most_common(1)[0][0]) if floats else None
    tower = keep_tower(weights, files, path, cfg, floats.most_common(1)[0][0] if floats else mx.float32, None)
    write_model_dir(
        out,
        weights,
        hf_config(cfg, quantization=quantization, base=base, torch_dtype=torch_dtype) | tower,
        files,
        progress=False,
    )
    print(
        f"Fused {n} {config.get('fine_tune_type', 'lora')} adapters from {adapter_path} into {out} "
        f"({torch_dtype}{', quantized layout kept' if quantization else ''})"
    )
    if on_blocks:
        print(f"note: {on_blocks} of them were on GGML-block projections, written as float32 (the blocks' exact "
              "dequantization + the adapter; there is no exact re-encoding into GGML blocks)")
    note = ggml_note(quantization)
    if note:
        print(note)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        fuse_model(args.model, args.adapter_path, args.save_path, args.dequantize, args.force, DTYPES.get(args.dtype))
    except (OSError, ValueError) as e:
        print(f"kimi-mlx: error: {e}", file=sys.stderr)
        return 2
    return 0
