"""GGUF loading (llama.cpp files for kimi-linear / kimi-k3): logits parity with llama.cpp, the GGUF tokenizer,
and strict validation of malformed files (made here from the F32 fixtures)."""

import json
import re
import warnings
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE

from kimi_mlx.chat.tokenizer import load_gguf_tokenizer
from kimi_mlx.convert.gguf.reader import GGUFFile, GGUFFormatError
from kimi_mlx.loading import load_gguf_model

T = gguf.GGMLQuantizationType

GGUFS = [(d, q) for d in (KL_FIXTURE, K3_FIXTURE) for q in ("F32", "F16", "Q8_0")]


def _file(d: Path, q: str) -> Path:
    return d / f"{'kimi-linear' if d == KL_FIXTURE else 'kimi-k3'}-tiny-{q}.gguf"


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


# Max |our float32 logits - llama.cpp's| per file. Measured: kimi_linear F32 5.7e-6, F16 6.4e-6, Q8_0 6.9e-6;
# kimi_k3 F32 3.5e-5, F16 4.7e-5, Q8_0 2.2e-5 (K3's tiny model amplifies float32 rounding: weight noise of one ulp
# moves its logits by ~4e-5). Dropping llama.cpp's norm epsilons (rms_norm_eps for every norm, its square inside the
# KDA L2 norm) for HF's 1e-6 gives 9.7e-5 (kimi_linear) / 8.2e-5 to 9.0e-5 (kimi_k3): every kimi_linear bound and
# kimi_k3's Q8_0 bound sit below that.
LLAMA_CPP_TOL = {
    ("kimi_linear", "F32"): 2e-5, ("kimi_linear", "F16"): 2e-5, ("kimi_linear", "Q8_0"): 2e-5,
    ("kimi_k3", "F32"): 1e-4, ("kimi_k3", "F16"): 1.4e-4, ("kimi_k3", "Q8_0"): 7e-5,
}


@pytest.mark.parametrize("d,q", GGUFS, ids=[f"{d.name}-{q}" for d, q in GGUFS])
def test_logits_match_llama_cpp(d, q):
    """float32 logits at every position within LLAMA_CPP_TOL of llama.cpp (F32 file: its logits; F16/Q8_0: llama.cpp
    on the same weights dequantised to F32), loaded through ``kimi_mlx.load`` (Q8_0 kept as MLX 8-bit layers)."""
    import kimi_mlx

    f = _file(d, q)
    model, _ = kimi_mlx.load(str(f), dtype=mx.float32)
    ref = np.load(str(f)[:-5] + (".logits.npy" if q == "F32" else ".dequant_f32.logits.npy"))
    out = _logits(model, _manifest(d)["token_ids"])
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= LLAMA_CPP_TOL[d.name, q]
    if q == "Q8_0":
        from mlx.utils import tree_flatten

        assert any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters())), "Q8_0 not kept quantized"


@pytest.mark.parametrize("d", [KL_FIXTURE, K3_FIXTURE], ids=["kimi_linear", "kimi_k3"])
def test_dequantize_path_matches(d):
    """``keep_quantized=False`` (every tensor decoded to float) gives the Q8_0 file's logits within LLAMA_CPP_TOL of
    llama.cpp's on the same weights (measured as for the kept-quantized load: 6.9e-6 / 2.2e-5)."""
    f = _file(d, "Q8_0")
    model, _ = load_gguf_model(GGUFFile(f), dtype=mx.float32, keep_quantized=False)
    ref = np.load(str(f)[:-5] + ".dequant_f32.logits.npy")
    assert np.abs(_logits(model, _manifest(d)["token_ids"]) - ref).max() <= LLAMA_CPP_TOL[d.name, "Q8_0"]


@pytest.mark.parametrize("d", [KL_FIXTURE, K3_FIXTURE], ids=["kimi_linear", "kimi_k3"])
def test_tokenizer_from_gguf(d):
    """The tokenizer built from GGUF metadata alone reproduces the manifest ids (a 40-token prefix of the text) and
    llama.cpp's ids for every tokenizer_check.json string; eos/stop ids follow the spec (KL [EOS], K3 <|im_end|>)."""
    g = GGUFFile(_file(d, "F16"))
    wrapper = load_gguf_tokenizer(g)
    tok = wrapper._tokenizer
    man = _manifest(d)
    ids = tok.encode_with_special_tokens(man["token_text"])
    assert ids[: len(man["token_ids"])] == man["token_ids"]
    for case in json.loads((d / "tokenizer_check.json").read_text()):
        assert tok.encode_with_special_tokens(case["text"]) == case["llama_cpp_ids"], case["text"]
    assert tok.decode(ids) == man["token_text"]
    base = 384
    assert tok.eos_token == ("[EOS]" if d == KL_FIXTURE else "<|im_end|>")
    assert {base + 1, base + 2} <= set(wrapper.eos_token_ids)


def test_config_from_metadata():
    """KimiConfig built from GGUF metadata: layer schedule from head_count_kv, K3 fields, llama.cpp eps convention."""
    kl = GGUFFile(_file(KL_FIXTURE, "F32"))
    from kimi_mlx.convert.gguf.arch import build_config

    c = build_config(kl)
    assert c.model_type == "kimi_linear" and c.kda_layers == [0, 1, 3] and c.moe_renormalize
    assert c.routed_scaling_factor == pytest.approx(2.446) and c.first_k_dense_replace == 1
    c3 = build_config(GGUFFile(_file(K3_FIXTURE, "F32")))
    assert c3.is_k3 and c3.kda_gate_lower_bound == -5.0 and c3.attn_res_block_size == 2
    assert c3.routed_expert_hidden_size == 128 and c3.latent_moe_use_norm and c3.mla_use_output_gate
    assert c3.q_lora_rank == 64 and c3.situ_beta == 1.5 and c3.situ_linear_beta == 2.5 and c3.num_shared_experts == 2


# ------------------------------------------------------------------------------------------ malformed files


def _rewrite(src: Path, dst: Path, *, drop=(), replace=None, extra=None, meta=None, split_max_tensors=0, raw=None):
    """Copy an F32 GGUF through gguf-py's writer with tensors dropped/replaced/added and metadata overridden;
    ``raw``: name -> (GGML type, uint8 block bytes) written as that quantized type; ``replace`` and ``raw`` may change
    a tensor's shape (with ``meta`` saying so)."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch, split_max_tensors=split_max_tensors)
    meta = meta or {}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in meta:
            value, vtype, sub = meta[key]
            if value is not None:
                w.add_key_value(key, value, vtype, sub)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        if t.name in (raw or {}):
            qtype, blocks = raw[t.name]  # flat bytes in the tensor's shape, or already [..., rows, row_bytes]
            rows = tuple(int(x) for x in reversed(t.shape))[:-1]
            w.add_tensor(t.name, blocks if blocks.ndim > 1 else blocks.reshape(*rows, -1), raw_dtype=qtype)
            continue
        data = (replace or {}).get(t.name)
        if data is None:
            data = np.array(t.data).reshape(tuple(int(x) for x in reversed(t.shape)))
        w.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    for name, data in (extra or {}).items():
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _error(path) -> str:
    with pytest.raises(GGUFFormatError) as e:
        load_gguf_model(GGUFFile(path))
    return str(e.value)


def test_truncated_file(tmp_path):
    """A GGUF cut short (inside the tensor data, and inside the header) is rejected, naming the file."""
    data = _file(KL_FIXTURE, "F32").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: len(data) - 1000])
    msg = _error(p)
    assert str(p) in msg and ("outside the file" in msg or "not a readable GGUF" in msg)
    p.write_bytes(data[:200])
    assert str(p) in _error(p)


def test_wrong_magic(tmp_path):
    """A file that does not start with 'GGUF' is rejected as not a readable GGUF file."""
    data = _file(KL_FIXTURE, "F32").read_bytes()
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGML" + data[4:])
    msg = _error(p)
    assert str(p) in msg and "not a readable GGUF" in msg


def test_missing_tensor(tmp_path):
    """A GGUF without blk.2.attn_k_b.weight names the parameter it would have filled."""
    p = _rewrite(_file(KL_FIXTURE, "F32"), tmp_path / "m.gguf", drop={"blk.2.attn_k_b.weight"})
    msg = _error(p)
    assert "missing tensors" in msg and "model.layers.2.self_attn.embed_q.weight" in msg


def test_wrong_shape(tmp_path):
    """A tensor with the wrong shape is named with what was found and what was expected."""
    p = _rewrite(_file(K3_FIXTURE, "F32"), tmp_path / "s.gguf",
                 replace={"blk.0.ssm_f_a.weight": np.zeros((32, 256), np.float32)})
    msg = _error(p)
    assert "blk.0.ssm_f_a.weight" in msg and "(32, 256)" in msg and "(64, 256)" in msg


def test_unknown_extra_tensor(tmp_path):
    """An extra tensor the architecture has no place for (and a KL-only tensor in a K3 file) is named."""
    p = _rewrite(_file(KL_FIXTURE, "F32"), tmp_path / "x.gguf", extra={"blk.0.mystery.weight": np.zeros(4)})
    assert "unknown tensors: blk.0.mystery.weight" in _error(p)
    p = _rewrite(_file(K3_FIXTURE, "F32"), tmp_path / "y.gguf", extra={"blk.0.ssm_g_a.weight": np.zeros((64, 256))})
    assert "blk.0.ssm_g_a.weight" in _error(p)


V = gguf.GGUFValueType


@pytest.mark.parametrize(
    "key,value,vtype,sub,expect",
    [
        ("kimi-linear.expert_used_count", 5, V.UINT32, None, "1..expert_count (4)"),
        ("kimi-linear.attention.head_count_kv", [0, 1, 0], V.ARRAY, V.INT32, "length 4"),
        ("kimi-linear.block_count", 0, V.UINT32, None, "an integer >= 1"),
        ("kimi-linear.kda.head_dim", None, None, None, "'kimi-linear.kda.head_dim' is None"),
        ("kimi-linear.attention.layer_norm_rms_epsilon", 7, V.UINT32, None, "FLOAT32"),
        ("kimi-linear.expert_gating_func", 1, V.UINT32, None, "2 (sigmoid)"),
        ("tokenizer.ggml.pre", "llama3", V.STRING, None, "kimi-k2"),
    ],
)
def test_inconsistent_metadata(tmp_path, key, value, vtype, sub, expect):
    """Bad or missing metadata (top-k > experts, per-layer array of the wrong length, zero layers, missing key,
    wrong value type, non-sigmoid router, foreign pre-tokenizer) is rejected naming the key, before any weight."""
    p = _rewrite(_file(KL_FIXTURE, "F32"), tmp_path / "meta.gguf", meta={key: (value, vtype, sub)})
    with pytest.raises(GGUFFormatError) as e:
        g = GGUFFile(p)
        load_gguf_model(g)
        load_gguf_tokenizer(g)
    assert key in str(e.value) and expect in str(e.value)


def test_split_gguf_set(tmp_path):
    """A split set (-00001-of-0000N.gguf) loads from its first shard with the same logits; a missing shard is named."""
    import kimi_mlx

    _rewrite(_file(K3_FIXTURE, "F32"), tmp_path / "k3.gguf", split_max_tensors=40)
    shards = sorted(tmp_path.glob("k3-*-of-*.gguf"))
    assert len(shards) == 3
    model, _ = kimi_mlx.load(str(shards[0]))
    ref = np.load(K3_FIXTURE / "kimi-k3-tiny-F32.logits.npy")
    assert np.abs(_logits(model, _manifest(K3_FIXTURE)["token_ids"]) - ref).max() <= LLAMA_CPP_TOL["kimi_k3", "F32"]
    shards[-1].unlink()
    assert "missing shard" in _error(shards[0])


def test_dtype_is_respected():
    """``dtype`` casts float weights (A_log, dt_bias, conv and router bias stay float32); Q8_0 scales stay float32."""
    import kimi_mlx

    model, _ = kimi_mlx.load(str(_file(K3_FIXTURE, "F16")), dtype=mx.bfloat16)
    layer = model.language_model.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == mx.bfloat16
    assert layer.input_layernorm.weight.dtype == mx.bfloat16
    assert layer.self_attn.A_log.dtype == mx.float32 and layer.self_attn.qkv_conv.weight.dtype == mx.float32
    model, _ = kimi_mlx.load(str(_file(KL_FIXTURE, "Q8_0")), dtype=mx.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.scales.dtype == mx.float32


def _mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (from /proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(head[1]) * 1024
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(),
                    reason="needs /proc/self/smaps (Linux) for the resident bytes of one file's mapping")
def test_loading_releases_file_pages():
    """Each tensor's file pages leave the resident set once copied into MLX (TensorInfo.release), so peak RSS while
    loading is about the model's size, not model + file (bench/bench_gguf_load.py measures it on a 2 GiB file)."""
    f = _file(KL_FIXTURE, "F32").resolve()  # /proc/self/smaps names the mapping by its real path
    g = GGUFFile(f)
    info = g.tensors["token_embd.weight"]  # the largest tensor: 512 KiB
    before = _mapped_rss(f)
    data = info.raw().copy()
    touched = _mapped_rss(f)
    assert touched - before >= data.nbytes * 0.9
    info.release()
    assert touched - _mapped_rss(f) >= data.nbytes * 0.8, "release() left the tensor's pages resident"
    np.testing.assert_array_equal(info.raw(), data)  # reading again faults the unchanged pages back in
    info.release()
    model, _ = load_gguf_model(g, dtype=mx.float32)
    # small tensors share pages and the kernel maps 64 KiB around each fault, so a little stays resident
    assert _mapped_rss(f) < 0.5 * f.stat().st_size, "the GGUF's tensor pages stayed resident after loading"
    np.testing.assert_array_equal(np.array(model.model.embed_tokens.weight), data.view(np.float32).reshape(info.shape))


def test_compact_scales_are_warned_about():
    """gguf_scale_dtype=float16: Q8_0 scales/biases are float16 (compact) and the load warns that MLX's fp16
    dequantization is not bit-exact, with the error bound; logits stay close to llama.cpp's."""
    import kimi_mlx
    from mlx.utils import tree_flatten

    f = _file(KL_FIXTURE, "Q8_0")
    with pytest.warns(UserWarning, match=r"not bit-exact in MLX \(Q8_0: \d+ tensors, max abs error"):
        model, _ = kimi_mlx.load(str(f), dtype=mx.float32, gguf_scale_dtype=mx.float16)
    scales = [v for k, v in tree_flatten(model.parameters()) if k.endswith(".scales")]
    assert scales and all(v.dtype == mx.float16 for v in scales)
    ref = np.load(str(f)[:-5] + ".dequant_f32.logits.npy")
    # measured 6.2e-3: the weight error that the warning reports, not float32 rounding
    assert np.abs(_logits(model, _manifest(KL_FIXTURE)["token_ids"]) - ref).max() < 1e-2


def _experts_as(src: Path, tmp: Path, qtypes: dict) -> tuple[Path, Path]:
    """Two GGUFs from an F32 fixture: routed-expert tensors (``ffn_{gate,up,down}_exps``) stored as the given block
    types (random well-formed blocks from test_gguf_quant's encoders), and the same values as F32 (the reference:
    gguf-py's dequantization of those blocks)."""
    from test_gguf_quant import make

    r = gguf.GGUFReader(str(src))
    raw, ref = {}, {}
    for i, t in enumerate(r.tensors):
        kind = next((k for k in qtypes if t.name.endswith(f"ffn_{k}_exps.weight")), None)
        if kind is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        blocks, _ = make(qtypes[kind], shape, seed=i)
        raw[t.name] = (qtypes[kind], blocks)
        ref[t.name] = gguf.quants.dequantize(blocks.reshape(*shape[:-1], -1), qtypes[kind])
    assert raw, f"{src}: no routed-expert tensors"
    return _rewrite(src, tmp / "quant.gguf", raw=raw), _rewrite(src, tmp / "ref.gguf", replace=ref)


EXPERT_LAYOUTS = [
    ("kimi_k3-MXFP4", K3_FIXTURE, {"gate": T.MXFP4, "up": T.MXFP4, "down": T.MXFP4}),
    ("kimi_linear-Q4_K-Q5_1", KL_FIXTURE, {"gate": T.Q4_K, "up": T.Q4_K, "down": T.Q5_1}),
    ("kimi_linear-TQ2_0-Q4_0", KL_FIXTURE, {"gate": T.TQ2_0, "up": T.TQ2_0, "down": T.Q4_0}),
]


@pytest.mark.parametrize("name,d,qtypes", EXPERT_LAYOUTS, ids=[e[0] for e in EXPERT_LAYOUTS])
def test_quantized_experts_end_to_end(tmp_path, name, d, qtypes):
    """A GGUF whose routed experts are stored in an exact block type loads into MLX quantized expert stacks
    (gather_qmm-ready, mode/bits of the type) whose logits equal the model loaded from gguf-py's F32
    dequantization of the same blocks (up to float32 rounding), with no precision warning."""
    import kimi_mlx

    quant, ref = _experts_as(_file(d, "F32"), tmp_path, qtypes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = kimi_mlx.load(str(quant), dtype=mx.float32)
    ids = _manifest(d)["token_ids"]
    want = _logits(kimi_mlx.load(str(ref), dtype=mx.float32)[0], ids)
    # measured 0 on the CPU (its gather_qmm dequantizes, then multiplies in float32); quantized kernels that
    # accumulate in another order only round differently, which moves logits by ~5e-6 (kimi_linear) / 4e-5 (kimi_k3)
    assert np.abs(_logits(model, ids) - want).max() <= (1e-5 if d == KL_FIXTURE else 1e-4)
    from mlx.utils import tree_flatten

    experts = [k for k, v in tree_flatten(model.parameters()) if "switch_mlp" in k and k.endswith(".scales")]
    assert experts, "routed experts were not kept quantized"


def test_codebook_experts_end_to_end(tmp_path):
    """IQ4_NL routed experts (what public low-bit K3 GGUFs use): by default they stay GGML blocks and the logits equal
    the F32 dequantization of the same blocks within 1e-4; with requantize=True they become MLX affine 4-bit, with a
    warning stating the size and error cost, and the logits stay close."""
    import kimi_mlx

    rng = np.random.default_rng(11)
    src = _file(K3_FIXTURE, "F32")
    raw, ref = {}, {}
    for t in gguf.GGUFReader(str(src)).tensors:
        if t.name.endswith("_exps.weight"):
            shape = tuple(int(x) for x in reversed(t.shape))
            nb = int(np.prod(shape)) // 32
            d = np.float16(rng.uniform(2e-4, 6e-4, nb)).view(np.uint8).reshape(nb, 2)
            blocks = np.concatenate([d, rng.integers(0, 256, (nb, 16), dtype=np.uint8)], 1).reshape(-1)
            raw[t.name] = (T.IQ4_NL, blocks)
            ref[t.name] = gguf.quants.dequantize(blocks.reshape(*shape[:-1], -1), T.IQ4_NL)
    quant, ref_file = _rewrite(src, tmp_path / "iq.gguf", raw=raw), _rewrite(src, tmp_path / "ref.gguf", replace=ref)
    ids = _manifest(K3_FIXTURE)["token_ids"]
    f32_logits = _logits(kimi_mlx.load(str(ref_file), dtype=mx.float32)[0], ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        native, _ = kimi_mlx.load(str(quant), dtype=mx.float32)
    assert np.abs(_logits(native, ids) - f32_logits).max() <= 1e-4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = kimi_mlx.load(str(quant), dtype=mx.float32, requantize=True)
    text = " ".join(str(w.message) for w in caught)
    assert re.search(r"IQ4_NL re-quantized to MLX affine 4-bit.* bytes .*max abs error", text), text
    err = float(re.search(r"IQ4_NL: \d+ tensors, max abs error <= ([0-9.e-]+)", text).group(1))
    layers = model.language_model.model.layers
    for name, want in ref.items():
        i, kind = int(name.split(".")[1]), name.split(".")[2].split("_")[1]
        q = getattr(layers[i].mlp.switch_mlp, f"{kind}_proj")
        got = np.array(mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits))
        assert 0 < np.abs(got - want).max() <= err * (1 + 1e-3), name
        assert err <= 0.1 * np.abs(want).max()  # about half a 4-bit step of the block range
    want = f32_logits.reshape(-1)
    got = _logits(model, ids).reshape(-1)
    assert np.dot(got, want) / (np.linalg.norm(got) * np.linalg.norm(want)) > 0.9
