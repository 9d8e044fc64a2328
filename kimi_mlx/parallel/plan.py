"""Who holds what across ranks: contiguous splits of layers (pipeline) and of heads / experts / widths (tensor).

Everything here is plain arithmetic on counts and byte sizes, so ``kimi-mlx plan`` can run on a config alone and
``load(parallel=...)`` makes exactly the split it predicts.

After the split primitives: byte accounting of every parameter as ``load`` holds it (``account_config``,
``account_gguf``), cache sizes, the per-token cost model and the plans ``plan_pipeline`` / ``plan_tensor``
(README "Planning a cluster").
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from ..config import KimiConfig
from ..ops.memory import FILL, MIB, default_working_set, wired_limit_mib


def split_evenly(n: int, parts: int, unit: int = 1) -> list[range]:
    """``n`` items in ``parts`` contiguous ranges whose sizes differ by at most ``unit`` (earlier ranges larger).

    ``unit``: every boundary falls on a multiple of it (e.g. a quantization group); ``n`` must be a multiple.
    Ranges may be empty when there are fewer units than parts.
    """
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts; expected at least 1")
    if unit < 1 or n % unit:
        raise ValueError(f"{n} items cannot be split in units of {unit}")
    units, extra = divmod(n // unit, parts)
    out, start = [], 0
    for r in range(parts):
        size = (units + (r < extra)) * unit
        out.append(range(start, start + size))
        start += size
    return out


def split_proportional(costs: Sequence[float], capacities: Sequence[float]) -> list[range]:
    """Contiguous ranges of items (e.g. layers with their byte ``costs``) for ranks of the given ``capacities``.

    Each rank's share of the total cost is as close as a contiguous split allows to its share of the capacity
    (boundary i is placed where the running cost is nearest to the capacity prefix); every rank gets at least one
    item, so there must be at least as many items as ranks.
    """
    n, parts = len(costs), len(capacities)
    if parts < 1 or any(c <= 0 for c in capacities):
        raise ValueError(f"capacities {list(capacities)}: expected one positive value per rank")
    if n < parts:
        raise ValueError(f"{n} layers cannot be split over {parts} ranks; expected at most {n} ranks")
    total, cap = float(sum(costs)), float(sum(capacities))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    bounds, acc = [0], 0.0
    for r in range(parts - 1):
        acc += capacities[r]
        target = total * acc / cap
        lo, hi = bounds[-1] + 1, n - (parts - 1 - r)  # leave at least one item for each later rank
        bounds.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), i)))
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def parse_split(text: str, n_layers: int, parts: int) -> list[int] | str:
    """``--split`` / ``split=``: ``"even"`` or comma-separated layer counts per rank (summing to ``n_layers``)."""
    if text == "even":
        return "even"
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"split {text!r}: expected 'even' or comma-separated layer counts such as '20,7'") from None
    check_counts(counts, n_layers, parts)
    return counts


def check_counts(counts: Sequence[int], n_layers: int, parts: int) -> None:
    """Layer counts per rank: one per rank, each at least 1, summing to the model's layer count."""
    if len(counts) != parts:
        raise ValueError(f"split {list(counts)}: {len(counts)} layer counts for {parts} ranks; expected one per rank")
    if any(c < 1 for c in counts) or sum(counts) != n_layers:
        raise ValueError(f"split {list(counts)}: expected positive layer counts summing to the model's {n_layers} "
                         f"layers (they sum to {sum(counts)})")


def ranges_from_counts(counts: Sequence[int]) -> list[range]:
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


@dataclass(frozen=True)
class TensorShare:
    """One rank's part of every layer under tensor + expert parallelism (the same ranges in every layer).

    kda_heads / mla_heads: head ranges; experts: routed expert ids (each held whole); ffn: columns of the dense
    MLP's intermediate width; shared: columns of the shared experts' intermediate width. Ranges may be empty.
    """

    kda_heads: range
    mla_heads: range
    experts: range
    ffn: range
    shared: range


def tensor_shares(cfg: KimiConfig, parts: int, unit: int = 1) -> list[TensorShare]:
    """Split heads, experts and intermediate widths over ``parts`` ranks as evenly as the counts allow.

    ``unit``: intermediate widths are split on multiples of it (the quantization group size of a quantized
    model, so each rank's slice of a quantized ``down_proj`` holds whole groups).
    """
    shared = cfg.moe_intermediate_size * cfg.num_shared_experts
    cols = [split_evenly(w, parts, unit) for w in (cfg.intermediate_size, shared)]
    return [
        TensorShare(k, m, e, f, s)
        for k, m, e, f, s in zip(
            split_evenly(cfg.kda_num_heads, parts), split_evenly(cfg.num_attention_heads, parts),
            split_evenly(cfg.num_experts, parts), *cols,
        )
    ]


def pipeline_ranges(costs: Sequence[float], capacities: Sequence[float],
                    split: Union[None, str, Sequence[int]] = None) -> list[range]:
    """Layer ranges per rank: ``split`` None (proportional to ``capacities``), ``"even"``, or layer counts per rank
    (a list, or a string such as ``"20,7"``). ``costs``: bytes of each layer; ``capacities``: one per rank."""
    n, parts = len(costs), len(capacities)
    if split is None:
        return split_proportional(costs, capacities)
    counts = parse_split(split, n, parts) if isinstance(split, str) else list(split)
    if counts == "even":
        if n < parts:
            raise ValueError(f"split 'even': {n} layers cannot be split over {parts} ranks; expected at most {n} ranks")
        return split_evenly(n, parts)
    check_counts(counts, n, parts)
    return ranges_from_counts(counts)


# ------------------------------------------------------------------------------------------------ byte accounting
#
# Every parameter of the built model, from the config alone: its full path (as in ``model.parameters()``), shape,
# how ``load`` stores it and how tensor parallelism splits it. ``account_config`` / ``account_gguf`` then give each
# parameter its bytes as loaded in MLX; the tests check them against built models' ``nbytes``, parameter by parameter.

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9  # sizes are printed in GB = 1e9 bytes (as model files are sized)
GIB = 2**30  # host memory is given in GiB: Apple's "512GB" of unified memory is 512 GiB

# Split dimension -> its size in the config (what ``TensorShare``'s field of that name ranges over).
_SPLIT_SIZES = {
    "kda_heads": lambda c: c.kda_num_heads,
    "mla_heads": lambda c: c.num_attention_heads,
    "experts": lambda c: c.num_experts,
    "ffn": lambda c: c.intermediate_size,
    "shared": lambda c: c.moe_intermediate_size * c.num_shared_experts,
}


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
    """One parameter of the model.

    part: "layer" (of decoder layer ``layer``), "embed", "norm" (final norm), "head" or "output_attn_res" (K3).
    kind: "matrix" (weight of a Linear / Embedding / SwitchLinear / MultiLinear the model may quantize), "float" (kept
    float in the model's dtype: norms, routers, AttnRes scores) or "float32" (kept float32 by ``cast_predicate``:
    ``A_log``, ``dt_bias``, the short conv, the router bias).
    split: the ``TensorShare`` field that splits it across ranks, None when every rank holds it whole.
    expert: a stack of routed experts (``[E, out, in]``; only top-k of E are read per token).
    """

    name: str
    shape: tuple[int, ...]
    part: str
    layer: Optional[int] = None
    kind: str = "matrix"
    split: Optional[str] = None
    expert: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parameters(cfg: KimiConfig) -> list[Param]:
    """Every parameter of the ``Model`` / ``K3Model`` that ``load`` builds for ``cfg`` (unfused KDA q/k/v: fusing
    changes names, not bytes)."""
    root = "language_model.model." if cfg.is_k3 else "model."
    h, vocab = cfg.hidden_size, cfg.vocab_size
    out = [Param(root + "embed_tokens.weight", (vocab, h), "embed")]
    for i in range(cfg.num_hidden_layers):
        out += [Param(f"{root}layers.{i}.{name}", shape, "layer", i, kind, split, expert)
                for name, shape, kind, split, expert in _layer(cfg, i)]
    out.append(Param(root + "norm.weight", (h,), "norm", kind="float"))
    if cfg.attn_res_block_size is not None:
        out += [Param(f"{root}output_attn_res.{name}", shape, "output_attn_res", kind="float")
                for name, shape in (("norm.weight", (h,)), ("proj.weight", (1, h)))]
    if not cfg.tie_word_embeddings:
        out.append(Param(("language_model." if cfg.is_k3 else "") + "lm_head.weight", (vocab, h), "head"))
    return out


def _layer(cfg: KimiConfig, i: int) -> list[tuple]:
    """(name within the layer, shape, kind, split, expert) of decoder layer ``i``'s parameters."""
    rows: list[tuple] = []

    def add(name, shape, kind="matrix", split=None, expert=False):
        rows.append((name, shape, kind, split, expert))

    h = cfg.hidden_size
    add("input_layernorm.weight", (h,), "float")
    add("post_attention_layernorm.weight", (h,), "float")
    (_kda if cfg.is_kda_layer(i) else _mla)(cfg, add)
    if cfg.is_moe_layer(i):
        _moe(cfg, add)
    else:
        _mlp(add, "mlp.", h, cfg.intermediate_size, "ffn")
    if cfg.attn_res_block_size is not None:
        for mix in ("self_attention_res", "mlp_res"):
            add(f"{mix}.norm.weight", (h,), "float")
            add(f"{mix}.proj.weight", (1, h), "float")
    return rows


def _kda(cfg: KimiConfig, add) -> None:
    """KDA: q/k/v, gates, conv, A_log, dt_bias, o_proj split by head; the low-rank f_a / g_a and o_norm shared."""
    h, H, D = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    P, s = H * D, "kda_heads"
    for p in "qkv":
        add(f"self_attn.{p}_proj.weight", (P, h), split=s)
    add("self_attn.qkv_conv.weight", (3 * P, cfg.short_conv_kernel_size), "float32", s)
    add("self_attn.f_a_proj.weight", (D, h))
    add("self_attn.f_b_proj.weight", (P, D), split=s)
    add("self_attn.b_proj.weight", (H, h), split=s)
    if cfg.kda_full_rank_gate:
        add("self_attn.g_proj.weight", (P, h), split=s)
    else:
        add("self_attn.g_a_proj.weight", (D, h))
        add("self_attn.g_b_proj.weight", (P, D), split=s)
    add("self_attn.A_log", (H,), "float32", s)
    add("self_attn.dt_bias", (P,), "float32", s)
    add("self_attn.o_norm.weight", (D,), "float")
    add("self_attn.o_proj.weight", (h, P), split=s)


def _mla(cfg: KimiConfig, add) -> None:
    """MLA: per-head projections split by head; q-LoRA's q_a, kv_a_proj and their norms shared."""
    h, H, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    nope, rope, v, s = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, "mla_heads"
    if cfg.q_lora_rank:
        add("self_attn.q_a_proj.weight", (cfg.q_lora_rank, h))
        add("self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,), "float")
        add("self_attn.q_b_proj.weight", (H * (nope + rope), cfg.q_lora_rank), split=s)
    else:
        add("self_attn.q_proj.weight", (H * (nope + rope), h), split=s)
    add("self_attn.kv_a_proj_with_mqa.weight", (R + rope, h))
    add("self_attn.kv_a_layernorm.weight", (R,), "float")
    add("self_attn.embed_q.weight", (H, R, nope), split=s)
    add("self_attn.unembed_out.weight", (H, v, R), split=s)
    add("self_attn.o_proj.weight", (h, H * v), split=s)
    if cfg.mla_use_output_gate:
        add("self_attn.g_proj.weight", (H * v, h), split=s)


def _moe(cfg: KimiConfig, add) -> None:
    """MoE: routed experts split by expert; router, its bias and latent projections shared; shared experts by width."""
    h, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    width = cfg.routed_expert_hidden_size or h
    add("mlp.gate.weight", (E, h), "float")
    add("mlp.e_score_correction_bias", (E,), "float32")
    for name, shape in (("gate_proj", (E, inter, width)), ("up_proj", (E, inter, width)),
                        ("down_proj", (E, width, inter))):
        add(f"mlp.switch_mlp.{name}.weight", shape, split="experts", expert=True)
    if cfg.routed_expert_hidden_size:
        add("mlp.routed_expert_down_proj.weight", (width, h))
        add("mlp.routed_expert_up_proj.weight", (h, width))
        if cfg.latent_moe_use_norm:
            add("mlp.routed_expert_norm.weight", (width,), "float")
    if cfg.num_shared_experts:
        _mlp(add, "mlp.shared_experts.", h, inter * cfg.num_shared_experts, "shared")


def _mlp(add, prefix: str, h: int, inter: int, split: str) -> None:
    add(prefix + "gate_proj.weight", (inter, h), split=split)
    add(prefix + "up_proj.weight", (inter, h), split=split)
    add(prefix + "down_proj.weight", (h, inter), split=split)


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
        """Bytes of "embed", "norm", "head" or "output_attn_res" (0 where the model has none)."""
        return sum(self.nbytes[p.name] for p in self.params if p.part == part)

    def by_layout(self) -> dict[str, int]:
        """Bytes per storage layout, largest first."""
        out: dict[str, int] = {}
        for p in self.params:
            out[self.layout[p.name]] = out.get(self.layout[p.name], 0) + self.nbytes[p.name]
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def split_unit(self) -> int:
        """Intermediate widths split on multiples of this: the largest quantization group of a split MLP (1: float)."""
        return max([self.group.get(p.name, 1) for p in self.params if p.split in ("ffn", "shared")] or [1])


def _account(cfg: KimiConfig, dtype: str, quantize: Optional[QuantSpec], stored: dict[str, Stored],
             source: str) -> Accounting:
    """Bytes of every parameter: ``stored`` as given, else quantized on load by ``quantize`` (matrices whose input
    width the group size divides, like ``loading.quantize_model``; scales in ``dtype``), else float: ``dtype``, or
    float32 for what ``cast_predicate`` keeps."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
    size = DTYPE_BYTES[dtype]
    params = tuple(parameters(cfg))
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
    return Accounting(cfg, params, nbytes, layout, group, size, source)


def account_config(raw: dict, source: str = "config.json", dtype: Optional[str] = None,
                   quantize: Optional[QuantSpec] = None, experts_mxfp4: bool = False,
                   tensor_names: Optional[set[str]] = None) -> Accounting:
    """Bytes as ``load`` holds a safetensors checkpoint with this ``config.json`` content (``raw``).

    dtype: ``load(dtype=...)``; None: the checkpoint's ``torch_dtype`` (what a Mac loads by default; parameters that
        ``cast_predicate`` keeps are assumed stored float32, as in the released checkpoints).
    quantize: ``load(quantize=...)`` (affine); experts_mxfp4: routed experts held as MLX mxfp4 (as the released K3,
        whose ``quantization_config`` says so; then this is implied).
    tensor_names: the checkpoint's tensor names, when at hand: for an mlx-lm ``quantization`` entry, exactly the
        modules with ``.scales`` are quantized; without names, every module ``quantize_model`` would quantize is
        assumed to be (the layout ``kimi-mlx convert --quantize`` writes).
    """
    cfg = KimiConfig.from_hf(raw, source=source)
    dtype = dtype or _torch_dtype(raw)
    params = parameters(cfg)
    stored: dict[str, Stored] = {}
    qc = raw.get("quantization_config") or {}
    if raw.get("quantization"):  # mlx-lm's entry wins over quantization_config, as in load
        stored = _mlx_quantized(raw["quantization"], params, DTYPE_BYTES[dtype], tensor_names, source)
    elif qc:
        if (qc.get("quant_method"), qc.get("format")) != ("compressed-tensors", "mxfp4-pack-quantized"):
            raise ValueError(f"{source}: quantization_config quant_method={qc.get('quant_method')!r} "
                             f"format={qc.get('format')!r} is not supported; expected compressed-tensors "
                             f"'mxfp4-pack-quantized' (as load)")
        experts_mxfp4 = True
    if experts_mxfp4:
        stored.update({p.name: Stored(MXFP4.nbytes(p.shape, 0), MXFP4.group_size, MXFP4.label)
                       for p in params if p.expert})
    return _account(cfg, dtype, quantize, stored, source)


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
                 scale_dtype: str = "float32", requantize: bool = False) -> Accounting:
    """Bytes as ``load`` holds a GGUF file or split set, from its header only (no tensor data is read).

    Quantized tensors of quantizable modules become the MLX layout ``quant.to_mlx`` makes of their GGML type (e.g.
    Q8_0 -> affine 8-bit g32, Q4_K -> affine 4-bit g32, with ``scale_dtype`` scales and biases; MXFP4 -> mxfp4).
    The types MLX has no layout for (Q6_K, Q3_K, Q2_K, IQ*: ``ops.ggml.FORMATS``) stay the file's blocks (their GGUF
    bytes, split on whole blocks: the group is the block size), or with ``requantize`` become affine g32; MLA's
    per-head ``embed_q`` / ``unembed_out`` in such a type are decoded to float unless ``requantize`` (they have no
    block layer). Everything else is decoded to float: ``dtype``, float32 when None (``load``'s default for GGUF:
    it decodes to float32 and casts only when given a dtype) and for what ``cast_predicate`` keeps. ``quantize``:
    ``load(gguf, quantize=...)`` on top (block layers are not re-quantized).
    """
    from ..convert.gguf.arch import FLOAT_TYPES, build_config, plan_tensors
    from ..convert.gguf.reader import GGUFFile
    from ..ops.ggml import FORMATS

    g = path if isinstance(path, GGUFFile) else GGUFFile(Path(path).expanduser())
    cfg = build_config(g)
    params = {p.name: p for p in parameters(cfg)}
    plan = plan_tensors(g, cfg, {p.name: p.shape for p in params.values()})
    stored = {}
    for name, info in plan.direct.items():
        p = params[name]
        if info.type_name in FLOAT_TYPES or p.kind != "matrix":
            continue  # decoded to float
        if info.type_name in FORMATS and not requantize:
            if p.expert or len(p.shape) == 2:  # a Linear, Embedding or expert stack: a GGML-block layer
                stored[name] = _ggml_blocks(info.type_name, p)
            continue  # a MultiLinear ([H, ...]): decoded to float
        block, per_block, group, label = _gguf_block_layout(int(info.qtype), scale_dtype)
        stored[name] = Stored(p.numel // block * per_block, group, f"{info.type_name} -> {label}")
    return _account(cfg, dtype or "float32", quantize, stored, g.source)


@functools.lru_cache(maxsize=None)
def _gguf_block_layout(qtype: int, scale_dtype: str) -> tuple[int, int, int, str]:
    """(elements per GGML block, MLX bytes per block, MLX group size, MLX layout) of a quantized GGML type
    converted to MLX (re-quantized where it has no MLX layout): ``to_mlx`` run on one zero block, so the answer is
    the loader's own layout."""
    import warnings

    import gguf
    import mlx.core as mx
    import numpy as np

    from ..convert.gguf.quant import to_mlx

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    name = gguf.GGMLQuantizationType(qtype).name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the requantization warning of the block types
        out = to_mlx(name, qtype, np.zeros(type_size, np.uint8), (1, block), requantize=True,
                     scale_dtype=getattr(mx, scale_dtype))
    per_block = sum(out[k].nbytes for k in ("weight", "scales", "biases") if k in out)
    spec = QuantSpec(out["bits"], out["group_size"], out["mode"])
    scales = "" if spec.mode == "mxfp4" else f" ({scale_dtype} scales)"
    return block, per_block, spec.group_size, spec.label + scales


# ------------------------------------------------------------------------------------------------ per-token costs
#
# The cost model of README "Planning a cluster", per rank share. A share is (layers held, TensorShare or None): the
# fraction of each parameter a rank holds is its split field's count over the config's (whole when None).

def _fraction(cfg: KimiConfig, p: Param, share: Optional[TensorShare]) -> float:
    if share is None:
        return 1.0
    if p.split is None:
        return 0.0 if _idle(cfg, p, share) else 1.0
    return len(getattr(share, p.split)) / _SPLIT_SIZES[p.split](cfg)


def _idle(cfg: KimiConfig, p: Param, share: TensorShare) -> bool:
    """A replicated parameter of an attention block of which the rank holds no heads: such a rank keeps nothing of
    a KDA block, and of an MLA block only what fills the whole latent cache (``kv_a_proj_with_mqa`` and its norm)."""
    if p.part != "layer" or ".self_attn." not in p.name:
        return False
    if cfg.is_kda_layer(p.layer):
        return not share.kda_heads
    return not share.mla_heads and not any(k in p.name for k in (".kv_a_proj_with_mqa.", ".kv_a_layernorm."))


def _gathered(cfg: KimiConfig, p: Param) -> bool:
    """The embedding, when only gathered from (a tied embedding is also the head, read whole)."""
    return p.part == "embed" and not cfg.tie_word_embeddings


def _read_fraction(cfg: KimiConfig, p: Param) -> float:
    """Fraction of a parameter one decoded token reads: top-k of E experts, one row of the embedding, else all."""
    if p.expert:
        return cfg.num_experts_per_token / cfg.num_experts
    return 1 / cfg.vocab_size if _gathered(cfg, p) else 1.0


def _held(p: Param, layers: range, parts: frozenset) -> bool:
    return p.layer in layers if p.part == "layer" else p.part in parts


def weight_bytes(acct: Accounting, layers: range, parts: frozenset, share: Optional[TensorShare] = None) -> int:
    """Bytes of the parameters a rank holds: its ``layers``, the non-layer ``parts`` ("embed", "norm", "head",
    "output_attn_res") and, under tensor parallelism, its ``share`` of every split parameter."""
    return round(sum(acct.nbytes[p.name] * _fraction(acct.cfg, p, share)
                     for p in acct.params if _held(p, layers, parts)))


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


def decode_bytes(acct: Accounting, context: int, layers: range, parts: frozenset,
                 share: Optional[TensorShare] = None, kv: Optional[dict] = None) -> float:
    """Bytes one decoded token reads on a rank at ``context``: the weights it uses (every expert share at top-k/E,
    one embedding row) plus its cache (MLA latent read once; KDA state read and written). ``kv``: ``cache_bytes``'s
    ``kv_bits`` / ``kv_group_size``."""
    cfg = acct.cfg
    weights = sum(acct.nbytes[p.name] * _fraction(cfg, p, share) * _read_fraction(cfg, p)
                  for p in acct.params if _held(p, layers, parts))
    a = acct.act_bytes
    kda_state = cache_bytes(cfg, 0, [i for i in layers if cfg.is_kda_layer(i)], share, act_bytes=a)
    return weights + cache_bytes(cfg, context, layers, share, act_bytes=a, **(kv or {})) + kda_state


def token_flops(acct: Accounting, context: float, layers: range, parts: frozenset,
                share: Optional[TensorShare] = None, prefill_chunk: Optional[int] = None) -> float:
    """FLOPs of one token on a rank: 2 per multiply-add of every weight it uses (experts at top-k/E; the embedding
    is a gather), plus attention over ``context`` keys per MLA head (decode, absorbed: 2 x (2 x kv_lora_rank +
    qk_rope) per key; prefill, expanded: 2 x (qk_nope + qk_rope + v) per key at the average ``context``, and the
    latent -> per-head k/v expansion of every cached key once per chunk of ``prefill_chunk`` tokens), plus ~8 x D^2
    per KDA head (the state update and read)."""
    cfg = acct.cfg
    matmul = sum(2 * p.numel * _fraction(cfg, p, share) * _read_fraction(cfg, p)
                 for p in acct.params if _held(p, layers, parts) and not _gathered(cfg, p))
    mla_heads = cfg.num_attention_heads if share is None else len(share.mla_heads)
    kda_heads = cfg.kda_num_heads if share is None else len(share.kda_heads)
    R, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if prefill_chunk is None:
        mla = 2 * mla_heads * (2 * R + rope) * context
    else:
        mla = 2 * mla_heads * ((nope + rope + v) * context + R * (nope + v) * context / prefill_chunk)
    kda = 8 * kda_heads * cfg.kda_head_dim**2
    return matmul + sum(kda if cfg.is_kda_layer(i) else mla for i in layers)


def chunk_bytes(acct: Accounting, chunk: int, layers: range, parts: frozenset,
                share: Optional[TensorShare] = None) -> float:
    """Weight bytes one prefill chunk of ``chunk`` tokens reads on a rank: every expert at the chance that one of the
    chunk's tokens routes to it, 1 - (1 - k/E)^chunk; ``chunk`` embedding rows; everything else once."""
    cfg = acct.cfg

    def read(p: Param) -> float:
        if p.expert:
            return 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** chunk
        return min(1.0, chunk / cfg.vocab_size) if _gathered(cfg, p) else 1.0

    return sum(acct.nbytes[p.name] * _fraction(cfg, p, share) * read(p)
               for p in acct.params if _held(p, layers, parts))


def attn_res_blocks(cfg: KimiConfig, layer: int) -> int:
    """Completed K3 AttnRes block snapshots before decoder layer ``layer`` (0 without AttnRes)."""
    if cfg.attn_res_block_size is None:
        return 0
    return -(-layer // cfg.attn_res_block_size)


# ------------------------------------------------------------------------------------------------ plans

@dataclass(frozen=True)
class Host:
    """One Mac: ``memory_gib`` of unified memory (GiB = 2**30 bytes), memory ``bandwidth_gbs`` (GB/s = 1e9 bytes/s)
    and ``tflops`` (1e12 FLOP/s) when known; ``wired_limit_gib``: its GPU working set when known (a raised
    ``iogpu.wired_limit_mb`` / 1024, or what the Mac reports), None: macOS's default for its memory."""

    memory_gib: float
    bandwidth_gbs: Optional[float] = None
    tflops: Optional[float] = None
    wired_limit_gib: Optional[float] = None

    @property
    def working_set(self) -> int:
        """Bytes the GPU may keep wired: ``wired_limit_gib``, else ``ops.memory.default_working_set``."""
        if self.wired_limit_gib is not None:
            return int(self.wired_limit_gib * GIB)
        return default_working_set(int(self.memory_gib * GIB))


ULTRA_MIN_GIB, ULTRA_BANDWIDTH_GBS = 192, 819.2


def default_bandwidth(memory_gib: float) -> Optional[float]:
    """Memory bandwidth in GB/s where the memory size tells the chip: every Mac of 192 GiB or more is an M2 Ultra or
    M3 Ultra, both 819.2 GB/s (Apple's specifications). Below that it does not (64 GiB: M4 Pro 273 GB/s or M4 Max
    546 GB/s; 128 GiB: M4 Max or M3 Ultra): None."""
    return ULTRA_BANDWIDTH_GBS if memory_gib >= ULTRA_MIN_GIB else None


@dataclass(frozen=True)
class Link:
    """The links between hosts: ``bandwidth_gbs`` (GB/s) and ``latency_us`` per message (µs)."""

    bandwidth_gbs: float
    latency_us: float

    def send(self, nbytes: float, messages: int = 1) -> float:
        """Seconds for ``messages`` point-to-point messages carrying ``nbytes`` in all."""
        return messages * self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbs * 1e9)

    def all_sum(self, nbytes: float, n: int, times: int = 1) -> float:
        """Seconds for ``times`` ring all_sums over ``n`` ranks summing ``nbytes`` in all: each takes 2(n-1) steps,
        and a rank sends 2(n-1)/n of the bytes."""
        return 0.0 if n < 2 else self.send(2 * (n - 1) / n * nbytes, times * 2 * (n - 1))


# RDMA over Thunderbolt 5 (backend jaccl), as reported in ../shared/spec/distributed_and_server.md §1.7 (8 GB/s,
# 25.5 µs); ring over TCP has about 10x the latency (MLX's docs).
JACCL_TB5 = Link(8.0, 25.5)


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds and needs. Bytes are bytes; ``usable`` = host memory - reserve (the most its GPU can be
    given: the RAM fit); ``wired_ok``: the need takes at most ``FILL`` of the host's GPU working set (the rest is for
    activations), so it runs without raising the host's wired limit."""

    rank: int
    host: Host
    layers: range
    parts: frozenset
    share: Optional[TensorShare]
    weights: int
    cache: int
    usable: int

    @property
    def need(self) -> int:
        return self.weights + self.cache

    @property
    def free(self) -> int:
        """Usable bytes left (negative: the shortfall)."""
        return self.usable - self.need

    @property
    def wired_ok(self) -> bool:
        return self.need <= FILL * self.host.working_set


@dataclass(frozen=True)
class Speed:
    """Predicted seconds: ``compute`` per stage (max of bytes / bandwidth and FLOPs / FLOP/s, see README), ``head``
    (the replicated head, in parallel on every rank; pipeline only), ``links`` (messages and collectives)."""

    tokens: int
    compute: tuple[float, ...]
    head: float
    links: float
    serial: bool  # pipeline: stages run one after another; tensor: in parallel

    @property
    def seconds(self) -> float:
        return (sum(self.compute) if self.serial else max(self.compute)) + self.head + self.links

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Plan:
    """A split of the model over hosts, its memory per rank and predicted speed (None where a host's bandwidth,
    or for prefill its FLOP/s, is not known)."""

    mode: str  # "pipeline" or "tensor"
    acct: Accounting
    context: int
    reserve_gib: float
    link: Link
    ranks: tuple[RankPlan, ...]
    decode: Optional[Speed]
    prefill: Optional[Speed]
    link_bytes: float  # bytes sent per decoded token by the busiest rank
    kv_bits: Optional[int] = None  # latent cache layout (``cache_bytes``)
    kv_group_size: int = 64
    split_by_working_set: bool = False  # pipeline: layers in proportion to the hosts' working sets (load's default)

    @property
    def fits(self) -> bool:
        """Every rank fits its host's memory - reserve (``wired_limits`` says whether a host's limit must be raised
        first)."""
        return all(r.free >= 0 for r in self.ranks)

    def wired_limits(self) -> dict[int, int]:
        """For a plan that fits: rank -> the ``iogpu.wired_limit_mb`` (MiB) to raise its host to, so that the rank's
        weights and cache take at most ``FILL`` of its GPU working set; empty when every rank already does. Under the
        default pipeline split (by working set, as ``load`` splits) every host is raised by the same factor, so that
        ``load`` still makes the planned split; otherwise only the ranks short of it. Never above a host's usable
        memory (memory - reserve): ``tight`` names the ranks still short at the limits."""
        if all(r.wired_ok for r in self.ranks):
            return {}
        if self.split_by_working_set:
            needed = max(r.need / (FILL * r.host.working_set) for r in self.ranks)
            factor = min(needed, min(r.usable / r.host.working_set for r in self.ranks))
            wanted = {r.rank: math.ceil(factor * r.host.working_set / MIB) for r in self.ranks}
        else:
            wanted = {r.rank: wired_limit_mib(r.need) for r in self.ranks if not r.wired_ok}
        limits = {rank: min(mib, self.ranks[rank].usable // MIB) for rank, mib in wanted.items()}
        return {rank: mib for rank, mib in limits.items() if mib * MIB > self.ranks[rank].host.working_set}

    def tight(self, limits: dict[int, int]) -> list[int]:
        """Ranks whose need still takes more than ``FILL`` of their host's working set with ``limits`` applied."""
        return [r.rank for r in self.ranks
                if r.need > FILL * (limits[r.rank] * MIB if r.rank in limits else r.host.working_set)]

    def shortfall(self) -> list[str]:
        """One line per rank that does not fit, and the whole cluster's shortfall; empty when it fits."""
        lines = [f"rank {r.rank} needs {r.need / GB:.1f} GB (weights {r.weights / GB:.1f} + cache {r.cache / GB:.1f})"
                 f" but has {r.usable / GB:.1f} GB usable ({r.host.memory_gib:g} GiB - {self.reserve_gib:g} GiB "
                 f"reserve): short by {-r.free / GB:.1f} GB" for r in self.ranks if r.free < 0]
        if lines:
            need, usable = sum(r.need for r in self.ranks), sum(r.usable for r in self.ranks)
            verdict = (f"short by {(need - usable) / GB:.1f} GB in all" if need > usable
                       else "enough in all: another split may fit")
            lines.append(f"the ranks need {need / GB:.1f} GB together and have {usable / GB:.1f} GB usable: {verdict}")
        return lines


def _usable(host: Host, reserve_gib: float) -> int:
    return int((host.memory_gib - reserve_gib) * GIB)


def _check_hosts(hosts: Sequence[Host], reserve_gib: float) -> None:
    if not hosts:
        raise ValueError("no hosts: expected the memory of at least one host")
    for i, h in enumerate(hosts):
        if not h.memory_gib > reserve_gib:
            raise ValueError(f"host {i}: memory {h.memory_gib:g} GiB; expected more than the {reserve_gib:g} GiB "
                             f"reserve")
        if h.wired_limit_gib is not None and not 0 < h.wired_limit_gib <= h.memory_gib:
            raise ValueError(f"host {i}: wired limit {h.wired_limit_gib:g} GiB; expected a positive number no larger "
                             f"than its {h.memory_gib:g} GiB of memory")
        for what, v in (("bandwidth", h.bandwidth_gbs), ("tflops", h.tflops)):
            if v is not None and not v > 0:
                raise ValueError(f"host {i}: {what} {v:g}; expected a positive number")


def plan_pipeline(acct: Accounting, hosts: Sequence[Host], link: Link = JACCL_TB5,
                  split: Union[None, str, Sequence[int]] = None, context: int = 32768, reserve_gib: float = 8.0,
                  prefill_chunk: int = 2048, kv_bits: Optional[int] = None, kv_group_size: int = 64) -> Plan:
    """Contiguous layer ranges per host (``pipeline_ranges``: by default proportional to each host's GPU working
    set, as ``load(parallel="pipeline")`` splits by each Mac's), the embedding on rank 0, the final norm and
    head on every rank (the final hidden state is shared, not the logits), K3's ``output_attn_res`` on the last.
    ``kv_bits`` / ``kv_group_size``: the latent cache's layout (``cache_bytes``)."""
    _check_hosts(hosts, reserve_gib)
    cfg, n = acct.cfg, len(hosts)
    usable = [_usable(h, reserve_gib) for h in hosts]
    ranges = pipeline_ranges(acct.layer_bytes(), [h.working_set for h in hosts], split)
    head = _head_parts(cfg)
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
    ranks = []
    for r, (host, layers) in enumerate(zip(hosts, ranges)):
        parts = head | ({"embed"} if r == 0 else set()) | ({"output_attn_res"} if r == n - 1 else set())
        ranks.append(RankPlan(r, host, layers, frozenset(parts), None, weight_bytes(acct, layers, parts),
                              cache_bytes(cfg, context, layers, act_bytes=acct.act_bytes, **kv), usable[r]))
    message = [(attn_res_blocks(cfg, rp.layers.stop) + 1) * cfg.hidden_size * acct.act_bytes for rp in ranks[:-1]]
    final = cfg.hidden_size * acct.act_bytes
    return Plan("pipeline", acct, context, reserve_gib, link, tuple(ranks),
                _pipeline_decode(acct, ranks, link, context, head, message, final, kv),
                _pipeline_prefill(acct, ranks, link, context, head, message, final, prefill_chunk),
                max(message + [0]) + 2 * (n - 1) / n * final, kv_bits, kv_group_size, split is None)


def _head_parts(cfg: KimiConfig) -> frozenset:
    """The final norm and the head (the embedding, when tied): replicated on every rank."""
    return frozenset({"embed" if cfg.tie_word_embeddings else "head", "norm"})


def _stage(host: Host, nbytes: float, flops: float) -> float:
    """Seconds of one rank's work: the slower of reading ``nbytes`` and computing ``flops`` (the latter only when
    the host's FLOP/s is known)."""
    t = nbytes / (host.bandwidth_gbs * 1e9)
    if host.tflops is not None:
        t = max(t, flops / (host.tflops * 1e12))
    return t


def _pipeline_decode(acct, ranks, link, context, head, message, final, kv) -> Optional[Speed]:
    if any(rp.host.bandwidth_gbs is None for rp in ranks):
        return None
    body = [rp.parts - head for rp in ranks]
    compute = tuple(_stage(rp.host, decode_bytes(acct, context, rp.layers, b, kv=kv),
                           token_flops(acct, context, rp.layers, b)) for rp, b in zip(ranks, body))
    head_t = max(_stage(rp.host, decode_bytes(acct, context, range(0), head),
                        token_flops(acct, context, range(0), head)) for rp in ranks)
    links = sum(link.send(m) for m in message) + link.all_sum(final, len(ranks))
    return Speed(1, compute, head_t, links, serial=True)


def _pipeline_prefill(acct, ranks, link, context, head, message, final, chunk) -> Optional[Speed]:
    if any(rp.host.bandwidth_gbs is None or rp.host.tflops is None for rp in ranks):
        return None
    chunks = -(-context // chunk)
    body = [rp.parts - head for rp in ranks]

    def stage(rp, parts, layers):
        flops = context * token_flops(acct, context / 2, layers, parts, prefill_chunk=chunk)
        return _stage(rp.host, chunks * chunk_bytes(acct, chunk, layers, parts), flops)

    compute = tuple(stage(rp, b, rp.layers) for rp, b in zip(ranks, body))
    rows = min(chunk, context)
    links = sum(link.send(m * context, chunks) for m in message) + link.all_sum(final * rows, len(ranks))
    return Speed(context, compute, _prefill_head(acct, ranks, head, rows), links, serial=True)


def _prefill_head(acct: Accounting, ranks: Sequence[RankPlan], head: frozenset, rows: int) -> float:
    """Seconds of the replicated norm + head over the last chunk's ``rows`` tokens, in parallel on every rank (MLX
    evaluates only the caches of earlier chunks, never their logits)."""
    return max(_stage(rp.host, chunk_bytes(acct, rows, range(0), head),
                      rows * token_flops(acct, 0, range(0), head)) for rp in ranks)


def plan_tensor(acct: Accounting, hosts: Sequence[Host], link: Link = JACCL_TB5, context: int = 32768,
                reserve_gib: float = 8.0, prefill_chunk: int = 2048, kv_bits: Optional[int] = None,
                kv_group_size: int = 64) -> Plan:
    """Tensor + expert parallelism: every rank holds every layer's ``tensor_shares`` part (KDA and MLA heads, routed
    experts whole, MLP widths on multiples of the quantization group) and the replicated rest (embedding, head,
    norms, routers, MLA ``kv_a_proj`` + norm, q-LoRA ``q_a_proj``, KDA ``f_a`` / ``g_a`` and ``o_norm``, latent-MoE
    down/up projections and norm). Each layer's attention and MLP outputs are combined with one all_sum each.
    ValueError where a rank's heads would cut an output projection inside a quantization group or GGML block (as
    ``load(parallel="tensor")`` would)."""
    _check_hosts(hosts, reserve_gib)
    cfg, n = acct.cfg, len(hosts)
    layers = range(cfg.num_hidden_layers)
    parts = frozenset({"embed", "norm", "head", "output_attn_res"})
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
    shares = tensor_shares(cfg, n, acct.split_unit())
    _check_head_cuts(acct, shares)
    ranks = tuple(
        RankPlan(r, host, layers, parts, share, weight_bytes(acct, layers, parts, share),
                 cache_bytes(cfg, context, layers, share, act_bytes=acct.act_bytes, **kv), _usable(host, reserve_gib))
        for r, (host, share) in enumerate(zip(hosts, shares))
    )
    hidden = cfg.hidden_size * acct.act_bytes
    all_sums = 2 * cfg.num_hidden_layers
    decode = prefill = None
    if all(h.bandwidth_gbs is not None for h in hosts):
        compute = tuple(_stage(rp.host, decode_bytes(acct, context, layers, parts, rp.share, kv),
                               token_flops(acct, context, layers, parts, rp.share)) for rp in ranks)
        decode = Speed(1, compute, 0.0, link.all_sum(all_sums * hidden, n, all_sums), serial=False)
    if all(h.bandwidth_gbs is not None and h.tflops is not None for h in hosts):
        chunks, body = -(-context // prefill_chunk), parts - _head_parts(cfg)
        compute = tuple(_stage(rp.host, chunks * chunk_bytes(acct, prefill_chunk, layers, body, rp.share),
                               context * token_flops(acct, context / 2, layers, body, rp.share, prefill_chunk))
                        for rp in ranks)
        head = _prefill_head(acct, ranks, _head_parts(cfg), min(prefill_chunk, context))
        prefill = Speed(context, compute, head, link.all_sum(all_sums * hidden * context, n, chunks * all_sums),
                        serial=False)
    per_rank = all_sums * 2 * (n - 1) / n * hidden
    return Plan("tensor", acct, context, reserve_gib, link, ranks, decode, prefill, per_rank, kv_bits, kv_group_size)


def _check_head_cuts(acct: Accounting, shares: Sequence[TensorShare]) -> None:
    """Each rank's heads cut the attention output projections (``o_proj``: [hidden, heads x head width]) by column;
    the cuts must fall on whole quantization groups / GGML blocks (``acct.group``), else ValueError naming the
    parameter, its layout, the rank and the columns."""
    for p in acct.params:
        unit = acct.group.get(p.name, 1)
        if p.split not in ("kda_heads", "mla_heads") or not p.name.endswith(".o_proj.weight") or unit == 1:
            continue
        width = p.shape[-1] // _SPLIT_SIZES[p.split](acct.cfg)
        for r, share in enumerate(shares):
            heads = getattr(share, p.split)
            if heads.start * width % unit or heads.stop * width % unit:
                raise ValueError(
                    f"{p.name} ({acct.layout[p.name]}): rank {r}'s heads {heads.start}-{heads.stop - 1} are columns "
                    f"{heads.start * width}:{heads.stop * width}, which do not fall on its {unit}-column groups / "
                    f"blocks; tensor parallelism over {len(shares)} ranks cannot cut it (another rank count, "
                    "pipeline, or a layout with smaller groups can)")
