"""Prompt-cache files: a whole hybrid cache, its token history and the model's identity in one safetensors file.

Layout (format ``kimi-mlx-prompt-cache``, version 1)::

    tokens                      [N] int32      the tokens the cache has seen (N = cache offset)
    layers.{i}.conv_state       [1, K-1, 3*H*D]   KDA layer i (absent while the cache is empty)
    layers.{i}.recurrent_state  [1, H, Dv, Dk] float32
    layers.{i}.kv_latent        [1, 1, N, kv_lora_rank]   MLA layer i
    layers.{i}.k_pe             [1, 1, N, qk_rope_head_dim]
      quantized latent cache (metadata kv_bits / kv_group_size): a part the group divides is stored as mx.quantize
      lays it out, ``layers.{i}.kv_latent`` the uint32 codes [1, 1, N, width*bits/32] with
      ``layers.{i}.kv_latent.scales`` / ``.biases`` [1, 1, N, width/group] (likewise k_pe)
    metadata: format, format_version, offset, layer_kinds ("K"/"M" per layer), model_type, config (the model's
              config as sorted JSON), config_sha256, weights_fingerprint, shard (which rank's part of a distributed
              model, "" for a whole model), kv_bits and kv_group_size of the latent cache ("" for float), and
              "user.{key}" for caller metadata.

The MLA latent is stored whole (the cache's pages concatenated when saving, a copy of it while the file is
written); loading makes the pages views of the file's arrays (no copy).

``load_prompt_cache`` refuses, with an error naming the file and the mismatch, a file of another format or version,
made for another architecture, layer schedule, config (the differing keys are named) or weights (a fingerprint of
the norm weights and of any LoRA/DoRA adapter weights, which quantization and dtype casts leave within tolerance), or
with arrays of the wrong shape, and a file whose latent-cache quantization is not the one asked for (both named).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .cache import HybridCache, KDACache, MLALatentCache, check_kv_quant
from .ops import latent
from .ops.latent import QuantizedLatent

FORMAT = "kimi-mlx-prompt-cache"
FORMAT_VERSION = "1"
_FINGERPRINT_RTOL = 5e-3  # bf16 / float16 casts of the norm weights stay well inside this


class PromptCacheError(ValueError):
    """A prompt-cache file that cannot be used with this model: names the file and what does not match."""


@dataclasses.dataclass
class PromptCache:
    """A loaded prompt-cache file: the cache (ready for ``model(..., cache=cache)``), its tokens and user metadata."""

    cache: HybridCache
    tokens: list[int]
    metadata: dict[str, str]


def _config_dict(model: nn.Module) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(model.args), sort_keys=True, default=str))


def _weights_fingerprint(model: nn.Module) -> list[float]:
    """[sum |w|, sum w^2] over every norm weight, then [sum |w|, sum w^2] over LoRA/DoRA adapter weights (0 without
    adapters): cheap, and independent of the quantization or dtype of the projections."""
    params = tree_flatten(model.parameters())
    out = []
    for chosen in ([v for k, v in params if k.endswith("norm.weight")], [v for k, v in params if ".lora_" in k]):
        out.append(float(sum(mx.abs(v.astype(mx.float32)).sum().item() for v in chosen)))
        out.append(float(sum(mx.square(v.astype(mx.float32)).sum().item() for v in chosen)))
    return out


def model_identity(model: nn.Module) -> dict[str, str]:
    """What a prompt-cache file records about the model it was made with (all values strings)."""
    config = json.dumps(_config_dict(model), sort_keys=True)
    return {
        "model_type": str(model.args.model_type),
        "layer_kinds": "".join("K" if layer.is_linear else "M" for layer in model.layers),
        "config": config,
        "config_sha256": hashlib.sha256(config.encode()).hexdigest(),
        "weights_fingerprint": json.dumps(_weights_fingerprint(model)),
        "shard": getattr(model, "shard", ""),  # one rank's part of a distributed model (``kimi_mlx.parallel``)
    }


def save_prompt_cache(
    path: Union[str, Path],
    model: nn.Module,
    cache: HybridCache,
    tokens: list[int],
    metadata: Optional[dict[str, str]] = None,
) -> None:
    """Write ``cache`` (one sequence, after ``tokens``) with ``model``'s identity and ``metadata`` (str -> str)."""
    offsets = {c.offset for c in cache}
    if len(offsets) > 1:
        raise ValueError(f"cache layers disagree on the offset ({sorted(offsets)}); cannot save")
    offset = cache[0].offset if len(cache) else 0
    if len(tokens) != offset:
        raise ValueError(f"token history has {len(tokens)} tokens but the cache has seen {offset}")
    if len(cache) != len(model.layers):
        raise ValueError(f"cache has {len(cache)} layers, the model {len(model.layers)}")
    arrays = {"tokens": mx.array(list(tokens), dtype=mx.int32)}
    for i, c in enumerate(cache):
        if isinstance(c, KDACache):
            if c.conv_state is not None:
                arrays[f"layers.{i}.conv_state"] = c.conv_state
                arrays[f"layers.{i}.recurrent_state"] = c.recurrent_state
        elif c.offset:
            for name, part in zip(("kv_latent", "k_pe"), c.whole()):
                for suffix, a in zip(("", ".scales", ".biases"), latent.arrays(part)):  # codes, scales, biases
                    arrays[f"layers.{i}.{name}{suffix}"] = a
    if cache[0].left_padding is not None or any(a.shape[0] != 1 for k, a in arrays.items() if k != "tokens"):
        raise ValueError("a prompt-cache file holds one sequence; this cache is a batch")
    quant = cache.kv_quant
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "offset": str(offset), **model_identity(model),
            "kv_bits": "" if quant is None else str(quant[0]), "kv_group_size": "" if quant is None else str(quant[1])}
    for key, value in (metadata or {}).items():
        if not isinstance(value, str):
            raise TypeError(f"prompt-cache metadata '{key}' must be a string, got {type(value).__name__}")
        meta[f"user.{key}"] = value
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, meta)
    tmp.replace(path)


def _check_identity(source: str, meta: dict[str, str], model: nn.Module) -> None:
    mine = model_identity(model)
    for key in ("model_type", "layer_kinds", "shard"):
        if meta.get(key, "") != mine[key]:
            raise PromptCacheError(
                f"{source}: made for another model: {key} is {meta.get(key)!r} in the file, {mine[key]!r} here"
            )
    if meta.get("config_sha256") != mine["config_sha256"]:
        try:
            theirs = json.loads(meta.get("config", ""))
        except json.JSONDecodeError:
            raise PromptCacheError(f"{source}: metadata 'config' is not valid JSON") from None
        ours = _config_dict(model)
        diff = [
            f"{k}: {theirs.get(k)!r} in the file, {ours.get(k)!r} here"
            for k in sorted(set(theirs) | set(ours))
            if k in theirs and k in ours and theirs[k] != ours[k]
        ]
        if diff:
            raise PromptCacheError(f"{source}: made for another model config: " + "; ".join(diff))
    try:
        theirs_fp = [float(x) for x in json.loads(meta.get("weights_fingerprint", ""))]
    except (json.JSONDecodeError, TypeError, ValueError):
        raise PromptCacheError(f"{source}: metadata 'weights_fingerprint' is missing or malformed") from None
    ours_fp = json.loads(mine["weights_fingerprint"])
    same = len(theirs_fp) == len(ours_fp) and all(
        math.isclose(a, b, rel_tol=_FINGERPRINT_RTOL, abs_tol=1e-6) for a, b in zip(theirs_fp, ours_fp)
    )
    if not same:
        raise PromptCacheError(
            f"{source}: made with different weights or adapters (weight fingerprint {theirs_fp} in the file, "
            f"{ours_fp} here)"
        )


def _expect(source: str, arrays: dict, name: str, shape: tuple) -> mx.array:
    if name not in arrays:
        raise PromptCacheError(f"{source}: tensor '{name}' is missing")
    a = arrays[name]
    if tuple(a.shape) != shape:
        raise PromptCacheError(f"{source}: tensor '{name}' has shape {tuple(a.shape)}, expected {shape}")
    return a


def _quant_name(quant: Optional[tuple[int, int]]) -> str:
    return "a float latent cache" if quant is None else f"kv_bits={quant[0]}, kv_group_size={quant[1]}"


def _expect_part(source: str, arrays: dict, name: str, lead: tuple, width: int, quant: Optional[tuple[int, int]]):
    """A latent part as stored: a float array, or a ``QuantizedLatent`` when quantized and the group divides it."""
    if quant is None or width % quant[1]:
        return _expect(source, arrays, name, (*lead, width))
    bits, group = quant
    return QuantizedLatent(_expect(source, arrays, name, (*lead, width * bits // 32)),
                           _expect(source, arrays, f"{name}.scales", (*lead, width // group)),
                           _expect(source, arrays, f"{name}.biases", (*lead, width // group)), bits, group)


def load_prompt_cache(
    path: Union[str, Path], model: nn.Module, max_checkpoints: int = 8, *, kv_bits: Optional[int] = None,
    kv_group_size: int = 64, quantized_kv_start: int = 0,
) -> PromptCache:
    """Read a file written by ``save_prompt_cache`` into a new cache of ``model`` (see the module doc for checks).

    ``kv_bits`` / ``kv_group_size``: the latent-cache quantization expected (None: float). A quantized file must have
    exactly that setting; a float file is refused when quantization is asked for, unless it holds fewer than
    ``quantized_kv_start`` tokens (a cache not converted yet)."""
    check_kv_quant(kv_bits, kv_group_size)
    source = str(path)
    if not Path(path).is_file():
        raise PromptCacheError(f"{source}: no such prompt-cache file")
    try:
        arrays, meta = mx.load(source, return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise PromptCacheError(f"{source}: not a readable safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise PromptCacheError(f"{source}: not a kimi-mlx prompt-cache file (metadata 'format' is {meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise PromptCacheError(
            f"{source}: prompt-cache format version {meta.get('format_version')!r}; this kimi-mlx reads {FORMAT_VERSION}"
        )
    _check_identity(source, meta, model)
    try:
        offset = int(meta.get("offset", ""))
    except ValueError:
        raise PromptCacheError(f"{source}: metadata 'offset' is {meta.get('offset')!r}, expected an integer") from None
    tokens = _expect(source, arrays, "tokens", (offset,))
    try:
        file_quant = (int(meta["kv_bits"]), int(meta["kv_group_size"])) if meta.get("kv_bits", "") else None
        check_kv_quant(*(file_quant or (None, 64)))
    except (KeyError, ValueError):
        raise PromptCacheError(f"{source}: metadata kv_bits / kv_group_size is {meta.get('kv_bits')!r} / "
                               f"{meta.get('kv_group_size')!r}, not a latent-cache quantization") from None
    wanted = None if kv_bits is None else (kv_bits, kv_group_size)
    if file_quant != wanted and not (file_quant is None and offset < quantized_kv_start):
        raise PromptCacheError(
            f"{source}: saved with {_quant_name(file_quant)}, but {_quant_name(wanted)} was asked for; load it with "
            "the setting it was saved with"
        )
    cfg = model.args
    cache = model.make_cache(max_checkpoints=max_checkpoints, kv_bits=file_quant and file_quant[0],
                             kv_group_size=file_quant[1] if file_quant else 64)
    batch = 1
    for i, c in enumerate(cache):
        c.offset = offset
        if offset == 0:
            continue
        if isinstance(c, KDACache):
            heads = getattr(model.layers[i].self_attn, "num_heads", 0)  # this rank's heads (tensor parallel: a part)
            channels = 3 * heads * cfg.kda_head_dim
            c.conv_state = _expect(
                source, arrays, f"layers.{i}.conv_state", (batch, cfg.short_conv_kernel_size - 1, channels)
            )
            c.recurrent_state = _expect(
                source, arrays, f"layers.{i}.recurrent_state", (batch, heads, cfg.kda_head_dim, cfg.kda_head_dim),
            )
        elif isinstance(c, MLALatentCache):
            c.load(*(_expect_part(source, arrays, f"layers.{i}.{name}", (batch, 1, offset), width, file_quant)
                     for name, width in (("kv_latent", cfg.kv_lora_rank), ("k_pe", cfg.qk_rope_head_dim))))
    user = {k[len("user.") :]: v for k, v in meta.items() if k.startswith("user.")}
    return PromptCache(cache, tokens.tolist(), user)
