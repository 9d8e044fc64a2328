"""Path | HF repo id | ``demo`` -> (model, tokenizer).

Reads an HF-style directory (``config.json``, ``model.safetensors`` or sharded safetensors with an index,
``tiktoken.model`` + ``tokenizer_config.json``) in Moonshot's original key layout or in mlx-lm's converted /
quantized layout (plus GGML-block modules, ``{"ggml_type": ...}`` in its ``quantization`` entry, as ``kimi-mlx
convert`` writes GGUF types MLX has no layout for), checks every tensor against the model before loading, and
optionally quantizes on load.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .chat.tokenizer import load_gguf_tokenizer, load_kimi_tokenizer
from .config import AFFINE_BITS, GROUP_SIZES, ConfigError, KimiConfig
from .convert.gguf.arch import build_config, decode_float, gguf_storage, plan_tensors
from .convert.gguf.quant import to_mlx
from .convert.gguf.reader import GGUFFile, GGUFFormatError, TensorInfo
from .convert.hf import CheckpointError
from .convert.writer import progress_bar
from .layers.ggml import ggml_type_of, holds_ggml, set_float_dtype, to_ggml
from .models.kimi_k3 import K3Model
from .ops.ggml import FORMATS as GGML_FORMATS
from .models.kimi_linear import Model
from .ops.memory import check_fits
from .parallel.health import agree
from .parallel import Opened, Select, Share, Split, load_parallel
from .parallel.pipeline import layer_bytes


log = logging.getLogger("kimi_mlx")


class ModelNotFoundError(FileNotFoundError):
    """Neither a usable local model directory nor a downloadable HF repo id."""


def resolve_model_path(path_or_id: Union[str, Path]) -> Path:
    """Local directory as is; ``demo`` -> the built-in demo model; otherwise an HF repo id via huggingface_hub."""
    if str(path_or_id) == "demo":
        from .demo import demo_model_path

        return demo_model_path()
    path = Path(path_or_id).expanduser()
    if path.exists():
        if path.is_file():
            raise ModelNotFoundError(
                f"{path}: is a file; expected a model directory holding config.json and *.safetensors"
            )
        return path
    text = str(path_or_id)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{text}: no such directory, and not an HF repo id of the form 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                text, allow_patterns=["*.json", "*.safetensors", "tiktoken.model", "*.tiktoken", "*.txt"]
            )
        )
    except Exception as e:  # huggingface_hub raises many types: offline, 404, gated, network
        raise ModelNotFoundError(
            f"{text}: not a local directory, and the Hugging Face Hub download failed ({type(e).__name__}: {e}). "
            f"Offline? Pass a local directory, or download it first with `hf download {text}`."
        ) from None


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) not present in {path}: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    return files


def load_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of a safetensors checkpoint (memory-mapped by MLX, materialised on first use)."""
    weights = {}
    for file in _safetensors_files(path):
        try:
            weights.update(mx.load(str(file)))
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read safetensors ({e})") from None
    return weights


def check_weights(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """Every parameter present with its exact shape, nothing unknown; raise CheckpointError naming the tensors."""
    expected = dict(tree_flatten(model.parameters()))
    missing = [f"{k} {tuple(v.shape)}" for k, v in expected.items() if k not in weights]
    unknown = [k for k in weights if k not in expected]
    wrong = [
        f"{k}: expected {tuple(v.shape)}, found {tuple(weights[k].shape)}"
        for k, v in expected.items()
        if k in weights and tuple(weights[k].shape) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors (with expected shape): {', '.join(missing[:10])}"
                        + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
    if unknown:
        problems.append(f"unexpected tensors: {', '.join(unknown[:10])}"
                        + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""))
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:10]))
    if problems:
        raise CheckpointError(f"{source}: checkpoint does not match the model config: " + " | ".join(problems))


def _quantization_spec(quantize) -> Optional[dict]:
    if quantize is None or quantize is False:
        return None
    spec = {"bits": quantize} if isinstance(quantize, int) else dict(quantize)
    spec.setdefault("group_size", 64)
    spec.setdefault("mode", "affine")
    if spec["mode"] == "affine" and spec.get("bits") not in AFFINE_BITS:
        raise ValueError(f"quantize bits={spec.get('bits')!r}: MLX affine quantization supports {AFFINE_BITS}")
    if spec["group_size"] not in GROUP_SIZES:
        raise ValueError(f"quantize group_size={spec['group_size']!r}: expected one of {GROUP_SIZES}")
    return spec


def checkpoint_quantization(raw: dict, source: str) -> Optional[dict]:
    """How the checkpoint stores quantized modules: mlx-lm's ``quantization`` dict (with per-path overrides; a
    ``{"ggml_type": name}`` override marks a module kept in GGML blocks, as ``kimi-mlx convert`` writes GGUF types
    MLX has no layout for), or compressed-tensors ``mxfp4-pack-quantized`` (K3's routed experts) as MLX mxfp4
    (group 32, 4 bits)."""
    if raw.get("quantization"):
        entry = raw["quantization"]
        for path, name in ggml_overrides(entry).items():
            if name not in GGML_FORMATS:
                raise CheckpointError(
                    f"{source}: quantization entry {path!r}: ggml_type {name!r} is not a GGML block type kimi-mlx "
                    f"computes; expected one of {', '.join(GGML_FORMATS)}"
                )
        return entry
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method == "compressed-tensors" and fmt == "mxfp4-pack-quantized":
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    raise CheckpointError(
        f"{source}: quantization_config quant_method={method!r} format={fmt!r} is not supported; expected "
        f"compressed-tensors 'mxfp4-pack-quantized' or an mlx-lm 'quantization' entry"
    )


def ggml_overrides(qconfig: dict) -> dict[str, str]:
    """Module path -> GGML type name of a ``quantization`` dict's ``{"ggml_type": name}`` overrides."""
    return {p: v["ggml_type"] for p, v in qconfig.items() if isinstance(v, dict) and "ggml_type" in v}


def quantization_entry(model) -> dict | None:
    """mlx-lm's ``quantization`` dict for the quantized modules of ``model``: the most common
    (group_size, bits, mode) as the default, every module that differs as a per-path override; GGML-block layers
    as ``{"ggml_type": name}`` overrides (no default when nothing is MLX-quantized)."""
    specs, overrides = {}, {}
    for path, module in model.named_modules():
        if (ggml_type := ggml_type_of(module)) is not None:
            overrides[path] = {"ggml_type": ggml_type}
        elif hasattr(module, "scales") and hasattr(module, "bits") and hasattr(module, "group_size"):
            specs[path] = (module.group_size, module.bits, getattr(module, "mode", "affine"))
    entry: dict = {}
    if specs:
        default = Counter(specs.values()).most_common(1)[0][0]
        entry = {"group_size": default[0], "bits": default[1], "mode": default[2]}
        overrides.update({path: {"group_size": spec[0], "bits": spec[1], "mode": spec[2]}
                          for path, spec in specs.items() if spec != default})
    entry.update(sorted(overrides.items()))
    return entry or None


def _to_ggml_checked(model: nn.Module, weights: dict, types: dict[str, str], source: str) -> None:
    """``to_ggml`` for the modules the checkpoint keeps in GGML blocks; each one's stored weight must be uint8 of the
    block layer's shape ([..., rows, row_bytes] for the module's input width), else CheckpointError naming it."""
    try:
        to_ggml(model, types)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: GGML-block module: {e}") from None
    modules = dict(model.named_modules())
    for path, name in sorted(types.items()):
        stored, want = weights.get(f"{path}.weight"), modules[path]["weight"]
        if stored is not None and (stored.dtype != mx.uint8 or stored.shape != want.shape):
            fmt = GGML_FORMATS[name]
            cols = want.shape[-1] // fmt.type_bytes * fmt.block_elems
            raise CheckpointError(
                f"{source}: tensor {path}.weight: {name} blocks of {cols}-wide rows ({want.shape[-1]} bytes per row) "
                f"expected as uint8 {tuple(want.shape)}, found {str(stored.dtype).rpartition('.')[2]} "
                f"{tuple(stored.shape)}"
            )


def _apply_checkpoint_quantization(model: nn.Module, weights: dict, qconfig: dict, source: str) -> None:
    """Turn the modules that the checkpoint stores quantized into quantized ones (``*.scales`` present) and those it
    keeps in GGML blocks (``{"ggml_type": ...}`` overrides) into GGML-block layers."""
    ggml = ggml_overrides(qconfig)
    if ggml:
        _to_ggml_checked(model, weights, ggml, source)

    def quantizes(path: str, module: nn.Module):
        if path in ggml or f"{path}.scales" not in weights:
            return False
        override = qconfig.get(path)
        return override if isinstance(override, dict) else True

    nn.quantize(
        model, group_size=qconfig.get("group_size", 64), bits=qconfig.get("bits", 4),
        mode=qconfig.get("mode", "affine"), class_predicate=quantizes,
    )


def quantize_model(model: nn.Module, spec: dict) -> None:
    """On-load quantization; routers, norms and layers whose input width the group size does not divide stay float."""
    quantizable = model.quant_predicate

    def quantizes(path: str, module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return quantizable(path, module) and weight is not None and weight.shape[-1] % spec["group_size"] == 0

    nn.quantize(model, group_size=spec["group_size"], bits=spec["bits"], mode=spec["mode"], class_predicate=quantizes)


def load_model(
    path: Path, dtype: Optional[mx.Dtype] = None, quantize=None, lazy: bool = False
) -> tuple[Union[Model, K3Model], KimiConfig]:
    """Build the model for ``path``'s config and load its weights (checked); see ``load``.

    lazy: leave the weights unevaluated (nothing is read from the files yet: a later split of the model then reads
    only the tensors it keeps).
    """
    raw = _read_config(path)
    cfg = KimiConfig.from_hf(raw, source=str(path / "config.json"))
    spec = _quantization_spec(quantize)
    source = str(path)
    qconfig = checkpoint_quantization(raw, str(path / "config.json"))
    weights = load_weights(path)
    fused_qkv = any(".self_attn.qkv_proj." in k for k in weights)
    model = (K3Model if cfg.is_k3 else Model)(cfg, fused_qkv=fused_qkv)
    weights = model.sanitize(weights)
    if qconfig:
        _apply_checkpoint_quantization(model, weights, qconfig, source)
    check_weights(model, weights, source)
    if dtype is None and mx.default_device() == mx.cpu:
        dtype = mx.float32  # MLX's CPU backend runs float32 fastest, and its gather_mm (experts) is float32-only
    if dtype is not None:
        casts = model.cast_predicate
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and (casts(k) or dtype == mx.float32) else v
            for k, v in weights.items()
        }
    model.load_weights(list(weights.items()), strict=True)
    set_float_dtype(model, _float_dtype(model))
    if spec is not None:
        quantize_model(model, spec)
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    return model, cfg


def _float_dtype(model: nn.Module) -> mx.Dtype:
    """A loaded model's float dtype: that of its first norm (norms take ``dtype``, or the checkpoint's; only what
    ``cast_predicate`` does not cast stays float32)."""
    return model.layers[0].input_layernorm.weight.dtype


def _cast(dtype: Optional[mx.Dtype], casts, param: str, value: mx.array) -> mx.array:
    """Cast a float tensor to ``dtype`` where ``casts(param)`` (the model's ``cast_predicate``), else to float32."""
    if dtype is None or not mx.issubdtype(value.dtype, mx.floating):
        return value
    return value.astype(dtype) if casts(param) or dtype == mx.float32 else value.astype(mx.float32)


@dataclass
class TensorRows:
    """Rows ``rows`` of the outermost dimension of a GGUF tensor (e.g. some experts of a stacked ``*_exps`` tensor),
    read as a slice of its mapped bytes: the other rows are never touched. Quantization blocks run along the last
    dimension, so any outer row range is whole blocks. Stands in for the tensor's ``TensorInfo`` when decoding."""

    info: TensorInfo
    rows: range

    def __post_init__(self):
        n = self.info.shape[0] if len(self.info.shape) > 1 else 0
        if self.rows.step != 1 or not 0 <= self.rows.start <= self.rows.stop <= n:
            raise ValueError(f"tensor '{self.info.name}' {tuple(self.info.shape)}: cannot read rows {self.rows}; "
                             f"expected a contiguous range within its outermost dimension (0..{n})")

    name = property(lambda self: self.info.name)
    qtype = property(lambda self: self.info.qtype)
    type_name = property(lambda self: self.info.type_name)
    file = property(lambda self: self.info.file)
    shape = property(lambda self: (len(self.rows), *self.info.shape[1:]))

    def raw(self):
        data = self.info.raw()
        per_row = data.nbytes // self.info.shape[0]
        return data[self.rows.start * per_row : self.rows.stop * per_row]

    def release(self) -> None:
        self.info.release()


def load_gguf_model(
    g: GGUFFile, dtype: Optional[mx.Dtype] = None, requantize: bool = False, keep_quantized: bool = True,
    scale_dtype: mx.Dtype = mx.float32, progress: bool = False, select: Optional[Select] = None,
) -> tuple[Union[Model, K3Model], KimiConfig]:
    """Build the model for an open GGUF (single file or split set) and load its weights.

    Metadata, tensor names and shapes are all checked before any weight is decoded. Quantized GGUF tensors become
    MLX quantized layers via ``quant.to_mlx`` where MLX has an exact layout (Q8_0, Q4_K, ...); the types it has none
    for (Q6_K, Q3_K, Q2_K, IQ*: ``quant.GGML_BLOCKS``) keep the file's blocks in GGML-block layers
    (``layers.ggml``, computed exactly), unless ``requantize`` re-quantizes them to MLX affine (lossy, warned).
    Tensors whose module stays float (routers, norms, convs, AttnRes scores; MLA's per-head ``embed_q`` /
    ``unembed_out`` for GGML-block types) or all of them with ``keep_quantized=False`` are decoded exactly.
    ``scale_dtype``: affine scales/biases in float32 (bit-exact for the exact types) or float16/bfloat16
    (compact: Q4_K 5 instead of 6 bits per weight; one warning states the error bound per type).
    Each tensor's file pages are dropped from the resident set once copied, so peak RSS ~ the model's size.
    ``progress``: a bar over the tensor bytes on stderr.
    ``select(param)`` (for one rank of a distributed model, see ``kimi_mlx.parallel``): False: the parameter is not
    decoded at all (it keeps the built model's unevaluated placeholder, which the rank's split then drops); True:
    whole; a ``range``: only those rows of its outermost dimension (the experts of a stacked
    ``switch_mlp.{gate,up,down}_proj`` tensor) are read from the file, and the parameter holds just them.
    """
    cfg = build_config(g)
    model = (K3Model if cfg.is_k3 else Model)(cfg)
    plan = plan_tensors(g, cfg, {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())})
    if dtype is None and mx.default_device() == mx.cpu:
        dtype = mx.float32
    stored, built = _selected_tensors(g, plan, select)
    loaded = _GGUFWeights(model, dtype, requantize, keep_quantized, scale_dtype)
    # the bar counts the tensors taken as stored (all but a few small ones: A_log, short convs, legacy kv_b)
    bar = progress_bar(sum(i.raw().nbytes for i in stored.values()), f"loading {Path(g.source).name}", "B", progress)
    for param, info in stored.items():
        bar.update(info.raw().nbytes)
        loaded.add_stored(param, info)
    for param, build in built.items():
        loaded.add_built(param, build)
    bar.close()
    for param, shape in plan.ones.items():
        if select is None or select(param):
            loaded.add_ones(param, shape)
    if loaded.inexact:
        detail = ", ".join(f"{t}: {n} tensors, max abs error <= {e:.3g}"
                           for t, (n, e) in sorted(loaded.inexact.items()))
        warnings.warn(f"{g.source}: not bit-exact in MLX ({detail}; scales {scale_dtype})", stacklevel=2)
    _take_gguf_weights(model, loaded, g.source, whole=select is None)
    set_float_dtype(model, dtype or mx.float32)  # float tensors decode to float32 and are cast to dtype when given
    model.eval()
    mx.eval(loaded.weights)
    return model, cfg


def _selected_tensors(g: GGUFFile, plan, select: Optional[Select]) -> tuple[dict, dict]:
    """The parts of ``plan`` (``plan_tensors``) that ``select`` wants (all without it): ``{param: TensorInfo or
    TensorRows}`` of the tensors taken as stored, ``{param: build}`` of those built from several GGUF tensors (which
    must be wanted whole)."""
    stored, built = {}, {}
    for param, info in plan.direct.items():
        rows = True if select is None else select(param)
        if isinstance(rows, range):
            stored[param] = TensorRows(info, rows)
        elif rows:
            stored[param] = info
    for param, build in plan.built.items():
        rows = True if select is None else select(param)
        if isinstance(rows, range):
            raise ValueError(f"{g.source}: select({param!r}) asked for rows, but {param} is built from several GGUF "
                             "tensors; rows can only be read from a stacked tensor taken as stored (routed experts)")
        if rows:
            built[param] = build
    return stored, built


class _GGUFWeights:
    """A GGUF's tensors as the weights of ``model``, one parameter at a time: each is evaluated as soon as it is
    added and the file pages read for it leave the resident set then. What the model needs to take them:
    ``weights`` (parameter -> array), ``qspecs`` (module path -> MLX quantization of the layers to quantize),
    ``ggml_types`` (module path -> GGML type of the blocks it keeps) and ``inexact`` (GGML type -> [tensor count,
    max abs error] of the MLX layouts that are not bit-exact)."""

    def __init__(self, model: nn.Module, dtype: Optional[mx.Dtype], requantize: bool, keep_quantized: bool,
                 scale_dtype: mx.Dtype):
        self.dtype, self.scale_dtype = dtype, scale_dtype
        self.requantize, self.keep_quantized = requantize, keep_quantized
        self.casts, self.quantizable = model.cast_predicate, model.quant_predicate
        self.modules = dict(tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)))
        self.weights: dict[str, mx.array] = {}
        self.qspecs: dict[str, dict] = {}
        self.ggml_types: dict[str, str] = {}
        self.inexact: dict[str, list] = {}
        self._read: list = []  # tensors read for the parameter being added

    def decode(self, info) -> np.ndarray:
        """``info`` decoded to float32 (``decode_float``); its pages are released once the parameter is added."""
        self._read.append(info)
        return decode_float(info)

    def add_stored(self, param: str, info) -> None:
        """A tensor taken as stored: GGML blocks, an MLX quantized layout or float, as ``gguf_storage`` decides."""
        path = param.rsplit(".", 1)[0]
        module = self.modules.get(path)
        storage = gguf_storage(
            info.type_name, self.keep_quantized and param.endswith(".weight") and module is not None
            and self.quantizable(path, module), module is not None and holds_ggml(module), self.requantize,
        )
        if storage == "blocks":
            # no MLX layout: the file's blocks, as they are ([..., rows, row_bytes] uint8), computed exactly
            self._read.append(info)
            self._add(param, mx.array(np.asarray(info.raw()).reshape(*info.shape[:-1], -1)))
            self.ggml_types[path] = info.type_name
        elif storage == "mlx":
            self._read.append(info)
            self._add_mlx_layout(param, path, info)
        else:
            self._add(param, _cast(self.dtype, self.casts, param, mx.array(self.decode(info))))

    def add_built(self, param: str, build) -> None:
        """A parameter built from several GGUF tensors (``build(decode)``), as float."""
        self._add(param, _cast(self.dtype, self.casts, param, mx.array(build(self.decode))))

    def add_ones(self, param: str, shape: tuple) -> None:
        """A parameter the GGUF does not store, all ones."""
        self.weights[param] = _cast(self.dtype, self.casts, param, mx.ones(shape))

    def _add_mlx_layout(self, param: str, path: str, info) -> None:
        layout = to_mlx(info.name, info.qtype, info.raw(), tuple(info.shape), requantize=self.requantize,
                        scale_dtype=self.scale_dtype)
        if not layout["exact"]:
            count = self.inexact.setdefault(info.type_name, [0, 0.0])
            count[0], count[1] = count[0] + 1, max(count[1], layout["max_abs_error"])
        self.qspecs[path] = {"group_size": layout["group_size"], "bits": layout["bits"], "mode": layout["mode"]}
        self.weights[param] = layout["weight"]
        for extra in ("scales", "biases"):
            if extra in layout:  # float32 scales/biases keep the exact types exact, whatever ``dtype``
                self.weights[f"{path}.{extra}"] = layout[extra]
                mx.eval(layout[extra])  # a lazy cast would keep its float32 source alive until the end
        self._add(param, layout["weight"])

    def _add(self, param: str, value: mx.array) -> None:
        self.weights[param] = value
        mx.eval(value)
        for info in self._read:
            info.release()
        self._read.clear()


def _take_gguf_weights(model: nn.Module, loaded: _GGUFWeights, source: str, whole: bool) -> None:
    """Make ``model``'s quantized and GGML-block layers, check the weights against it when it is loaded ``whole``
    (not one rank's part) and load them."""
    if loaded.qspecs:
        nn.quantize(model, class_predicate=lambda p, m: loaded.qspecs.get(p, False))
    if loaded.ggml_types:
        to_ggml(model, loaded.ggml_types)
    if whole:
        try:
            check_weights(model, loaded.weights, source)
        except CheckpointError as e:
            raise GGUFFormatError(str(e)) from None
    model.load_weights(list(loaded.weights.items()), strict=whole)  # plan_tensors checked every shape


def _gguf_layer_bytes(g: GGUFFile, dtype, quantize, scale_dtype, requantize: bool) -> list[int]:
    """Bytes of each decoder layer of a GGUF as ``load`` will hold it (from the header: what ``kimi-mlx plan``
    counts, so a memory-proportional pipeline split is the one it predicts)."""
    from .parallel.accounting import QuantSpec, account_gguf

    spec = _quantization_spec(quantize)
    names = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
    return account_gguf(g, dtype=names.get(dtype), quantize=spec and QuantSpec(**spec),
                        scale_dtype=names[scale_dtype], requantize=requantize).layer_bytes()


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{file}: missing (expected an HF model directory)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return raw


def load(
    path_or_hf_id: Union[str, Path], dtype: Optional[mx.Dtype] = None, quantize=None, requantize: bool = False,
    gguf_scale_dtype: mx.Dtype = mx.float32, adapter_path: Optional[Union[str, Path]] = None,
    progress: bool = False, parallel: Optional[str] = None, group: Optional[mx.distributed.Group] = None,
    split: Split = None, mmproj: Optional[Union[str, Path]] = None,
):
    """``(model, tokenizer)`` like ``mlx_lm.load``; a Kimi-K3 model with a vision tower carries
    ``model.image_encoder`` (else None, and ``model.no_images_reason``).

    dtype: cast float weights (e.g. ``mx.float32``); router bias, A_log, dt_bias and conv weights stay float32.
        Default: as stored on the GPU, float32 on the CPU backend.
    quantize: None, bits (int), or ``{"bits", "group_size", "mode"}`` for on-load affine quantization.
    requantize: GGUF only: re-quantize the types MLX has no layout for (Q6_K, Q3_K, Q2_K, IQ*) to MLX affine (lossy,
        warned with the error) instead of keeping their blocks (exact, the default).
    gguf_scale_dtype: GGUF only: dtype of the affine scales/biases: float32 (bit-exact) or float16/bfloat16
        (compact; the error is warned about).
    adapter_path: a LoRA/DoRA adapter directory (``adapters.safetensors`` + ``adapter_config.json``, from
        ``kimi-mlx lora`` or ``mlx_lm.lora``) applied on top; an adapter for another model is an ``AdapterError``.
    progress: GGUF only: a progress bar over the tensor bytes on stderr.
    parallel: None (one process), "pipeline" (each rank holds a contiguous range of layers) or "tensor" (heads,
        widths and experts split across ranks); run every rank with ``mlx.launch``. On every rank ``model(inputs,
        cache)`` returns the full logits and ``model.make_cache()`` the rank's part of the cache. Each rank reads
        only the weights it keeps.
    group: the ``mx.distributed`` group to split over (default ``mx.distributed.init()``); a group of size 1 loads
        the plain single-process model.
    split: pipeline only: None (layers in proportion to each rank's memory), "even", or layer counts per rank
        (``[20, 7]`` or ``"20,7"``).
    mmproj: Kimi-K3: llama.cpp's mmproj GGUF (the vision tower and projector) to use with any text source, in place
        of the checkpoint's own tower. Without it: the checkpoint directory's tower (``vision_config``), or for a
        GGUF the ``mmproj*.gguf`` beside it (several there: ValueError asking for one). With ``parallel``, only
        rank 0 reads the tower.
    """
    if mmproj is not None:
        from .vision.mmproj import open_mmproj

        open_mmproj(mmproj)  # its header and tensor list checked before any text weight is read
    gguf = str(path_or_hf_id).endswith(".gguf")  # one GGUF, or any shard of a -0000k-of-0000N.gguf split set
    if gguf:
        def open_model() -> Opened:
            g = GGUFFile(Path(path_or_hf_id).expanduser())
            tokenizer = load_gguf_tokenizer(g)  # validates the tokenizer metadata before any weight is read
            tensors = [(n, i.shape, i.type_name) for n, i in g.tensors.items()]
            return Opened(build_config(g), lambda: _gguf_layer_bytes(g, dtype, quantize, gguf_scale_dtype, requantize),
                          (g.values, tensors, g.files), {"gguf": g, "tokenizer": tokenizer})
    else:
        def open_model() -> Opened:
            path = resolve_model_path(path_or_hf_id)
            model, cfg = load_model(path, dtype=dtype, quantize=quantize, lazy=True)
            tokenizer = load_kimi_tokenizer(path)
            tensors = [(k, v.shape, v.dtype) for k, v in tree_flatten(model.parameters())]
            return Opened(cfg, lambda: layer_bytes(model), (_read_config(path), tensors, _safetensors_files(path)),
                          {"path": path, "model": model, "tokenizer": tokenizer})

    read_weights = _read_gguf_weights(dtype, quantize, requantize, gguf_scale_dtype, progress) if gguf else \
        _read_lazy_weights
    model, opened = load_parallel(parallel, group, split, adapter_path, open_model, read_weights)
    tokenizer = opened.state["tokenizer"]
    source = Path(path_or_hf_id).expanduser() if gguf else opened.state.get("path")
    _attach_images(model, tokenizer, source, mmproj, opened.group, everywhere=parallel == "tensor")
    return _with_adapters(model, adapter_path), tokenizer


def load_draft(path_or_hf_id: Union[str, Path], tokenizer, **options) -> nn.Module:
    """A draft model for speculative decoding (``stream_generate(..., draft=model)``), loaded like ``load(path,
    **options)`` (any format; ``dtype``, ``quantize`` etc. as there; one process: no ``parallel``). Its tokenizer
    must have ``tokenizer``'s vocabulary (the same ids for the same tokens and specials), else ValueError naming the
    path and what differs. A vision tower the checkpoint carries is dropped (a draft reads token ids only)."""
    if options.get("parallel") is not None:
        raise ValueError(f"{path_or_hf_id}: a draft model is loaded in one process (parallel= is not supported)")
    model, draft_tokenizer = load(path_or_hf_id, **options)
    problem = vocabulary_difference(draft_tokenizer, tokenizer)
    if problem:
        raise ValueError(f"{path_or_hf_id}: the draft model's tokenizer differs from the target's ({problem}); a "
                         "draft model must share the target's tokenizer")
    model.image_encoder = None
    model.no_images_reason = "a draft model takes no images (it drafts from token ids)"
    return model


def vocabulary_difference(tokenizer, reference) -> Optional[str]:
    """What differs between two tokenizers' vocabularies (size, then the first ids whose token differs), or None."""
    if tokenizer.vocab_size != reference.vocab_size:
        return f"vocabulary of {tokenizer.vocab_size} ids, the target's {reference.vocab_size}"
    mine, theirs = tokenizer.get_vocab(), reference.get_vocab()
    if mine == theirs:
        return None
    mine_by_id, theirs_by_id = ({i: t for t, i in v.items()} for v in (mine, theirs))
    differ = sorted(i for i in mine_by_id.keys() | theirs_by_id.keys() if mine_by_id.get(i) != theirs_by_id.get(i))
    shown = ", ".join(f"id {i}: {mine_by_id.get(i)!r} vs the target's {theirs_by_id.get(i)!r}" for i in differ[:3])
    return f"{len(differ)} ids name other tokens ({shown}{', ...' if len(differ) > 3 else ''})"


def _attach_images(model: nn.Module, tokenizer, source: Optional[Path], mmproj, group, everywhere: bool) -> None:
    """``model.image_encoder`` on every rank (see ``_attach_image_encoder``), a step all ranks pass or fail
    together; on a group of several ranks it shares rank 0's features (``parallel.images.GroupImageEncoder``;
    ``everywhere``: every rank embeds, as under tensor parallelism)."""
    with agree(group, "loading the vision tower"):
        encoder = _attach_image_encoder(model, tokenizer, source, mmproj, group)
    if encoder is not None and group is not None and group.size() > 1:
        from .parallel.images import GroupImageEncoder

        model.image_encoder = GroupImageEncoder(group, encoder, everywhere)


def _attach_image_encoder(model: nn.Module, tokenizer, source: Optional[Path], mmproj=None,
                          group: Optional[mx.distributed.Group] = None):
    """``model.image_encoder`` (also returned): an ``ImageEncoder`` over K3's vision tower from ``mmproj`` (a
    llama.cpp mmproj GGUF, replacing any tower of the checkpoint), else the checkpoint directory's own tower
    (``vision_config`` + ``vision_tower.*``), else an ``mmproj*.gguf`` beside a GGUF ``source``; None, with
    ``model.no_images_reason`` saying why images are refused, when there is none. On ranks > 0 of ``group`` the
    encoder holds the tower's config and preprocessing but no weights (nothing of the tower is read there)."""
    from .vision.encoder import ImageEncoder

    model.image_encoder = None
    if not model.args.is_k3:
        if mmproj is not None:
            raise ValueError(f"mmproj {mmproj}: Kimi Linear is a text-only model; an mmproj (vision tower) goes "
                             "with a Kimi-K3 model")
        model.no_images_reason = "Kimi Linear is a text-only model: it takes no images"
        return None
    tower = tower_source(source, mmproj)
    if isinstance(tower, str):
        model.no_images_reason = tower
        return None
    dtype = _float_dtype(model)
    vision, cfg, preprocess = read_tower(tower, dtype, group is None or group.rank() == 0)
    if cfg.text_hidden_size != model.args.hidden_size:
        raise ValueError(f"{tower}: the vision projector's output width is {cfg.text_hidden_size}, the text model's "
                         f"hidden size {model.args.hidden_size}: this vision tower belongs to another model")
    placeholder = _placeholder_id(tokenizer, source)
    model.image_encoder = ImageEncoder(vision, preprocess, placeholder, dtype, str(tower), cfg=cfg)
    return model.image_encoder


def tower_source(source: Optional[Path], mmproj) -> Union[Path, str]:
    """Where the vision tower comes from (an mmproj GGUF, or a checkpoint directory), or why there is none."""
    from .vision.mmproj import find_mmproj, mmproj_file
    from .vision.model import PREFIXES, has_vision

    if mmproj is not None:
        return mmproj_file(mmproj)
    if source is None:
        return "this checkpoint has no vision tower: images are unavailable"
    if source.suffix == ".gguf":
        found = find_mmproj(source)
        if found is not None:
            log.info("vision tower: %s (found beside %s)", found, source.name)
            return found
        return (f"{source} has no vision tower (a GGUF holds the text model; no mmproj*.gguf lies beside it): "
                "images are unavailable; pass --mmproj FILE (load(..., mmproj=FILE)) to add llama.cpp's mmproj")
    if has_vision(source):
        return source
    from .parallel.accounting import checkpoint_tensor_names

    stray = sum(k.removeprefix("language_model.").startswith(PREFIXES)
                for k in checkpoint_tensor_names(source) or ())
    if stray:
        log.warning("note: %s holds %d vision tower / projector tensors but its config.json has no vision_config: "
                    "they are ignored, the model loads text-only and images are unavailable", source, stray)
    return (f"{source} has no vision tower (no vision_config in config.json): images are unavailable; pass "
            "--mmproj FILE (load(..., mmproj=FILE)) to add llama.cpp's mmproj")


def read_tower(tower: Path, dtype: mx.Dtype, read: bool):
    """(VisionModel or None, VisionConfig, VisionPreprocessConfig) of an mmproj GGUF or a checkpoint directory;
    the weights only when ``read``."""
    from .vision.config import VisionConfig
    from .vision.mmproj import load_mmproj, open_mmproj
    from .vision.model import load_vision
    from .vision.preprocess import VisionPreprocessConfig

    if tower.is_file():
        mm = open_mmproj(tower)
        return (load_mmproj(mm, dtype) if read else None), mm.cfg, mm.preprocess
    raw = _read_config(tower)
    cfg = VisionConfig.from_hf(raw, source=str(tower / "config.json"))
    preprocess = VisionPreprocessConfig.from_file(tower / "preprocessor_config.json")
    quantization = checkpoint_quantization(raw, str(tower / "config.json"))
    return (load_vision(tower, dtype, quantization) if read else None), cfg, preprocess


K3_MEDIA_PAD_SLOT = 21  # <|media_pad|> is K3's control token [BOS] + 21 (163605 = 163584 + 21 in the release)


def _placeholder_id(tokenizer, source: Optional[Path]) -> int:
    """The token an image row takes in a prompt: the tokenizer's ``<|media_pad|>``; else the checkpoint's
    ``media_placeholder_token_id``; else, for a tokenizer whose control table leaves that slot unnamed
    (``<|reserved_token_21|>``, as K2-era tables do), K3's slot [BOS] + 21 (with a note)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    tid = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    if tid is not None and tid != unk:
        return tid
    if source is not None and source.is_dir() and "media_placeholder_token_id" in (raw := _read_config(source)):
        return int(raw["media_placeholder_token_id"])
    bos = getattr(tokenizer, "bos_token_id", None)
    slot = None if bos is None else bos + K3_MEDIA_PAD_SLOT
    name = tokenizer.convert_ids_to_tokens(slot) if slot is not None else None
    if name != f"<|reserved_token_{K3_MEDIA_PAD_SLOT}|>":
        raise ValueError(f"{source}: the tokenizer has no <|media_pad|> token (K3's image placeholder) and its "
                         f"slot [BOS] + {K3_MEDIA_PAD_SLOT} holds {name!r}: cannot place images in a prompt")
    log.warning("note: the tokenizer has no <|media_pad|>; images take id %d (%s, K3's media_pad slot)", slot, name)
    return slot


def _read_gguf_weights(dtype, quantize, requantize: bool, scale_dtype, progress: bool):
    """``load_parallel``'s second step for a GGUF: decode this rank's tensors (``share.select``), split, quantize."""

    def read(opened: Opened, share: Optional[Share], group) -> nn.Module:
        g = opened.state["gguf"]
        model, _ = load_gguf_model(g, dtype=dtype, requantize=requantize, scale_dtype=scale_dtype, progress=progress,
                                   select=None if share is None else share.select)
        if share is not None:
            model = share.apply(model)
        if quantize is not None and quantize is not False:
            quantize_model(model, _quantization_spec(quantize))
        _check_working_set(model, g.source, group)
        return model

    return read


def _read_lazy_weights(opened: Opened, share: Optional[Share], group) -> nn.Module:
    """``load_parallel``'s second step for a checkpoint directory: split the lazy model, then read its weights."""
    path, model = opened.state["path"], opened.state["model"]
    if share is not None:
        model = share.apply(model)  # before evaluating: only the rank's weights are read
    _check_working_set(model, str(path), group)  # sizes are known before the weights are read
    mx.eval(model.parameters())
    return model


def _check_working_set(model: nn.Module, source: str, group: Optional[mx.distributed.Group]) -> None:
    """Warn when the weights this process holds take more than ``ops.memory.FILL`` of the Mac's GPU working set
    (with the ``iogpu.wired_limit_mb`` value that fixes it); nothing without a Metal GPU."""
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    where = f"{source} (rank {group.rank()} of {group.size()})" if group is not None and group.size() > 1 else source
    check_fits(nbytes, where)


def _with_adapters(model: nn.Module, adapter_path: Optional[Union[str, Path]]) -> nn.Module:
    """``model`` with the adapters of ``adapter_path`` (if any) loaded, in eval mode."""
    if adapter_path is not None:
        from .tuner.adapters import load_adapters

        load_adapters(model, adapter_path)
        model.eval()
    return model
