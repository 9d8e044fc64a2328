"""Bytes of every parameter of a model as ``load`` holds it, and of its cache: ``account_config`` (a
``config.json``, optionally with the checkpoint's tensor names), ``account_gguf`` (a GGUF header), ``cache_bytes``.

The parameters come from the model's own module tree built for the config with unevaluated weights (``parameters``):
names and shapes as in ``model.parameters()``, how ``load`` stores each (the model's ``cast_predicate`` /
``quant_predicate``, the checkpoint's quantization entry, the GGUF types through ``quant.mlx_layout``) and how tensor
parallelism splits each (``shard.TENSOR_SPLITS``). The tests check the bytes against loaded models' ``nbytes``,
parameter by parameter.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear

from ..config import KimiConfig
from ..layers.ggml import holds_ggml
from ..models.kimi_k3 import K3Model
from ..models.kimi_linear import Model
from .shard import COLS, TENSOR_SPLITS, Cut
from .splits import WIDTHS, TensorShare

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9  # sizes are printed in GB = 1e9 bytes (as model files are sized)
GIB = 2**30  # host memory is given in GiB: Apple's "512GB" of unified memory is 512 GiB


@dataclass(frozen=True)
class QuantSpec:
    """An MLX quantized layout: ``mode`` "affine" (uint32-packed codes + a scale and a bias per group, in the model's
    float dtype) or "mxfp4" (4-bit E2M1 codes + one uint8 E8M0 scale per group of 32, no bias)."""

    bits: int
    group_size: int
    mode: str = "affine"

    def nbytes(self, shape: tuple[int, ...], scale_bytes: int) -> int:
        """Bytes of a ``shape`` weight quantized along its last axis; ``scale_bytes``: size of one affine scale."""
        n = math.prod(shape)
        groups = n // self.group_size
        per_group = 1 if self.mode == "mxfp4" else 2 * scale_bytes
        return n * self.bits // 8 + groups * per_group

    @property
    def label(self) -> str:
        return "mxfp4" if self.mode == "mxfp4" else f"affine {self.bits}-bit g{self.group_size}"


MXFP4 = QuantSpec(4, 32, "mxfp4")


@dataclass(frozen=True)
class Param:
    """One parameter of the model, as its module tree declares it.

    part: "layer" (of decoder layer ``layer``), "embed", "norm" (final norm), "head" or "output_attn_res" (K3).
    kind: "matrix" (the weight of a module the model's ``quant_predicate`` lets ``load`` quantize: Linear, Embedding,
    SwitchLinear, MultiLinear), "float" (kept in the model's float dtype: norms, routers, AttnRes scores) or
    "float32" (those the model's ``cast_predicate`` does not cast: ``A_log``, ``dt_bias``, the short conv, the router
    bias).
    split: the ``TensorShare`` field that splits it across ranks (``shard.TENSOR_SPLITS``), None when every rank
    holds it whole; columns: it is cut by input columns (``shard.COLS``).
    idle: for a replicated parameter of a block a rank may hold none of: the ``TensorShare`` field whose empty range
    drops it (the block's idle twin does not keep it); None: kept by every rank.
    expert: a stack of routed experts (``[E, out, in]``; only top-k of E are read per token).
    blocks: its module can hold GGML blocks (``layers.ggml.holds_ggml``).
    """

    name: str
    shape: tuple[int, ...]
    part: str
    layer: Optional[int] = None
    kind: str = "matrix"
    split: Optional[str] = None
    columns: bool = False
    idle: Optional[str] = None
    expert: bool = False
    blocks: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# top-level module (outside the decoder layers) -> Param.part
_PARTS = {"embed_tokens": "embed", "lm_head": "head", "output_attn_res": "output_attn_res", "norm": "norm"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def parameters(cfg: KimiConfig) -> list[Param]:
    """Every parameter of the ``Model`` / ``K3Model`` that ``load`` builds for ``cfg`` (unfused KDA q/k/v: fusing
    changes names, not bytes), read from the model's own module tree: names and shapes from ``model.parameters()``,
    the storage kind from the model's ``cast_predicate`` / ``quant_predicate`` (what ``load`` decides with), the
    tensor split from ``shard.TENSOR_SPLITS``. The model is built with its weights unevaluated, so nothing is
    allocated."""
    model = (K3Model if cfg.is_k3 else Model)(cfg)
    modules = dict(model.named_modules())
    casts, quantizable = model.cast_predicate, model.quant_predicate
    placed = _tensor_placement(modules)
    out = []
    for name, value in tree_flatten(model.parameters()):
        path, _, leaf = name.rpartition(".")
        module = modules[path]
        if not casts(name):
            kind = "float32"
        else:
            kind = "matrix" if leaf == "weight" and quantizable(path, module) else "float"
        m = _LAYER.search(name)
        cut, idle = placed.get(name, (None, None))
        out.append(Param(name, tuple(value.shape), "layer" if m else _part(name), int(m.group(1)) if m else None,
                         kind, cut and cut.field, cut is not None and cut.axis == COLS, idle,
                         isinstance(module, SwitchLinear), holds_ggml(module)))
    return out


def vision_parameters(vcfg) -> list[Param]:
    """The parameters of K3's vision tower and projector (``vision.VisionModel`` for the ``VisionConfig``, built
    unevaluated), part "vision": held by rank 0 only, kept float (``load``'s quantize does not reach them; a
    checkpoint's MLX-quantized ones are counted as stored)."""
    from ..vision.model import VisionModel

    return [Param(name, tuple(v.shape), "vision", kind="float")
            for name, v in tree_flatten(VisionModel(vcfg).parameters())]


def tower_config(cfg: KimiConfig, raw: Optional[dict] = None, source: str = "config.json", mmproj=None,
                 gguf: Optional[Path] = None):
    """The ``VisionConfig`` of the tower ``load`` attaches (as ``loading.tower_source`` picks it): ``mmproj``
    (a llama.cpp mmproj GGUF), else the checkpoint's ``vision_config`` (``raw``), else the ``mmproj*.gguf``
    beside a ``gguf``; None without one (and for Kimi Linear, which takes no ``mmproj``)."""
    from ..vision.config import VisionConfig
    from ..vision.mmproj import find_mmproj, open_mmproj

    if not cfg.is_k3:
        if mmproj is not None:
            raise ValueError(f"--mmproj {mmproj}: Kimi Linear is a text-only model; an mmproj goes with Kimi-K3")
        return None
    if mmproj is None and gguf is not None:
        mmproj = find_mmproj(gguf)
    if mmproj is not None:
        return open_mmproj(mmproj).cfg
    if raw is not None and "vision_config" in raw:
        return VisionConfig.from_hf(raw, source=source)
    return None


def _part(name: str) -> str:
    for key in name.split("."):
        if key in _PARTS:
            return _PARTS[key]
    raise ValueError(f"{name}: a parameter outside the decoder layers, embedding, final norm, head and "
                     "output_attn_res; the planner does not know which ranks hold it")


def _tensor_placement(modules: dict[str, nn.Module]) -> dict[str, tuple[Optional[Cut], Optional[str]]]:
    """Parameter name -> (its ``Cut``, None when replicated; the field whose empty range drops it, None when kept)
    for every parameter inside a block that ``shard.TENSOR_SPLITS`` declares (the outermost such block decides)."""
    out: dict[str, tuple[Optional[Cut], Optional[str]]] = {}
    for path, block in sorted(modules.items(), key=lambda item: item[0].count(".")):  # outer blocks first
        spec = TENSOR_SPLITS.get(type(block))
        if spec is None:
            continue
        for rel, _ in tree_flatten(block.parameters()):
            name = f"{path}.{rel}"
            if name in out:
                continue  # inside an outer declared block
            cut = next((c for child, c in spec.cuts.items() if rel == child or rel.startswith(child + ".")), None)
            kept = spec.idle is None or any(rel.startswith(k + ".") for k in spec.idle.KEEPS)
            out[name] = (cut, None if cut is not None or kept else spec.field)
    return out


@dataclass(frozen=True)
class Stored:
    """A parameter the checkpoint holds quantized: its bytes once loaded, quantization group, layout label."""

    nbytes: int
    group_size: int
    label: str


@dataclass(frozen=True)
class Accounting:
    """Every parameter of a model with its bytes as ``load`` holds them.

    act_bytes: bytes per element of activations and of the cache's activation-dtype parts (the model's float
    dtype). source: where the config came from.
    """

    cfg: KimiConfig
    params: tuple[Param, ...]
    nbytes: dict[str, int]
    layout: dict[str, str]  # param -> "bfloat16", "float32", "affine 4-bit g64", "mxfp4", "Q8_0 -> affine 8-bit g32"
    group: dict[str, int]  # param -> quantization group size (quantized parameters only)
    act_bytes: int
    source: str

    @property
    def total(self) -> int:
        return sum(self.nbytes.values())

    def layer_bytes(self) -> list[int]:
        """Bytes of each decoder layer."""
        out = [0] * self.cfg.num_hidden_layers
        for p in self.params:
            if p.part == "layer":
                out[p.layer] += self.nbytes[p.name]
        return out

    def part_bytes(self, part: str) -> int:
        """Bytes of "embed", "norm", "head", "output_attn_res" or "vision" (K3's tower + projector) (0 where the
        model has none)."""
        return sum(self.nbytes[p.name] for p in self.params if p.part == part)

    def by_layout(self) -> dict[str, int]:
        """Bytes per storage layout, largest first."""
        out: dict[str, int] = {}
        for p in self.params:
            out[self.layout[p.name]] = out.get(self.layout[p.name], 0) + self.nbytes[p.name]
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def split_unit(self) -> int:
        """Intermediate widths split on multiples of this: the largest quantization group of a split MLP (1: float)."""
        return max([self.group.get(p.name, 1) for p in self.params if p.split in WIDTHS] or [1])


def _account(cfg: KimiConfig, params: Sequence[Param], dtype: str, quantize: Optional[QuantSpec],
             stored: dict[str, Stored], source: str) -> Accounting:
    """Bytes of every parameter: ``stored`` as given, else quantized on load by ``quantize`` (matrices whose input
    width the group size divides, like ``loading.quantize_model``; scales in ``dtype``), else float: ``dtype``, or
    float32 for what ``cast_predicate`` does not cast."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
    size = DTYPE_BYTES[dtype]
    nbytes, layout, group = {}, {}, {}
    for p in params:
        if p.name in stored:
            s = stored[p.name]
            nbytes[p.name], layout[p.name], group[p.name] = s.nbytes, s.label, s.group_size
        elif quantize is not None and p.kind == "matrix" and p.shape[-1] % quantize.group_size == 0:
            nbytes[p.name], layout[p.name] = quantize.nbytes(p.shape, size), quantize.label
            group[p.name] = quantize.group_size
        elif p.kind == "float32":
            nbytes[p.name], layout[p.name] = p.numel * 4, "float32"
        else:
            nbytes[p.name], layout[p.name] = p.numel * size, dtype
    return Accounting(cfg, tuple(params), nbytes, layout, group, size, source)


def account_config(raw: dict, source: str = "config.json", dtype: Optional[str] = None,
                   quantize: Optional[QuantSpec] = None, experts_mxfp4: bool = False,
                   tensor_names: Optional[set[str]] = None, mmproj=None) -> Accounting:
    """Bytes as ``load`` holds a safetensors checkpoint with this ``config.json`` content (``raw``).

    dtype: ``load(dtype=...)``; None: the checkpoint's ``torch_dtype`` (what a Mac loads by default; parameters that
        ``cast_predicate`` does not cast are assumed stored float32, as in the released checkpoints).
    quantize: ``load(quantize=...)`` (affine); experts_mxfp4: routed experts held as MLX mxfp4 (as the released K3,
        whose ``quantization_config`` says so; then this is implied).
    tensor_names: the checkpoint's tensor names, when at hand: for an mlx-lm ``quantization`` entry, exactly the
        modules with ``.scales`` are quantized; without names, every module ``quantize_model`` would quantize is
        assumed to be (the layout ``kimi-mlx convert --quantize`` writes).
    mmproj: ``load(mmproj=...)``: the vision tower counted is that mmproj's, not the checkpoint's own.
    """
    cfg = KimiConfig.from_hf(raw, source=source)
    dtype = dtype or _torch_dtype(raw)
    vcfg = tower_config(cfg, raw, source, mmproj)
    params = parameters(cfg) + (vision_parameters(vcfg) if vcfg is not None else [])
    stored: dict[str, Stored] = {}
    qc = raw.get("quantization_config") or {}
    if raw.get("quantization"):  # mlx-lm's entry wins over quantization_config, as in load
        stored = _mlx_quantized(raw["quantization"], params, DTYPE_BYTES[dtype], tensor_names, source)
        if mmproj is not None:  # the mmproj's tower is float, whatever the checkpoint's own
            stored = {k: v for k, v in stored.items() if not k.startswith(("vision_tower.", "mm_projector."))}
    elif qc:
        if (qc.get("quant_method"), qc.get("format")) != ("compressed-tensors", "mxfp4-pack-quantized"):
            raise ValueError(f"{source}: quantization_config quant_method={qc.get('quant_method')!r} "
                             f"format={qc.get('format')!r} is not supported; expected compressed-tensors "
                             f"'mxfp4-pack-quantized' (as load)")
        experts_mxfp4 = True
    if experts_mxfp4:
        stored.update({p.name: Stored(MXFP4.nbytes(p.shape, 0), MXFP4.group_size, MXFP4.label)
                       for p in params if p.expert})
    return _account(cfg, params, dtype, quantize, stored, source)


def _torch_dtype(raw: dict) -> str:
    name = (raw.get("text_config") or {}).get("torch_dtype") or raw.get("torch_dtype") or "bfloat16"
    return name if name in DTYPE_BYTES else "bfloat16"


def _mlx_quantized(entry: dict, params: list[Param], scale_bytes: int, names: Optional[set[str]],
                   source: str) -> dict[str, Stored]:
    """Parameters an mlx-lm ``quantization`` entry ({group_size, bits, mode, per-module overrides}) covers; a
    ``{"ggml_type": name}`` override is a module kept in GGML blocks (``kimi-mlx convert`` of a GGUF), and an entry
    without ``bits`` (only such overrides) quantizes nothing else."""
    default = QuantSpec(entry.get("bits", 4), entry.get("group_size", 64), entry.get("mode", "affine"))
    out = {}
    for p in params:
        if not p.name.endswith(".weight"):
            continue
        module = p.name[: -len(".weight")]
        fused = re.sub(r"\.self_attn\.[qkv]_proj$", ".self_attn.qkv_proj", module)  # K3 checkpoints fuse KDA q/k/v
        override = entry.get(module, entry.get(fused))
        if isinstance(override, dict) and "ggml_type" in override:
            out[p.name] = _ggml_blocks(override["ggml_type"], p)
            continue
        if names is not None:
            quantized = f"{module}.scales" in names or f"{fused}.scales" in names
        else:
            quantized = isinstance(override, dict) or ("bits" in entry and override is not False
                                                       and p.kind == "matrix" and p.shape[-1] % default.group_size == 0)
        if not quantized:
            continue
        spec = default
        if isinstance(override, dict):
            spec = QuantSpec(override.get("bits", default.bits), override.get("group_size", default.group_size),
                             override.get("mode", default.mode))
        if spec.mode not in ("affine", "mxfp4"):
            raise ValueError(f"{source}: quantization of {module} has mode {spec.mode!r}; expected 'affine' or 'mxfp4'")
        out[p.name] = Stored(spec.nbytes(p.shape, scale_bytes), spec.group_size, spec.label)
    return out


def _ggml_blocks(type_name: str, p: Param) -> Stored:
    """``p`` held as GGML blocks of ``type_name`` (``layers.ggml``): the GGUF's bytes, cut on whole blocks."""
    from ..ops.ggml import get_format

    fmt = get_format(type_name)
    return Stored(p.numel // fmt.block_elems * fmt.type_bytes, fmt.block_elems, f"{type_name} blocks")


def checkpoint_tensor_names(path: Path) -> Optional[set[str]]:
    """Tensor names of a safetensors checkpoint directory, from its index or the files' headers (no weights read);
    None when there is no safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for file in files:
        with open(file, "rb") as f:
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                names.update(k for k in json.loads(f.read(n)) if k != "__metadata__")
            except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{file}: not a safetensors file (unreadable header: {e})") from None
    return names


def account_gguf(path, dtype: Optional[str] = None, quantize: Optional[QuantSpec] = None,
                 scale_dtype: str = "float32", requantize: bool = False, mmproj=None) -> Accounting:
    """Bytes as ``load`` holds a GGUF file or split set, from its header only (no tensor data is read).

    Quantized tensors of quantizable modules become the MLX layout ``quant.to_mlx`` makes of their GGML type (e.g.
    Q8_0 -> affine 8-bit g32, Q4_K -> affine 4-bit g32, with ``scale_dtype`` scales and biases; MXFP4 -> mxfp4).
    The types MLX has no layout for (Q6_K, Q3_K, Q2_K, IQ*: ``ops.ggml.FORMATS``) stay the file's blocks (their GGUF
    bytes, split on whole blocks: the group is the block size), or with ``requantize`` become affine g32; MLA's
    per-head ``embed_q`` / ``unembed_out`` in such a type are decoded to float unless ``requantize`` (they have no
    block layer). Everything else is decoded to float: ``dtype``, float32 when None (``load``'s default for GGUF:
    it decodes to float32 and casts only when given a dtype) and for what ``cast_predicate`` does not cast.
    ``quantize``: ``load(gguf, quantize=...)`` on top (block layers are not re-quantized).
    K3's vision tower, from ``mmproj`` or the ``mmproj*.gguf`` beside the file, in float as ``load`` holds it.
    """
    from ..convert.gguf.arch import build_config, gguf_storage, plan_tensors
    from ..convert.gguf.quant import mlx_layout
    from ..convert.gguf.reader import GGUFFile

    g = path if isinstance(path, GGUFFile) else GGUFFile(Path(path).expanduser())
    cfg = build_config(g)
    params = {p.name: p for p in parameters(cfg)}
    plan = plan_tensors(g, cfg, {p.name: p.shape for p in params.values()})
    scales = DTYPE_BYTES[scale_dtype]
    stored = {}
    for name, info in plan.direct.items():
        p = params[name]
        storage = gguf_storage(info.type_name, p.kind == "matrix", p.blocks, requantize)
        if storage == "blocks":
            stored[name] = _ggml_blocks(info.type_name, p)
        elif storage == "mlx":
            spec = QuantSpec(*mlx_layout(info.qtype, requantize))
            label = spec.label + ("" if spec.mode == "mxfp4" else f" ({scale_dtype} scales)")
            stored[name] = Stored(spec.nbytes(p.shape, scales), spec.group_size, f"{info.type_name} -> {label}")
    vcfg = tower_config(cfg, mmproj=mmproj, gguf=g.path)
    vision = vision_parameters(vcfg) if vcfg is not None else []
    return _account(cfg, [*params.values(), *vision], dtype or "float32", quantize, stored, g.source)


def cache_bytes(cfg: KimiConfig, context: int, layers: Optional[Sequence[int]] = None,
                share: Optional[TensorShare] = None, *, act_bytes: int = 2, kv_bits: Optional[int] = None,
                kv_group_size: int = 64) -> int:
    """Cache bytes of one sequence at ``context`` tokens for ``layers`` (None: every layer), what
    ``model.make_cache()`` holds after that many tokens.

    Per MLA layer and token the latent ``kv_lora_rank`` + ``qk_rope_head_dim`` values (whole on every
    tensor-parallel rank): ``act_bytes`` each (the model's float dtype) when ``kv_bits`` is None; with ``kv_bits`` 8
    or 4 each part is stored like ``mx.quantize`` (affine) lays it out along its width: uint32-packed codes
    (``width * kv_bits / 8`` bytes) plus one scale and one bias per ``kv_group_size`` values, both in the model's
    float dtype (``act_bytes``: bfloat16 for the released checkpoints); a part whose width the group does not
    divide stays float. Per KDA layer, whatever ``kv_bits``: the conv state ``(K-1) x 3 x heads x head_dim``
    (``act_bytes``) and the float32 recurrent state ``heads x head_dim x head_dim`` (heads split under tensor
    parallelism)."""
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    heads = cfg.kda_num_heads if share is None else len(share.kda_heads)
    kda = heads * cfg.kda_head_dim * (3 * (cfg.short_conv_kernel_size - 1) * act_bytes + cfg.kda_head_dim * 4)
    spec = None if kv_bits is None else QuantSpec(kv_bits, kv_group_size)
    per_token = sum(width * act_bytes if spec is None or width % kv_group_size else spec.nbytes((width,), act_bytes)
                    for width in (cfg.kv_lora_rank, cfg.qk_rope_head_dim))
    return sum(kda if cfg.is_kda_layer(i) else context * per_token for i in layers)

