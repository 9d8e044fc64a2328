"""GGML-block layers (issue 15) beyond loading a GGUF: ``kimi-mlx convert`` keeps the blocks as they are in the MLX
directory (``{"ggml_type": ...}`` overrides in ``quantization``) and ``kimi_mlx.load`` of that directory gives the
GGUF's logits exactly; LoRA trains on a GGML-block base (gradients as on its F32 twin) and fusing gives float32
layers. Bad GGML entries in a directory are refused naming the module / tensor and what was expected."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear
from mlx_lm.tuner.trainer import default_loss
from test_gguf_load import _logits, _manifest
from test_gguf_native import NATIVE_TYPES, _ggml_layers, _wide_pair
from test_lora import TOKENS, as_batch, frozen_params, pattern_data, randomize_adapters, run_training

import kimi_mlx
from kimi_mlx.cli.convert import convert
from kimi_mlx.cli.fuse import fuse_model
from kimi_mlx.convert.hf import CheckpointError
from kimi_mlx.layers.ggml import GGMLLinear, GGMLSwitchLinear
from kimi_mlx.ops.ggml import FORMATS
from kimi_mlx.tuner.adapters import adapter_config, apply_adapters, fuse_adapters, save_adapters, select_modules

# K3 also gets its KDA q/k/v projections in one block type: the directory fuses them into ``qkv_proj`` (mlx-lm's
# kimi_k3 layout) and the override must follow
TYPES = {
    KL_FIXTURE: NATIVE_TYPES[KL_FIXTURE],
    K3_FIXTURE: {**NATIVE_TYPES[K3_FIXTURE], "attn_q.weight": "Q6_K", "attn_k.weight": "Q6_K",
                 "attn_v.weight": "Q6_K"},
}


def _args(src: Path, out: Path, **kw) -> SimpleNamespace:
    args = dict(model=str(src), out=str(out), quantize=None, q_group_size=64, dtype=None, requantize=False,
                gguf_scales="float32", force=False, max_shard_gb=5.0, quiet=True)
    return SimpleNamespace(**{**args, **kw})


def _gguf_blocks(path: Path) -> list[bytes]:
    """The bytes of every block-type tensor of a GGUF, KDA q/k/v of a layer concatenated (as one fused qkv_proj)."""
    tensors = {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(str(path)).tensors
               if t.tensor_type.name in FORMATS}
    for q in [n for n in tensors if n.endswith(".attn_q.weight")]:
        prefix = q[: -len("attn_q.weight")]
        tensors[q] = b"".join(tensors.pop(f"{prefix}attn_{n}.weight") for n in "qkv")
    return sorted(tensors.values())


def _dir_blocks(out: Path) -> list[bytes]:
    weights = mx.load(str(out / "model.safetensors"))
    return sorted(np.array(v).tobytes() for v in weights.values() if v.dtype == mx.uint8)


@pytest.mark.parametrize("d", [KL_FIXTURE, K3_FIXTURE], ids=["kimi_linear", "kimi_k3"])
def test_convert_keeps_blocks(d, tmp_path, capsys):
    """GGUF with IQ / K-quant layers -> MLX directory: the block tensors written byte-equal to the GGUF's (uint8
    [..., rows, row_bytes]; K3's q/k/v fused into qkv_proj with its override), one ``{"ggml_type"}`` override per
    block module and no affine default; reloaded, the logits equal the GGUF's exactly; the note says mlx-lm cannot
    read it."""
    blocks, _, block_bytes = _wide_pair(d, tmp_path, TYPES[d])
    out = convert(_args(blocks, tmp_path / "out"))
    assert "mlx-lm cannot" in capsys.readouterr().err
    assert _dir_blocks(out) == _gguf_blocks(blocks)
    assert sum(map(len, _dir_blocks(out))) == block_bytes
    entry = json.loads((out / "config.json").read_text())["quantization"]
    assert not {"bits", "group_size", "mode"} & set(entry)
    assert {v["ggml_type"] for v in entry.values()} == set(TYPES[d].values())
    model, _ = kimi_mlx.load(out)
    ref, _ = kimi_mlx.load(str(blocks))
    held = {p: m.ggml_type for p, m in _ggml_layers(model).items()}
    assert held == {p: v["ggml_type"] for p, v in entry.items()}
    if d == K3_FIXTURE:  # the KDA layers' (0, 1, 3) q/k/v, one fused module each
        assert {p for p in held if ".self_attn." in p} == {
            f"language_model.model.layers.{i}.self_attn.qkv_proj" for i in (0, 1, 3)}
    ids = _manifest(d)["token_ids"]
    assert np.array_equal(_logits(model, ids), _logits(ref, ids))


@pytest.mark.filterwarnings("ignore:.*not bit-exact in MLX")  # --requantize's second warning
def test_convert_quantize_float_layers_only(tmp_path, capsys):
    """``--quantize 4`` on a source with GGML blocks quantizes the float layers only (the blocks are already
    quantized, and exact): same logits as ``kimi_mlx.load(gguf, quantize=4)``, the blocks byte-equal to the GGUF's,
    the note says so. ``--requantize`` writes MLX affine instead and no block at all."""
    blocks, _, _ = _wide_pair(KL_FIXTURE, tmp_path, TYPES[KL_FIXTURE])
    out = convert(_args(blocks, tmp_path / "q4", quantize=4))
    assert "--quantize 4 applied to the float layers only" in capsys.readouterr().err
    entry = json.loads((out / "config.json").read_text())["quantization"]
    assert (entry["bits"], entry["group_size"]) == (4, 64)
    assert _dir_blocks(out) == _gguf_blocks(blocks)
    model, _ = kimi_mlx.load(out)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    ref, _ = kimi_mlx.load(str(blocks), quantize=4)
    ids = _manifest(KL_FIXTURE)["token_ids"]
    assert np.array_equal(_logits(model, ids), _logits(ref, ids))

    with pytest.warns(UserWarning, match="re-quantized to MLX affine"):
        out = convert(_args(blocks, tmp_path / "req", requantize=True))
    assert "mlx-lm cannot" not in capsys.readouterr().err
    assert not _dir_blocks(out)
    assert not any("ggml_type" in str(v) for v in json.loads((out / "config.json").read_text())["quantization"].values())


@pytest.fixture(scope="module")
def kl_blocks_dir(tmp_path_factory) -> Path:
    """The Kimi Linear GGUF with IQ / K-quant layers converted to an MLX directory."""
    tmp = tmp_path_factory.mktemp("ggml_dir")
    blocks, _, _ = _wide_pair(KL_FIXTURE, tmp, TYPES[KL_FIXTURE])
    return convert(_args(blocks, tmp / "out"))


def _edited(src: Path, dst: Path, entry=None, tensors=None) -> Path:
    """A copy of model directory ``src`` with ``quantization`` entries and tensors replaced."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["quantization"].update(entry or {})
    (dst / "config.json").write_text(json.dumps(config))
    weights = {**mx.load(str(src / "model.safetensors")), **(tensors or {})}
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


GATE = "model.layers.1.mlp.switch_mlp.gate_proj"  # IQ2_XXS experts [4, 256, 256 // 256 * 66]


@pytest.mark.parametrize("case", ["unknown type", "byte width", "float tensor", "no such module", "block width"])
def test_bad_ggml_entries_are_refused(case, kl_blocks_dir, tmp_path):
    """An unknown ggml_type, a block tensor of another byte width or dtype, an override for a module the model does
    not have or whose input width is not whole blocks: a CheckpointError naming the module / tensor and what was
    expected."""
    w = mx.load(str(kl_blocks_dir / "model.safetensors"))[f"{GATE}.weight"]
    edits, match = {
        "unknown type": ({"entry": {GATE: {"ggml_type": "IQ9_Z"}}},
                         rf"quantization entry '{GATE}': ggml_type 'IQ9_Z' is not a GGML block type.*IQ2_XXS"),
        "byte width": ({"tensors": {f"{GATE}.weight": w[..., :-2]}},
                       rf"tensor {GATE}\.weight: IQ2_XXS blocks of 256-wide rows \(66 bytes per row\) expected as "
                       r"uint8 \(4, 256, 66\), found uint8 \(4, 256, 64\)"),
        "float tensor": ({"tensors": {f"{GATE}.weight": w.astype(mx.float32)}},
                         rf"tensor {GATE}\.weight: .*expected as uint8 \(4, 256, 66\), found float32"),
        "no such module": ({"entry": {"model.layers.9.mlp.gate_proj": {"ggml_type": "Q6_K"}}},
                           r"no layer at model\.layers\.9\.mlp\.gate_proj"),
        "block width": ({"entry": {"model.layers.0.self_attn.f_b_proj": {"ggml_type": "Q6_K"}}},
                        r"model\.layers\.0\.self_attn\.f_b_proj: Q6_K needs an input width that is a multiple of "
                        r"256, got 64"),
    }[case]
    bad = _edited(kl_blocks_dir, tmp_path / "bad", **edits)
    with pytest.raises(CheckpointError, match=match):
        kimi_mlx.load(bad)


# ------------------------------------------------------------------------------------------------ LoRA


def _adapted(path: Path, groups: tuple[str, ...]):
    """Model of ``path`` with the same LoRA adapters (random lora_a and lora_b) on the projections of ``groups``."""
    model, _ = kimi_mlx.load(str(path), dtype=mx.float32)
    mx.random.seed(0)
    paths = list(select_modules(model, groups))
    apply_adapters(model, paths, rank=4, scale=10.0)
    randomize_adapters(model, seed=1)
    return model, paths


def _grads(model, data) -> dict[str, mx.array]:
    grads = mx.grad(lambda p: (model.update(p), default_loss(model, *as_batch(data))[0])[1])(
        model.trainable_parameters())
    return dict(tree_flatten(grads))


def test_lora_on_ggml_base(tmp_path, capsys):
    """LoRA on IQ experts (LoRASwitchLinear over GGMLSwitchLinear, sorted per-expert path), K-quant shared experts
    (LoRALinear over GGMLLinear, dims of the weights, not of the bytes) and the float attention: the gradients at
    step 0 equal those of the same adapters on the F32 twin (1e-4); training lowers the loss and leaves every block
    byte unchanged; fusing (in memory, and ``kimi-mlx fuse`` from the GGUF) gives float32 layers where the adapters
    were and the adapted logits (1e-4); DoRA on a block base is refused."""
    groups = ("kda", "mla", "shared_experts", "experts")
    blocks, twin, _ = _wide_pair(KL_FIXTURE, tmp_path, TYPES[KL_FIXTURE])
    model, paths = _adapted(blocks, groups)
    ref, _ = _adapted(twin, groups)
    modules = dict(model.named_modules())
    wrapped = {type(modules[p].linear) for p in paths}
    assert {GGMLLinear, GGMLSwitchLinear} <= wrapped
    shared_up = modules["model.layers.1.mlp.shared_experts.up_proj"]  # Q2_K: 256 x 256 weights, 84 bytes a row
    assert isinstance(shared_up, LoRALinear) and shared_up.linear.weight.shape == (256, 84)
    assert shared_up.lora_a.shape == (256, 4) and shared_up.lora_b.shape == (4, 256)
    assert isinstance(modules[GATE], LoRASwitchLinear) and modules[GATE].lora_a.shape == (4, 4, 256)

    data = pattern_data()
    got, want = _grads(model, data), _grads(ref, data)
    assert got.keys() == want.keys() and len(got) == 2 * len(paths)
    assert mx.abs(got[f"{GATE}.lora_b"]).max().item() > 1e-3
    for k in got:
        assert mx.abs(got[k] - want[k]).max().item() <= 1e-4, k
    few = TOKENS[:, :3]  # 3 tokens x top-2: the gathered (decode) expert path, LoRASwitchLinear over the blocks
    assert mx.abs(model(few) - ref(few)).max().item() <= 1e-4

    before = frozen_params(model)
    loss0 = default_loss(model, *as_batch(data))[0].item()
    run_training(model, data, tmp_path, iters=6, lr=5e-3)
    assert default_loss(model, *as_batch(data))[0].item() < loss0 - 0.5
    after = frozen_params(model)
    assert before.keys() == after.keys()
    assert all(mx.array_equal(before[k], after[k]).item() for k in before)

    model.eval()
    adapted = model(TOKENS)
    save_adapters(model, tmp_path / "ad", adapter_config(model, paths, "lora", 4, 10.0, 0.0, -1, groups))
    out = fuse_model(str(blocks), str(tmp_path / "ad"), str(tmp_path / "fused"), dtype=mx.float32)
    assert "GGML-block projections, written as float32" in capsys.readouterr().out
    fused, _ = kimi_mlx.load(out)
    assert mx.abs(fused(TOKENS) - adapted).max().item() <= 1e-4
    left = _ggml_layers(fused)
    assert set(left) == {"model.embed_tokens", "lm_head"}, "only the projections without adapters keep blocks"
    out = fuse_model(str(blocks), str(tmp_path / "ad"), str(tmp_path / "deq"), dequantize=True, dtype=mx.float32)
    fused, _ = kimi_mlx.load(out)
    assert not _ggml_layers(fused) and "quantization" not in json.loads((out / "config.json").read_text())
    assert mx.abs(fused(TOKENS) - adapted).max().item() <= 1e-4

    assert fuse_adapters(model) == len(paths)
    merged = dict(model.named_modules())
    assert type(merged[GATE]) is SwitchLinear and merged[GATE].weight.dtype == mx.float32
    assert mx.abs(model(TOKENS) - adapted).max().item() <= 1e-4

    with pytest.raises(ValueError, match=r"shared_experts\.up_proj: DoRA .*GGML-block \(Q2_K\) base"):
        apply_adapters(kimi_mlx.load(str(blocks))[0], ["model.layers.1.mlp.shared_experts.up_proj"],
                       fine_tune_type="dora")
