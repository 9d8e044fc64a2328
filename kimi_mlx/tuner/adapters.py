"""LoRA / DoRA adapters on Kimi Linear and Kimi-K3: which projections get one, save / load in mlx-lm's format, fuse.

The adapter layers are mlx-lm's (``LoRALinear``, ``DoRALinear``, ``LoRASwitchLinear`` for the stacked routed experts:
one rank-r update per expert, ``lora_a: [E, r, in]``, ``lora_b: [E, out, r]``), so an ``adapters.safetensors`` +
``adapter_config.json`` pair is interchangeable with ``mlx_lm.lora`` / ``mlx_lm.fuse`` on the same checkpoint
(parameter paths match mlx-lm's ``kimi_linear`` / ``kimi_k3``).

The module selection is ours rather than mlx-lm's ``linear_to_lora_layers``: mlx-lm picks modules by their path
inside a layer, which cannot tell a KDA ``q_proj`` from an MLA one (both are ``self_attn.q_proj``), so here every
projection belongs to a named group (``PROJECTION_GROUPS``) decided by the layer's type. Loading wraps exactly the
modules the adapter file names (whatever tool wrote it) and checks every tensor's name and shape first.

A GGML-block base (``layers.ggml``: IQ*, Q6_K, ... kept as the GGUF's blocks) trains like a quantized one (QLoRA): the
blocks stay frozen and byte-for-byte unchanged, the float adapters train beside them. Fusing into such a base gives
float32 layers (the exact dequantization plus the update): there is no exact re-encoding into GGML blocks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear

from ..layers.ggml import GGML_LAYERS, GGMLLinear, GGMLSwitchLinear, ggml_type_of
from ..ops.ggml import dequantize as ggml_dequantize

ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
ADAPTER_LEAVES = ("lora_a", "lora_b", "m")
LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear, GGMLLinear)
SWITCH_TYPES = (SwitchLinear, QuantizedSwitchLinear, GGMLSwitchLinear)
ADAPTER_TYPES = (LoRALinear, DoRALinear, LoRASwitchLinear)

# Projection groups, by the path of the module inside a decoder layer. KDA and MLA layers are told apart by the
# layer type, so "kda" and "mla" can be chosen independently although both own a ``self_attn.q_proj``.
PROJECTION_GROUPS: dict[str, tuple[str, ...]] = {
    "kda": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj", "self_attn.o_proj"),
    "kda_gates": (
        "self_attn.f_a_proj",
        "self_attn.f_b_proj",
        "self_attn.b_proj",
        "self_attn.g_a_proj",
        "self_attn.g_b_proj",
        "self_attn.g_proj",
    ),
    "mla": (
        "self_attn.q_proj",
        "self_attn.q_a_proj",
        "self_attn.q_b_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.o_proj",
        "self_attn.g_proj",
    ),
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "shared_experts": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"),
    "experts": (
        "mlp.switch_mlp.gate_proj",
        "mlp.switch_mlp.up_proj",
        "mlp.switch_mlp.down_proj",
        "mlp.routed_expert_down_proj",
        "mlp.routed_expert_up_proj",
    ),
    "router": ("mlp.gate",),
    "attn_res": ("self_attention_res.proj", "mlp_res.proj"),
}
KDA_ONLY, MLA_ONLY = {"kda", "kda_gates"}, {"mla"}


class AdapterError(ValueError):
    """An adapter directory that cannot be used with this model (names the file and the offending tensor/key)."""


def parse_projections(spec: Union[str, Iterable[str], None]) -> tuple[str, ...]:
    """``"all"`` / None -> every group; ``"kda,mla"`` or a list -> those groups (unknown names are an error)."""
    if spec is None or spec == "all":
        return tuple(PROJECTION_GROUPS)
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    unknown = [n for n in names if n not in PROJECTION_GROUPS]
    if unknown or not names:
        raise ValueError(
            f"projections {spec!r}: unknown group(s) {unknown}; choose from {', '.join(PROJECTION_GROUPS)} or 'all'"
        )
    return tuple(dict.fromkeys(names))


def _layer_prefix(model: nn.Module) -> str:
    """Path of ``model.layers`` inside the model (``model.layers`` or ``language_model.model.layers``)."""
    return "language_model.model.layers" if "language_model" in model else "model.layers"


def select_modules(model: nn.Module, projections: Iterable[str], num_layers: int = -1) -> dict[str, nn.Module]:
    """Full path -> module for the adaptable projections of the chosen groups in the last ``num_layers`` decoder
    layers (-1 = all). A group that does not exist in a layer type (e.g. ``mla`` in a KDA layer) selects nothing."""
    layers = model.layers
    if num_layers > len(layers):
        raise ValueError(f"num_layers={num_layers}: the model has only {len(layers)} layers")
    start = 0 if num_layers < 0 else len(layers) - num_layers
    prefix = _layer_prefix(model)
    chosen: dict[str, nn.Module] = {}
    for i in range(start, len(layers)):
        layer = layers[i]
        modules = dict(layer.named_modules())
        for group in projections:
            if (group in KDA_ONLY and not layer.is_linear) or (group in MLA_ONLY and layer.is_linear):
                continue
            for rel in PROJECTION_GROUPS[group]:
                module = modules.get(rel)
                if isinstance(module, (*LINEAR_TYPES, *SWITCH_TYPES)):
                    chosen[f"{prefix}.{i}.{rel}"] = module
    return chosen


def _wrap(module: nn.Module, path: str, fine_tune_type: str, rank: int, scale: float, dropout: float) -> nn.Module:
    if isinstance(module, SWITCH_TYPES):
        if fine_tune_type == "dora":
            raise ValueError(
                f"{path}: DoRA has no per-expert form (mlx-lm's neither); leave out the 'experts' group or use LoRA"
            )
        return LoRASwitchLinear.from_base(module, r=rank, scale=scale, dropout=dropout)
    if isinstance(module, GGMLLinear):  # mlx-lm's from_base would read the block bytes per row as the input width
        if fine_tune_type == "dora":
            raise ValueError(f"{path}: DoRA rescales by the norms of the dense weight, which a GGML-block "
                             f"({module.ggml_type}) base does not hold; use LoRA on it")
        lora = LoRALinear(module.input_dims, module.output_dims, r=rank, dropout=dropout, scale=scale)
        lora.linear = module
        return lora
    cls = DoRALinear if fine_tune_type == "dora" else LoRALinear
    return cls.from_base(module, r=rank, scale=scale, dropout=dropout)


def apply_adapters(
    model: nn.Module,
    paths: Iterable[str],
    fine_tune_type: str = "lora",
    rank: int = 8,
    scale: float = 20.0,
    dropout: float = 0.0,
) -> list[str]:
    """Freeze the model and replace each module at ``paths`` by a LoRA/DoRA wrapper (only the adapters train).

    Returns the wrapped paths. Adapter weights start as mlx-lm's (``lora_a`` uniform, ``lora_b`` zero: the model's
    outputs are unchanged until training moves them).
    """
    if fine_tune_type not in ("lora", "dora"):
        raise ValueError(f"fine_tune_type={fine_tune_type!r}: expected 'lora' or 'dora'")
    if rank < 1:
        raise ValueError(f"rank={rank}: expected >= 1")
    model.freeze()
    modules = dict(model.named_modules())
    wrapped = []
    for path in paths:
        module = modules.get(path)
        if not isinstance(module, (*LINEAR_TYPES, *SWITCH_TYPES)):
            raise ValueError(f"{path}: not a linear projection of this model (found {type(module).__name__})")
        wrapped.append((path, _wrap(module, path, fine_tune_type, rank, scale, dropout)))
    if wrapped:
        model.update_modules(tree_unflatten(wrapped))
    return [p for p, _ in wrapped]


def adapter_weights(model: nn.Module) -> dict[str, mx.array]:
    """The trainable adapter tensors (``…lora_a``, ``…lora_b``, DoRA's ``…m``) by full parameter path."""
    return dict(tree_flatten(model.trainable_parameters()))


def adapter_config(
    model: nn.Module,
    paths: Iterable[str],
    fine_tune_type: str,
    rank: int,
    scale: float,
    dropout: float,
    num_layers: int,
    projections: Iterable[str],
    **extra,
) -> dict:
    """``adapter_config.json`` in mlx-lm's schema (``fine_tune_type``, ``num_layers``, ``lora_parameters`` with the
    layer-relative ``keys``) plus ``model_type`` and our ``projections`` / ``adapter_paths``."""
    prefix = _layer_prefix(model) + "."
    keys = sorted({p[len(prefix) :].split(".", 1)[1] for p in paths if p.startswith(prefix)})
    return {
        "fine_tune_type": fine_tune_type,
        "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": dropout, "keys": keys},
        "model_type": model.model_type,
        "projections": list(projections),
        "adapter_paths": sorted(paths),
        **extra,
    }


def save_adapters(
    model: nn.Module, adapter_dir: Union[str, Path], config: Optional[dict] = None, file_name: str = ADAPTER_FILE
) -> Path:
    """Write the adapter tensors to ``adapter_dir/file_name`` (and ``adapter_config.json`` when ``config``)."""
    out = Path(adapter_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / file_name), adapter_weights(model))
    if config is not None:
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out / file_name


def read_adapter_config(adapter_dir: Union[str, Path]) -> dict:
    """The parsed ``adapter_config.json`` of ``adapter_dir`` (errors name the file and the problem)."""
    path = Path(adapter_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: missing (an adapter directory holds {CONFIG_FILE} and {ADAPTER_FILE})") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from None
    params = config.get("lora_parameters") if isinstance(config, dict) else None
    if config.get("fine_tune_type", "lora") not in ("lora", "dora"):
        raise AdapterError(
            f"{path}: fine_tune_type={config.get('fine_tune_type')!r}; only 'lora' and 'dora' adapters can be loaded"
        )
    if not isinstance(params, dict) or "rank" not in params or "scale" not in params:
        raise AdapterError(f"{path}: expected 'lora_parameters' with 'rank' and 'scale' (mlx-lm's schema)")
    return config


def _module_paths(weights: dict[str, mx.array], source: Path) -> dict[str, dict[str, mx.array]]:
    """Group adapter tensors by the module they belong to: ``{path: {"lora_a": …, "lora_b": …}}``."""
    by_module: dict[str, dict[str, mx.array]] = {}
    for name, value in weights.items():
        path, _, leaf = name.rpartition(".")
        if leaf not in ADAPTER_LEAVES or not path:
            raise AdapterError(
                f"{source}: tensor {name!r} is not an adapter tensor (expected names ending in "
                f"{', '.join(ADAPTER_LEAVES)})"
            )
        by_module.setdefault(path, {})[leaf] = value
    return by_module


def load_adapter_weights(model: nn.Module, file: Union[str, Path]) -> None:
    """Load adapter tensors into a model whose adapters are already in place (e.g. to resume training); every
    tensor must name one of the model's adapter parameters with the same shape (``AdapterError`` otherwise)."""
    file = Path(file)
    try:
        weights = mx.load(str(file))
    except Exception as e:  # missing or unreadable: MLX raises RuntimeError/ValueError
        raise AdapterError(f"{file}: cannot read adapter safetensors ({e})") from None
    expected = adapter_weights(model)
    problems = [
        f"{k}: not an adapter parameter of this model"
        if k not in expected
        else f"{k}: shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}"
        for k, v in weights.items()
        if k not in expected or tuple(v.shape) != tuple(expected[k].shape)
    ]
    if problems or not weights:
        raise AdapterError(
            f"{file}: does not fit the adapters being trained (other --rank, --projections or model?): "
            + ("; ".join(problems[:8]) or "no tensors")
        )
    model.load_weights(list(weights.items()), strict=False)


def load_adapters(model: nn.Module, adapter_dir: Union[str, Path], file_name: str = ADAPTER_FILE) -> dict:
    """Wrap the modules named in ``adapter_dir``'s adapter file and load its tensors; returns the adapter config.

    Works with adapters written by ``kimi-mlx lora`` and by ``mlx_lm.lora`` on the same checkpoint. Everything is
    checked before the model changes: a tensor for a module this model does not have, or with a shape other than
    the model's projection implies (an adapter trained for another model), raises ``AdapterError`` naming it.
    """
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterError(f"{adapter_dir}: no such adapter directory")
    config = read_adapter_config(adapter_dir)
    source = adapter_dir / file_name
    try:
        weights = mx.load(str(source))
    except FileNotFoundError:
        raise AdapterError(f"{source}: missing") from None
    except Exception as e:  # MLX raises a bare RuntimeError/ValueError for unreadable files
        raise AdapterError(f"{source}: cannot read safetensors ({e})") from None
    if not weights:
        raise AdapterError(f"{source}: holds no tensors")
    model_type = getattr(model, "model_type", None)
    if config.get("model_type") not in (None, model_type):
        raise AdapterError(
            f"{adapter_dir / CONFIG_FILE}: adapter trained for a {config['model_type']} model, not {model_type}"
        )
    params = config["lora_parameters"]
    fine_tune_type = config.get("fine_tune_type", "lora")
    rank, scale, dropout = int(params["rank"]), float(params["scale"]), float(params.get("dropout", 0.0))
    modules = dict(model.named_modules())
    by_module = _module_paths(weights, source)
    wrapped, problems = [], []
    for path, tensors in sorted(by_module.items()):
        module = modules.get(path)
        if isinstance(module, ADAPTER_TYPES):
            problems.append(f"{path}: the model already has an adapter there")
            continue
        if not isinstance(module, (*LINEAR_TYPES, *SWITCH_TYPES)):
            found = "nothing" if module is None else type(module).__name__
            problems.append(f"{path}: no linear projection at this path in the model (found {found})")
            continue
        wrapper = _wrap(module, path, fine_tune_type, rank, scale, dropout)
        expected = dict(tree_flatten(wrapper.trainable_parameters()))
        for leaf, value in tensors.items():
            if leaf not in expected:
                problems.append(f"{path}.{leaf}: not a parameter of a {fine_tune_type} adapter on this module")
            elif tuple(value.shape) != tuple(expected[leaf].shape):
                problems.append(f"{path}.{leaf}: shape {tuple(value.shape)}, expected {tuple(expected[leaf].shape)}")
        wrapped.append((path, wrapper))
    if problems:
        more = f" and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise AdapterError(
            f"{source}: adapter does not fit this {getattr(model, 'model_type', 'model')} model (trained for another "
            f"model?): " + "; ".join(problems[:8]) + more
        )
    model.freeze()
    model.update_modules(tree_unflatten(wrapped))
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    return config


def _float_twin(module: nn.Module) -> nn.Module:
    """A GGML-block layer as nn.Linear / SwitchLinear / nn.Embedding holding its exact dequantization (float32
    ``[out, in]`` / ``[E, out, in]`` / ``[vocab, dims]``) and its bias."""
    w = ggml_dequantize(module["weight"], module.ggml_type)
    bias = "bias" in module
    if isinstance(module, GGMLSwitchLinear):
        dense = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias=bias)
    elif isinstance(module, GGMLLinear):
        dense = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    else:
        dense = nn.Embedding(*w.shape)
    dense.weight = w
    if bias:
        dense.bias = module["bias"]
    return dense


def _fused(adapter: nn.Module, dequantize: bool) -> nn.Module:
    """mlx-lm's ``fuse`` of one adapter; over a GGML-block base, into its exact float32 weights (the result is a
    float layer whatever ``dequantize``: there is no exact re-encoding into GGML blocks)."""
    if ggml_type_of(adapter.linear) is not None:
        adapter.linear = _float_twin(adapter.linear)
    return adapter.fuse(dequantize=dequantize)


def fuse_adapters(model: nn.Module, dequantize: bool = False) -> int:
    """Merge every adapter into its base projection (``W + scale * B A``, DoRA's magnitude rescale), in place.

    A quantized base is dequantized, merged and re-quantized with its own group size / bits / mode (mlx-lm's
    ``fuse``), unless ``dequantize``. A GGML-block base becomes float32 (its exact dequantization + the update).
    Returns how many adapters were fused.
    """
    fused = [(path, _fused(m, dequantize)) for path, m in model.named_modules() if isinstance(m, ADAPTER_TYPES)]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return len(fused)


def adapters_on_ggml_blocks(model: nn.Module) -> int:
    """How many adapters of ``model`` sit on a GGML-block projection (:func:`fuse_adapters` writes those as
    float32)."""
    return sum(isinstance(m, ADAPTER_TYPES) and ggml_type_of(m.linear) is not None for _, m in model.named_modules())


def dequantize_all(model: nn.Module) -> nn.Module:
    """Replace every quantized module by its float form, in place: mlx-lm's ``dequantize_model`` (Linear,
    Embedding, SwitchLinear) plus the MLA ``QuantizedMultiLinear`` heads (``embed_q`` / ``unembed_out``), which it
    leaves quantized, and the GGML-block layers (exactly dequantized, float32)."""
    from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear
    from mlx_lm.utils import dequantize_model

    model = dequantize_model(model)
    dense = []
    for path, m in model.named_modules():
        if isinstance(m, QuantizedMultiLinear):
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode)
            head = MultiLinear(w.shape[2], w.shape[1], w.shape[0])
            head.weight = w
            dense.append((path, head))
        elif isinstance(m, GGML_LAYERS):
            dense.append((path, _float_twin(m)))
    if dense:
        model.update_modules(tree_unflatten(dense))
    return model
