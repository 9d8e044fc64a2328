"""``kimi-mlx convert``: GGUF / HF directory / HF repo id / demo -> an MLX model directory.

The output (safetensors shards <= 5 GB + index, ``config.json``, tokenizer files) reloads with ``kimi_mlx.load`` to
the same logits and token ids; Kimi Linear output is in mlx-lm's converted layout, so ``mlx_lm.load`` reads it too,
unless it keeps GGML blocks: GGUF tensors in types MLX has no layout for (IQ*, Q6_K, Q3_K, Q2_K) are written as they
are (uint8 ``[..., rows, row_bytes]``, the GGUF's bytes) with a ``{"ggml_type": ...}`` override in ``quantization``
(``--requantize``: MLX affine instead, lossy).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
DTYPE_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}


class ConvertError(ValueError):
    """A bad source or destination for ``kimi-mlx convert``."""


def add_parser(commands) -> None:
    p = commands.add_parser(
        "convert",
        description="Convert a Kimi Linear / Kimi-K3 GGUF (or split set), HF directory, HF repo id or 'demo' into an "
                    "MLX model directory (safetensors + config.json + tokenizer) that kimi_mlx.load and mlx_lm.load "
                    "read.",
    )
    p.add_argument("--model", required=True, metavar="SRC",
                   help="GGUF file (any shard of a split set), model directory, HF repo id, or 'demo'")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must be absent or empty)")
    p.add_argument("--quantize", type=int, default=None, metavar="BITS",
                   help="quantize the float layers before writing (affine; 2, 3, 4, 5, 6 or 8 bits); routers and "
                        "norms stay float, layers the source already quantizes (GGML blocks included) are kept")
    p.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast float weights (default: the source's main float type; A_log, dt_bias, convs and the "
                        "router bias stay float32)")
    p.add_argument("--requantize", action="store_true",
                   help="GGUF: write the types MLX has no layout for (IQ*, Q6_K, Q3_K, Q2_K) as MLX affine (lossy; "
                        "mlx-lm reads the output) instead of their GGML blocks as they are (exact; kimi-mlx only)")
    p.add_argument("--gguf-scales", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="GGUF: dtype of the affine scales/biases (float32: bit-exact; float16/bfloat16: compact, "
                        "Q4_K/Q5_K 1 bit per weight smaller, error warned about)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="Kimi-K3: write this llama.cpp mmproj GGUF's vision tower into the output (default: the "
                        "source's own tower, or the mmproj*.gguf beside a GGUF source)")
    p.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def ggml_note(quantization: dict | None, quantize: int | None = None) -> str | None:
    """What to tell the user about a directory whose ``quantization`` entry keeps GGML blocks (None if it keeps
    none)."""
    from ..loading import ggml_overrides

    types = Counter(ggml_overrides(quantization or {}).values())
    if not types:
        return None
    held = ", ".join(f"{n} x {t}" for t, n in sorted(types.items()))
    note = (f"note: {sum(types.values())} layers keep the GGUF's GGML blocks as they are ({held}; exact, computed by "
            "kimi-mlx). kimi_mlx.load reads this directory, mlx-lm cannot; converting the GGUF with --requantize "
            "writes those layers as MLX affine instead (lossy; mlx-lm reads that).")
    if quantize is not None:
        note += f" --quantize {quantize} applied to the float layers only (the GGML blocks are kept)."
    return note


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConvertError(f"--out {out}: directory exists and is not empty (pass --force to write into it)")


def _load_source(src: str, dtype, requantize: bool = False, scale_dtype=mx.float32, progress: bool = False):
    """(model, cfg, source config.json dict or None, tokenizer files, the source's main float dtype or None, its
    path) for a GGUF (``requantize``, ``scale_dtype``: see ``load_gguf_model``), a model directory, an HF repo id or
    'demo'."""
    from ..convert.writer import TOKENIZER_FILES, tiktoken_file_text, tokenizer_config
    from ..loading import (
        ModelNotFoundError,
        load_gguf_model,
        load_model,
        resolve_model_path,
    )

    if str(src).endswith(".gguf"):
        from ..convert.gguf.reader import GGUFFile
        from ..chat.tokenizer import load_gguf_tokenizer

        path = Path(src).expanduser()
        if not path.is_file():
            raise ConvertError(f"--model {src}: no such GGUF file")
        g = GGUFFile(path)
        sizes = Counter()
        for info in g.tensors.values():
            sizes[info.type_name] += int(np.prod(info.shape))
        stored = {"F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32}.get(sizes.most_common(1)[0][0])
        wrapper = load_gguf_tokenizer(g)
        tok = wrapper._tokenizer
        model, cfg = load_gguf_model(g, dtype=dtype, requantize=requantize, scale_dtype=scale_dtype, progress=progress)
        ranks = {tok.token_bytes(i): i for i in range(tok.n_ranks)}
        files = {
            "tiktoken.model": tiktoken_file_text(ranks),
            "tokenizer_config.json": json.dumps(tokenizer_config(
                tok.special_tokens, tok._special_flagged, bos=tok.bos_token, eos=tok.eos_token, pad=tok.pad_token,
                unk=tok.unk_token, chat_template=tok.chat_template), indent=2, ensure_ascii=False) + "\n",
            "generation_config.json": json.dumps(
                {"bos_token_id": cfg.bos_token_id, "eos_token_id": sorted(wrapper.eos_token_ids)}, indent=2) + "\n",
        }
        return model, cfg, None, files, stored, path
    try:
        path = resolve_model_path(src)
    except ModelNotFoundError as e:
        raise ConvertError(f"--model: {e}") from None
    if not (path / "config.json").exists():
        raise ConvertError(f"--model {src}: {path} has no config.json (expected an HF model directory or a .gguf)")
    from ..loading import load_weights

    sizes = Counter()
    for v in load_weights(path).values():  # memory-mapped: only the dtypes are read here
        if mx.issubdtype(v.dtype, mx.floating):
            sizes[v.dtype] += v.size
    stored = sizes.most_common(1)[0][0] if sizes else None
    model, cfg = load_model(path, dtype=dtype)
    base = json.loads((path / "config.json").read_text())
    files = {name: path / name for name in TOKENIZER_FILES if (path / name).is_file()}
    return model, cfg, base, files, stored, path


def shrink_to(model, dtype) -> None:
    """Cast float parameters back to ``dtype`` where that is exact (the loader's CPU default upcasts bf16/f16 to
    float32): the source's main float type is kept without losing a bit. Parameters the model keeps in float32
    (A_log, dt_bias, convs, router bias) and quantization scales/biases are left alone."""
    casts = model.cast_predicate
    new = []
    for key, v in tree_flatten(model.parameters()):
        if (not mx.issubdtype(v.dtype, mx.floating) or v.dtype == dtype or not casts(key)
                or key.endswith((".scales", ".biases"))):
            continue
        small = v.astype(dtype)
        if mx.array_equal(small.astype(v.dtype), v).item():
            new.append((key, small))
    if new:
        model.load_weights(new, strict=False)


def convert(args: argparse.Namespace) -> Path:
    from ..convert.writer import hf_config, to_mlx_lm_layout, write_model_dir
    from ..loading import _quantization_spec, quantization_entry, quantize_model

    out = Path(args.out).expanduser()
    _check_out(out, args.force)
    spec = None
    if args.quantize is not None:
        spec = _quantization_spec({"bits": args.quantize, "group_size": args.q_group_size})
    dtype = DTYPES.get(args.dtype)
    model, cfg, base, files, stored, path = _load_source(args.model, dtype, args.requantize,
                                                         DTYPES[args.gguf_scales], progress=not args.quiet)
    if dtype is None and stored is not None:
        shrink_to(model, stored)
    if spec is not None:
        quantize_model(model, spec)
        mx.eval(model.parameters())
    params = dict(tree_flatten(model.parameters()))
    floats = Counter(v.dtype for v in params.values() if mx.issubdtype(v.dtype, mx.floating))
    torch_dtype = DTYPE_NAMES.get(floats.most_common(1)[0][0]) if floats else None
    weights, quantization = to_mlx_lm_layout(params, cfg, quantization_entry(model))
    tower = keep_tower(weights, files, path, cfg, dtype or stored or mx.float32, spec, getattr(args, "mmproj", None))
    config = hf_config(cfg, quantization=quantization, base=base, torch_dtype=torch_dtype) | tower
    write_model_dir(out, weights, config, files, max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
                    progress=not args.quiet)
    note = ggml_note(quantization, args.quantize)
    if note:
        print(note, file=sys.stderr)
    return out


def keep_tower(weights: dict, files: dict, path: Path, cfg, dtype, spec: dict | None, mmproj=None) -> dict:
    """Add K3's vision tower and projector, as ``load`` would attach them (``mmproj``, else the checkpoint
    directory's own ``vision_config`` tower, else the ``mmproj*.gguf`` beside a GGUF ``path``; nothing without one),
    to the ``weights`` and ``files`` to write: MLX parameters ``vision_tower.*``, ``mm_projector.*`` (the patch conv
    as MLX's [D, P, P, 3], as mlx-vlm writes it) in ``dtype``, and ``preprocessor_config.json``. With ``spec``
    (``--quantize``) the projector's Linears whose input width the group divides are quantized and the tower stays
    float, as mlx-vlm's convert does. Returns the config.json keys to set (an mmproj's ``vision_config``)."""
    import mlx.nn as nn

    from ..loading import checkpoint_quantization, tower_source
    from ..vision.mmproj import load_mmproj, open_mmproj
    from ..vision.model import load_vision

    if not cfg.is_k3:
        if mmproj is not None:
            raise ConvertError(f"--mmproj {mmproj}: Kimi Linear is a text-only model; an mmproj goes with Kimi-K3")
        return {}
    where = tower_source(path, mmproj)
    if isinstance(where, str):
        return {}
    if where.is_file():
        mm = open_mmproj(where)
        vision, keys = load_mmproj(mm, dtype), {"vision_config": mm.cfg.to_hf()}
        files["preprocessor_config.json"] = json.dumps(mm.preprocess.to_hf(), indent=2) + "\n"
    else:
        raw = json.loads((where / "config.json").read_text())
        vision, keys = load_vision(where, dtype, checkpoint_quantization(raw, str(where / "config.json"))), {}
        files["preprocessor_config.json"] = where / "preprocessor_config.json"
    if spec is not None:
        nn.quantize(vision, group_size=spec["group_size"], bits=spec["bits"], mode=spec["mode"],
                    class_predicate=lambda p, m: p.startswith("mm_projector.") and isinstance(m, nn.Linear)
                    and m.weight.shape[-1] % spec["group_size"] == 0)
    weights.update(tree_flatten(vision.parameters()))
    return keys


def run(args: argparse.Namespace) -> int:
    try:
        out = convert(args)
    except (OSError, ValueError) as e:
        print(f"kimi-mlx: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"wrote {out}", file=sys.stderr)
    return 0
