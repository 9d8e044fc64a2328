"""``kimi-mlx convert``: GGUF / HF fixtures -> MLX model directories that reload with identical logits and token ids,
load in mlx-lm (Kimi Linear), quantize, shard, and fail clearly on bad arguments."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE
from mlx.utils import tree_flatten
from mlx_lm_reference import MlxLmReference

import kimi_mlx
from kimi_mlx.cli.main import main as cli_main

pytest.importorskip("gguf")

SOURCES = {
    "kl-F32.gguf": KL_FIXTURE / "kimi-linear-tiny-F32.gguf",
    "kl-Q8_0.gguf": KL_FIXTURE / "kimi-linear-tiny-Q8_0.gguf",
    "kl-F16.gguf": KL_FIXTURE / "kimi-linear-tiny-F16.gguf",
    "k3-F32.gguf": K3_FIXTURE / "kimi-k3-tiny-F32.gguf",
    "k3-Q8_0.gguf": K3_FIXTURE / "kimi-k3-tiny-Q8_0.gguf",
    "kl-hf": KL_FIXTURE / "hf",
    "k3-hf": K3_FIXTURE / "hf",
}


def _manifest(src: Path) -> dict:
    d = KL_FIXTURE if KL_FIXTURE in src.parents else K3_FIXTURE
    return json.loads((d / "manifest.json").read_text())


def _logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _reference(src: Path, **kw):
    """The source loaded directly, the reference for the converted directory. A GGUF loads with llama.cpp's norm
    epsilons (``rms_norm_eps`` for every norm, its square for the KDA L2 norm); the converted config.json records
    them (``mla_kv_norm_eps``, ``mla_q_norm_eps``, ``kda_l2_eps``), and a reload that ignores one of those keys
    no longer gives this reference's logits."""
    return kimi_mlx.load(str(src), **kw)


# Max |mlx-lm's float32 logits (norm epsilons as config.json records them) - ours| per architecture: measured
# 3.9e-6 (kl) and 3.3e-5 (k3: its tiny model amplifies float32 rounding, see test_model_parity). A Kimi Linear reload
# that drops llama.cpp's KDA L2-norm eps moves its logits by 9e-5, the MLA kv-norm eps by 1.8e-5.
MLX_LM_TOL = {"kl": 1.2e-5, "k3": 1e-4}


def _fused(p0: dict, p1: dict) -> dict:
    """``p0`` with its KDA q/k/v projections fused into ``qkv_proj`` where ``p1`` (a reloaded mlx-lm-layout K3) has
    them fused, so the two parameter sets compare tensor by tensor."""
    out = dict(p0)
    for key in p1:
        if ".self_attn.qkv_proj." in key and key not in p0:
            prefix, part = key.rsplit(".qkv_proj.", 1)
            out[key] = mx.concatenate([out.pop(f"{prefix}.{n}_proj.{part}") for n in "qkv"], axis=0)
    return out


def _convert(src, out: Path, *extra: str) -> Path:
    rc = cli_main(["convert", "--model", str(src), "--out", str(out), "--quiet", *extra])
    assert rc == 0
    return out


@pytest.mark.parametrize("name", list(SOURCES))
def test_convert_reload_identical(name, tmp_path):
    """Converted dir reloads with ``kimi_mlx.load`` to the same float32 logits (<= 1e-6) as the source loaded
    directly (a GGUF's llama.cpp norm epsilons recorded in config.json and read back), and its tokenizer gives the
    same ids for the manifest text (plain and with specials)."""
    src = SOURCES[name]
    out = _convert(src, tmp_path / "out")
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert (out / "tiktoken.model").exists() and (out / "tokenizer_config.json").exists()
    ids = _manifest(src)["token_ids"]
    text = _manifest(src)["token_text"]
    m0, t0 = _reference(src, dtype=mx.float32)
    m1, t1 = kimi_mlx.load(str(out), dtype=mx.float32)
    p1 = dict(tree_flatten(m1.parameters()))
    p0 = _fused(dict(tree_flatten(m0.parameters())), p1)
    assert p0.keys() == p1.keys()
    for k in p0:
        assert p0[k].dtype == p1[k].dtype and mx.array_equal(p0[k], p1[k]), k
    assert np.abs(_logits(m0, ids) - _logits(m1, ids)).max() <= 1e-6  # measured 0 (same weights, same config)
    a, b = t0._tokenizer, t1._tokenizer
    assert a.encode(text) == b.encode(text)
    assert a.encode_with_special_tokens(text) == b.encode_with_special_tokens(text)
    assert b.encode_with_special_tokens(text)[:40] == ids
    assert set(t0.eos_token_ids) <= set(t1.eos_token_ids)
    if src.suffix == ".gguf":  # llama.cpp's norm epsilons (rms_norm_eps 1e-5) recorded in config.json
        raw = json.loads((out / "config.json").read_text())
        text_cfg = raw.get("text_config", raw)
        assert text_cfg["mla_kv_norm_eps"] == pytest.approx(1e-5) and text_cfg["kda_l2_eps"] == pytest.approx(1e-10)
        assert text_cfg["mla_q_norm_eps"] == pytest.approx(1e-5)
    if "Q8_0" in name:
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization"]["bits"] == 8 and cfg["quantization"]["group_size"] == 32
        assert any(k.endswith(".scales") for k, _ in tree_flatten(m1.parameters()))


@pytest.mark.parametrize("name", list(SOURCES))
def test_output_loads_in_mlx_lm(name, tmp_path):
    """Output is in mlx-lm's converted layout (Kimi Linear: separate ``{q,k,v}_conv.conv.weight [C, K, 1]``; K3:
    fused ``qkv_conv.conv.weight``, ``qkv_proj``, ``*_res_norm``): ``mlx_lm.utils.load_model`` loads it strictly and
    its float32 logits, run with the norm epsilons the converted config.json records, match ours."""
    src = SOURCES[name]
    out = _convert(src, tmp_path / "out", "--dtype", "float32")
    theirs = MlxLmReference(out)
    ours, _ = kimi_mlx.load(str(out), dtype=mx.float32)
    ids = _manifest(src)["token_ids"]
    assert np.abs(theirs(ids) - _logits(ours, ids)).max() <= MLX_LM_TOL[name[:2]]
    keys = set(mx.load(str(out / "model.safetensors")))
    assert not any(k.endswith("qkv_conv.weight") for k in keys)
    if name.startswith("kl"):
        assert "model.layers.0.self_attn.q_conv.conv.weight" in keys
    else:
        assert "language_model.model.layers.0.self_attn.qkv_proj.weight" in keys
        assert "language_model.model.output_attn_res_norm.weight" in keys


def test_demo_source(tmp_path, monkeypatch):
    """``--model demo`` converts the built-in demo model (made under ``$KIMI_MLX_HOME``); the result reloads to the
    same logits and token ids, and ``mlx_lm.load`` (model + tokenizer) reads it."""
    import mlx_lm

    monkeypatch.setenv("KIMI_MLX_HOME", str(tmp_path / "home"))
    out = _convert("demo", tmp_path / "out")
    m0, t0 = kimi_mlx.load("demo", dtype=mx.float32)
    m1, t1 = kimi_mlx.load(str(out), dtype=mx.float32)
    ids = t0.encode("Hello, Kimi. 你好 1234")
    assert ids == t1.encode("Hello, Kimi. 你好 1234")
    assert np.abs(_logits(m0, ids) - _logits(m1, ids)).max() <= 1e-6  # measured 0
    mlx_lm.load(str(out))


@pytest.mark.parametrize("name", ["kl-hf", "k3-F32.gguf", "kl-Q8_0.gguf"])
def test_quantize_on_convert(name, tmp_path):
    """``--quantize 4 --q-group-size 32`` writes 4-bit layers (mlx-lm ``quantization`` entry) that reload quantized
    with the same logits as quantizing on load (a Q8_0 GGUF keeps its 8-bit layers: per-module overrides); routers
    stay float; mlx-lm loads the result too."""
    src = SOURCES[name]
    out = _convert(src, tmp_path / "out", "--quantize", "4", "--q-group-size", "32", "--dtype", "float32")
    cfg = json.loads((out / "config.json").read_text())
    bits = 8 if "Q8_0" in name else 4  # GGUF-quantized layers stay as stored; only float projections are quantized
    assert cfg["quantization"]["bits"] == bits and cfg["quantization"]["group_size"] == 32
    m1, _ = kimi_mlx.load(str(out), dtype=mx.float32)
    params = dict(tree_flatten(m1.parameters()))
    assert sum(k.endswith(".scales") for k in params) > 10
    assert not any(k.endswith("mlp.gate.scales") for k in params)
    m0, _ = _reference(src, dtype=mx.float32, quantize={"bits": 4, "group_size": 32})
    ids = _manifest(src)["token_ids"]
    assert np.abs(_logits(m0, ids) - _logits(m1, ids)).max() <= 1e-6  # measured 0
    theirs = MlxLmReference(out)  # mlx-lm reads the quantization entry (default + per-module overrides)
    assert np.abs(theirs(ids) - _logits(m1, ids)).max() <= MLX_LM_TOL[name[:2]]


def test_sharded_output_reloads(tmp_path):
    """A small shard limit gives several ``model-0000k-of-0000N.safetensors`` + an index that both loaders read."""
    from mlx_lm.utils import load_model

    src = SOURCES["kl-hf"]
    out = _convert(src, tmp_path / "out", "--max-shard-gb", str(1.0 / 1024), "--dtype", "float32")  # 1 MiB shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    assert not (out / "model.safetensors").exists()
    ids = _manifest(src)["token_ids"]
    m0, _ = kimi_mlx.load(str(src), dtype=mx.float32)
    m1, _ = kimi_mlx.load(str(out), dtype=mx.float32)
    assert np.abs(_logits(m0, ids) - _logits(m1, ids)).max() <= 1e-6  # measured 0
    load_model(out)


def test_bfloat16_output(tmp_path):
    """``--dtype bfloat16`` stores the projections in bfloat16 (A_log, dt_bias, convs, router bias stay float32)
    and the dir reloads to the same logits as loading the source in bfloat16."""
    src = SOURCES["kl-F32.gguf"]
    out = _convert(src, tmp_path / "out", "--dtype", "bfloat16")
    w = mx.load(str(out / "model.safetensors"))
    assert w["model.embed_tokens.weight"].dtype == mx.bfloat16
    assert w["model.layers.0.self_attn.A_log"].dtype == mx.float32
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ids = _manifest(src)["token_ids"]
    m0, _ = _reference(src, dtype=mx.bfloat16)
    m1, _ = kimi_mlx.load(str(out), dtype=mx.bfloat16)
    assert np.abs(_logits(m0, ids) - _logits(m1, ids)).max() <= 1e-6  # measured 0


@pytest.mark.parametrize("name,dtype", [("kl-hf", mx.bfloat16), ("k3-hf", mx.bfloat16), ("kl-F16.gguf", mx.float16),
                                        ("kl-F32.gguf", mx.float32)])
def test_default_dtype_is_the_sources(name, dtype, tmp_path):
    """Without ``--dtype`` the projections keep the source's float type (bf16 safetensors, F16 GGUF), not the CPU
    backend's float32 default, and only where that is exact (tensors stored float32 stay float32); A_log stays
    float32."""
    out = _convert(SOURCES[name], tmp_path / "out")
    w = mx.load(str(out / "model.safetensors"))
    prefix = "language_model." if name.startswith("k3") else ""
    assert w[f"{prefix}model.embed_tokens.weight"].dtype == dtype
    assert w[f"{prefix}model.layers.0.self_attn.A_log"].dtype == mx.float32
    if name == "k3-hf":  # stored float32 in the source (not bf16-exact): stays float32
        assert w["language_model.model.layers.0.self_attn.o_norm.weight"].dtype == mx.float32


def _run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "kimi_mlx.cli.main", "convert", *args], cwd=cwd, env=env,
                          check=False, capture_output=True, text=True, timeout=300)


def test_cli_end_to_end(tmp_path):
    """``python -m kimi_mlx.cli.main convert`` (installed package, cwd=tmp_path) converts a GGUF; the result
    reloads; converting again into the now non-empty dir fails with exit 2 unless ``--force`` (which replaces the
    old weight files)."""
    src = SOURCES["kl-F32.gguf"]
    r = _run_cli(tmp_path, "--model", str(src), "--out", "out")
    assert r.returncode == 0, r.stderr
    model, _ = kimi_mlx.load(str(tmp_path / "out"), dtype=mx.float32)
    ids = _manifest(src)["token_ids"]
    ref = np.load(str(src)[:-5] + ".logits.npy")
    assert np.abs(_logits(model, ids) - ref).max() <= 2e-5  # measured 5.7e-6; llama.cpp's eps ignored: 9.8e-5
    r = _run_cli(tmp_path, "--model", str(src), "--out", "out")
    assert r.returncode == 2 and "not empty" in r.stderr and "--force" in r.stderr
    r = _run_cli(tmp_path, "--model", str(src), "--out", "out", "--force", "--quiet", "--max-shard-gb", "0.001")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()  # the earlier single file is gone, not shadowing
    kimi_mlx.load(str(tmp_path / "out"), dtype=mx.float32)


@pytest.mark.parametrize("src, reason", [
    ("missing-file.gguf", r"--model missing-file\.gguf: no such GGUF file"),
    ("no/such-dir/here", r"--model: no/such-dir/here: no such directory, and not an HF repo id"),
    ("./nope", r"--model: \./nope: no such directory"),
], ids=["gguf-file", "nested-dir", "relative-dir"])
def test_bad_source_exit_2(src, reason, tmp_path, capsys):
    """A missing GGUF or a non-existent directory gives exit 2 and an error naming the source and what is wrong;
    nothing is written."""
    rc = cli_main(["convert", "--model", src, "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 2
    assert re.search(r"^kimi-mlx: error: " + reason, capsys.readouterr().err, re.M)
    assert not (tmp_path / "out").exists()


def test_bad_quantize_and_non_model_dir(tmp_path, capsys):
    """``--quantize 7`` and a directory without config.json fail with exit 2 and a clear message."""
    rc = cli_main(["convert", "--model", str(SOURCES["kl-hf"]), "--out", str(tmp_path / "o1"), "--quantize", "7"])
    assert rc == 2 and "bits=7" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc = cli_main(["convert", "--model", str(empty), "--out", str(tmp_path / "o2")])
    assert rc == 2 and "config.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["kl-hf", "k3-Q8_0.gguf"])
def test_converted_dir_converts_again(name, tmp_path):
    """A converted (quantized, mlx-lm-layout) directory is itself a valid source: converting it again gives the same
    tensors, the same ``quantization`` entry and identical logits."""
    first = _convert(SOURCES[name], tmp_path / "a", "--quantize", "4", "--q-group-size", "32", "--dtype", "float32")
    second = _convert(first, tmp_path / "b")
    w1, w2 = mx.load(str(first / "model.safetensors")), mx.load(str(second / "model.safetensors"))
    assert w1.keys() == w2.keys()
    assert all(w1[k].dtype == w2[k].dtype and mx.array_equal(w1[k], w2[k]) for k in w1)
    c1, c2 = (json.loads((d / "config.json").read_text()) for d in (first, second))
    assert c1["quantization"] == c2["quantization"]
    ids = _manifest(SOURCES[name])["token_ids"]
    m1, _ = kimi_mlx.load(str(first), dtype=mx.float32)
    m2, _ = kimi_mlx.load(str(second), dtype=mx.float32)
    assert np.abs(_logits(m1, ids) - _logits(m2, ids)).max() <= 1e-6  # measured 0
