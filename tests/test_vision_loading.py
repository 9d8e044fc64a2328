"""K3's vision tower from every source, against mlx-vlm 0.7.10's outputs on the fixture checkpoint: llama.cpp's mmproj
GGUF (written by its converter) with a K3 GGUF, with a text-only HF directory, replacing a checkpoint's own tower,
and found beside a GGUF; its tower and projector outputs equal the HF checkpoint's; its preprocessing (keys + the
released defaults) gives mlx-vlm's pixels; every bad mmproj is an error naming the key or tensor."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import gguf
import mlx.core as mx
import numpy as np
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE, SHARED
from test_gguf_load import _rewrite

from kimi_mlx import load, stream_generate
from kimi_mlx.convert.gguf.reader import GGUFFormatError
from kimi_mlx.loading import _attach_image_encoder
from kimi_mlx.vision.mmproj import load_mmproj, open_mmproj
from kimi_mlx.vision.model import load_vision
from kimi_mlx.vision.preprocess import preprocess

ROOT = SHARED / "fixtures" / "k3_vision"
CKPT = ROOT / "k3-vl-tiny"
MMPROJ = ROOT / "mmproj-k3-vl-tiny-F32.gguf"
REF = ROOT / "mlx_vlm"
IMAGES = ROOT / "images"
K3_GGUF = K3_FIXTURE / "kimi-k3-tiny-F32.gguf"
NAMES = ["img0_rgb_224x168", "img1_rgba_100x300", "img2_palette_150x90", "img3_large_500x380"]


def _ref_logprobs(img: str) -> np.ndarray:
    ref = np.load(REF / f"{img}.chat.last_logits.npy").reshape(-1).astype(np.float64)  # [vocab]
    return ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())


def _logprob_error(loaded, img: str) -> float:
    """Max |our first-step log-probabilities - mlx-vlm's| for mlx-vlm's chat prompt holding ``img``."""
    model, tok = loaded
    ids = np.load(REF / f"{img}.chat.input_ids.npy").reshape(-1).tolist()
    first = next(iter(stream_generate(model, tok, ids, 1, images=[IMAGES / f"{img}.png"])))
    return float(np.abs(np.array(first.logprobs) - _ref_logprobs(img)).max())


@pytest.fixture(scope="module")
def gguf_mmproj():
    return load(K3_GGUF, dtype=mx.float32, mmproj=MMPROJ)


@pytest.mark.parametrize("img", NAMES)
def test_k3_gguf_with_mmproj_matches_mlx_vlm(gguf_mmproj, img):
    model, _ = gguf_mmproj
    assert model.image_encoder.source == str(MMPROJ) and model.image_encoder.placeholder_id == 405
    assert _logprob_error(gguf_mmproj, img) < 1e-4


def test_hf_text_dir_with_mmproj_matches_mlx_vlm():
    """The text-only HF checkpoint (no vision_config, its tokenizer without <|media_pad|>) + the mmproj."""
    loaded = load(K3_FIXTURE / "hf", dtype=mx.float32, mmproj=MMPROJ)
    assert _logprob_error(loaded, "img1_rgba_100x300") < 1e-4


def test_mmproj_replaces_the_checkpoints_own_tower(tmp_path):
    """An explicit mmproj wins over the checkpoint's vision_tower.* (here broken: they are never read)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(CKPT, ckpt)
    (ckpt / "model.safetensors").chmod(0o644)
    weights = mx.load(str(ckpt / "model.safetensors"))
    weights["vision_tower.encoder.blocks.0.wqkv.weight"] = mx.zeros((5, 5))
    mx.save_safetensors(str(ckpt / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="blocks.0.wqkv.weight"):
        load(ckpt, dtype=mx.float32)
    loaded = load(ckpt, dtype=mx.float32, mmproj=MMPROJ)
    assert loaded[0].image_encoder.source == str(MMPROJ)
    assert _logprob_error(loaded, "img2_palette_150x90") < 1e-4


def test_mmproj_beside_a_gguf_is_found(tmp_path):
    shutil.copy(K3_GGUF, tmp_path / K3_GGUF.name)
    shutil.copy(MMPROJ, tmp_path / MMPROJ.name)
    loaded = load(tmp_path / K3_GGUF.name, dtype=mx.float32)
    assert loaded[0].image_encoder.source == str(tmp_path / MMPROJ.name)
    assert _logprob_error(loaded, "img0_rgb_224x168") < 1e-4


def test_gguf_alone_is_text_only(tmp_path):
    shutil.copy(K3_GGUF, tmp_path / K3_GGUF.name)
    model, tok = load(tmp_path / K3_GGUF.name, dtype=mx.float32)
    assert model.image_encoder is None and "no mmproj" in model.no_images_reason
    with pytest.raises(ValueError, match="no vision tower"):
        list(stream_generate(model, tok, [1, 2, 3], 1, images=[IMAGES / "img0_rgb_224x168.png"]))


@pytest.mark.parametrize("img", NAMES)
def test_mmproj_tower_equals_the_hf_tower(img):
    """Same pixels (mlx-vlm's) through the tower read from the mmproj and from the HF checkpoint: encoder output and
    image features within 1e-5 of each other and of mlx-vlm's."""
    from_gguf, from_hf = load_mmproj(open_mmproj(MMPROJ)), load_vision(CKPT)
    px = mx.array(np.load(REF / f"{img}.pixel_values.npy"))
    grid = np.load(REF / f"{img}.grid_thw.npy")
    stages = (("encoder_out", lambda v: v.vision_tower.encode(px, grid)), ("image_features", lambda v: v(px, grid)))
    for name, run in stages:
        ours, hf = np.array(run(from_gguf)), np.array(run(from_hf))
        assert np.abs(ours - hf).max() < 1e-5, name
        assert np.abs(ours - np.load(REF / f"{img}.{name}.npy")).max() < 1e-5, name


@pytest.mark.parametrize("img", NAMES)
def test_mmproj_preprocessing_gives_mlx_vlms_pixels(img):
    """mean/std/patch/merge and in_patch_limit = image_max_pixels / P^2 from the keys, the released one-side limit
    and chessboard background: the same patches as the checkpoint's preprocessor_config.json."""
    mm = open_mmproj(MMPROJ)
    assert mm.preprocess.in_patch_limit == 400 and mm.preprocess.transparent_bg.pattern == "chessboard"
    out = preprocess(IMAGES / f"{img}.png", mm.preprocess)
    assert tuple(out.grid_thw) == tuple(np.load(REF / f"{img}.grid_thw.npy").reshape(-1))
    assert np.array_equal(np.array(out.pixel_values), np.load(REF / f"{img}.pixel_values.npy"))


def test_config_from_the_keys():
    cfg = open_mmproj(MMPROJ).cfg
    assert (cfg.hidden_size, cfg.qkv_hidden_size, cfg.num_heads, cfg.num_layers, cfg.intermediate_size) == \
        (48, 96, 4, 3, 128)
    assert (cfg.pos_emb_height, cfg.pos_emb_width, cfg.merge_kernel, cfg.text_hidden_size) == (8, 8, (2, 2), 256)
    assert cfg.projector_ln_eps == 1e-5 and cfg.tower_norm_eps == 2.0**-7  # the file's eps is the projector's only


def _bad(tmp_path, **edits):
    return _rewrite(MMPROJ, tmp_path / "mmproj-bad.gguf", **edits)


def test_bad_mmproj_files_are_named(tmp_path):
    string = gguf.GGUFValueType.STRING
    cases = [
        (dict(meta={"clip.projector_type": ("qwen2vl_merger", string, None)}), "'qwen2vl_merger' mmproj.*'kimik3'"),
        (dict(drop=("v.blk.1.ffn_up.weight",)), "tensor 'v.blk.1.ffn_up.weight' is missing"),
        (dict(replace={"v.blk.2.attn_out.weight": np.zeros((48, 95), np.float32)}),
         r"tensor 'v.blk.2.attn_out.weight' has ne \[95, 48\]; expected ne \[96, 48\]"),
        (dict(extra={"v.blk.3.ln1.weight": np.ones(48, np.float32)}), "unexpected tensor 'v.blk.3.ln1.weight'"),
        (dict(meta={"clip.vision.attention.head_dim": (None, None, None)}),
         "'clip.vision.attention.head_dim' is None; expected an integer"),
    ]
    for i, (edit, message) in enumerate(cases):
        path = _rewrite(MMPROJ, tmp_path / f"mmproj-{i}.gguf", **edit)
        with pytest.raises(GGUFFormatError, match=message):
            load(K3_GGUF, mmproj=path)


def test_a_text_gguf_given_as_mmproj(tmp_path):
    with pytest.raises(GGUFFormatError, match="no 'clip.projector_type' key.*'kimi-k3'"):
        load(K3_GGUF, mmproj=K3_FIXTURE / "kimi-k3-tiny-Q8_0.gguf")


def test_kimi_linear_refuses_an_mmproj():
    with pytest.raises(ValueError, match="Kimi Linear is a text-only model"):
        load(KL_FIXTURE / "hf", mmproj=MMPROJ)


def test_two_mmproj_files_beside_a_gguf(tmp_path):
    shutil.copy(K3_GGUF, tmp_path / K3_GGUF.name)
    for name in ("mmproj-F32.gguf", "mmproj-F16.gguf"):
        shutil.copy(MMPROJ, tmp_path / name)
    with pytest.raises(ValueError, match="2 mmproj files.*mmproj-F16.gguf, mmproj-F32.gguf.*--mmproj FILE"):
        load(tmp_path / K3_GGUF.name)
    model, _ = load(tmp_path / K3_GGUF.name, mmproj=tmp_path / "mmproj-F16.gguf")
    assert model.image_encoder.source == str(tmp_path / "mmproj-F16.gguf")


def test_missing_mmproj_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load(K3_GGUF, mmproj=tmp_path / "nope.gguf")


@pytest.mark.parametrize("tower", [MMPROJ, CKPT])
def test_ranks_after_the_first_read_no_vision_weights(gguf_mmproj, tower, monkeypatch):
    """On rank 1 of a group the encoder has the tower's config and preprocessing (it prepares images) but no
    weights: the readers of the tower's tensors are never called."""
    import kimi_mlx.vision.mmproj as mmproj_mod
    import kimi_mlx.vision.model as model_mod

    def never(*a, **k):
        raise AssertionError("vision weights read on rank 1")

    monkeypatch.setattr(mmproj_mod, "load_mmproj", never)
    monkeypatch.setattr(model_mod, "load_vision", never)
    model, tok = gguf_mmproj
    kept = model.image_encoder
    rank1 = SimpleNamespace(rank=lambda: 1, size=lambda: 2)
    source = CKPT if tower == CKPT else K3_GGUF
    enc = _attach_image_encoder(model, tok, source, tower if tower == MMPROJ else None, rank1)
    try:
        assert enc.vision is None and enc.nbytes == 0 and enc.hidden_size == 256
        assert enc.prepare(IMAGES / "img0_rgb_224x168.png").num_tokens == 48
        with pytest.raises(ValueError, match="holds no vision tower"):
            enc.features(enc.prepare(IMAGES / "img0_rgb_224x168.png"))
    finally:
        model.image_encoder = kept  # the module's shared model gets its tower back


# ------------------------------------------------------------------------------------------ MLX directories


def _convert(tmp_path, *extra: str):
    from kimi_mlx.cli.main import main as cli_main

    out = tmp_path / "mlx"
    assert cli_main(["convert", "--model", str(CKPT), "--out", str(out), "--quiet", *extra]) == 0
    return out


def test_converted_directory_keeps_the_tower(tmp_path):
    """``kimi-mlx convert`` of the vision checkpoint writes vision_tower.* / mm_projector.* (bf16, as stored) and
    preprocessor_config.json; the directory gives mlx-vlm's logits with an image."""
    out = _convert(tmp_path)
    weights = mx.load(str(out / "model.safetensors"))
    tower = {k: v for k, v in weights.items() if k.startswith(("vision_tower.", "mm_projector."))}
    assert len(tower) == 24 and all(v.dtype == mx.bfloat16 for v in tower.values())
    assert (out / "preprocessor_config.json").read_text() == (CKPT / "preprocessor_config.json").read_text()
    loaded = load(out, dtype=mx.float32)
    assert loaded[0].image_encoder.source == str(out)
    for img in ("img1_rgba_100x300", "img3_large_500x380"):
        assert _logprob_error(loaded, img) < 1e-4


def test_converted_gguf_keeps_the_mmproj_beside_it(tmp_path):
    """A K3 GGUF with an mmproj beside it converts to a directory holding the tower (as float32 from the F32 file),
    its vision_config and preprocessor_config.json (the mmproj's keys + the released defaults); it loads without
    the mmproj and gives mlx-vlm's logits."""
    from kimi_mlx.cli.main import main as cli_main

    shutil.copy(K3_GGUF, tmp_path / K3_GGUF.name)
    shutil.copy(MMPROJ, tmp_path / MMPROJ.name)
    out = tmp_path / "mlx"
    assert cli_main(["convert", "--model", str(tmp_path / K3_GGUF.name), "--out", str(out), "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["vt_hidden_size"] == 48 and config["vision_config"]["projector_ln_eps"] == 1e-5
    assert json.loads((out / "preprocessor_config.json").read_text())["media_proc_cfg"]["in_patch_limit"] == 400
    loaded = load(out, dtype=mx.float32)
    assert loaded[0].image_encoder.source == str(out)
    assert _logprob_error(loaded, "img1_rgba_100x300") < 1e-4
    text_only = tmp_path / "kl"
    assert cli_main(["convert", "--model", str(KL_FIXTURE / "hf"), "--out", str(text_only), "--quiet",
                     "--mmproj", str(MMPROJ)]) == 2


def _dequantized(vision, paths, group_size, bits, dtype=mx.float32):
    """``vision`` with each Linear of ``paths`` holding dequantize(quantize(weight)) (quantized in ``dtype``: scales
    and biases in it): what the quantized model computes, in float32."""
    modules = dict(vision.named_modules())
    for path in paths:
        w = modules[path].weight.astype(dtype)
        q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        modules[path].weight = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32),
                                             group_size=group_size, bits=bits)
    return vision


def _features(vision, img="img0_rgb_224x168"):
    px, grid = mx.array(np.load(REF / f"{img}.pixel_values.npy")), np.load(REF / f"{img}.grid_thw.npy")
    return np.array(vision(px, grid))


def test_convert_quantize_keeps_the_tower_float_and_quantizes_the_projector(tmp_path):
    """As mlx-vlm's convert: -q quantizes the projector's Linears and leaves vision_tower.* float; the directory
    loads and its features are the float tower + the projector's quantized weights."""
    out = _convert(tmp_path, "--quantize", "8")
    weights = mx.load(str(out / "model.safetensors"))
    assert "mm_projector.proj.0.scales" in weights and "mm_projector.proj.2.scales" in weights
    assert not any(k.startswith("vision_tower.") and k.endswith(".scales") for k in weights)
    model, _ = load(out, dtype=mx.float32)
    ref = _dequantized(load_vision(CKPT), ["mm_projector.proj.0", "mm_projector.proj.2"], 64, 8, mx.bfloat16)
    assert np.abs(_features(model.image_encoder.vision) - _features(ref)).max() < 1e-5
    from kimi_mlx.parallel.accounting import account_config, checkpoint_tensor_names

    acct = account_config(json.loads((out / "config.json").read_text()), dtype="float32",
                          tensor_names=checkpoint_tensor_names(out))
    assert acct.part_bytes("vision") == model.image_encoder.nbytes  # the planner counts the projector quantized


def test_mlx_quantized_vision_tensors_load(tmp_path):
    """An HF checkpoint whose vision Linears are MLX-quantized (.weight uint32 + .scales + .biases, config.json's
    quantization entry), as mlx-vlm writes them, loads; its features are those of the dequantized weights."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(CKPT, ckpt)
    for f in ckpt.iterdir():
        f.chmod(0o644)
    weights = mx.load(str(ckpt / "model.safetensors"))
    paths = [f"vision_tower.encoder.blocks.{i}.{n}" for i in range(3) for n in ("wo", "mlp.fc1")]
    paths += ["mm_projector.proj.0", "mm_projector.proj.2"]
    for path in paths:
        q, s, b = mx.quantize(weights[f"{path}.weight"].astype(mx.float32), group_size=32, bits=8)
        weights.update({f"{path}.weight": q, f"{path}.scales": s, f"{path}.biases": b})
    mx.save_safetensors(str(ckpt / "model.safetensors"), weights)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 8}}))
    model, _ = load(ckpt, dtype=mx.float32)
    ref = _dequantized(load_vision(CKPT), paths, 32, 8)
    assert np.abs(_features(model.image_encoder.vision) - _features(ref)).max() < 1e-5


# ------------------------------------------------------------------------------------------ the planner


def test_plan_counts_the_tower_on_rank_0(gguf_mmproj):
    """The tower's bytes as the planner counts them equal the loaded encoder's (an HF directory's own tower and a
    GGUF's mmproj); they are rank 0's, in both split modes, and nobody else's."""
    from kimi_mlx.parallel.accounting import account_config, account_gguf, checkpoint_tensor_names
    from kimi_mlx.parallel.cost import Host, plan_pipeline, plan_tensor

    raw = json.loads((CKPT / "config.json").read_text())
    own = account_config(raw, dtype="float32", tensor_names=checkpoint_tensor_names(CKPT))
    with_tower, text_only = account_gguf(K3_GGUF, mmproj=MMPROJ), account_gguf(K3_GGUF)
    tower = gguf_mmproj[0].image_encoder.nbytes
    assert with_tower.part_bytes("vision") == own.part_bytes("vision") == tower > 0
    assert text_only.part_bytes("vision") == 0 and with_tower.total - text_only.total == tower
    hosts = [Host(16), Host(16)]
    for plan in (plan_pipeline, plan_tensor):
        a, b = plan(with_tower, hosts), plan(text_only, hosts)
        assert a.ranks[0].weights - b.ranks[0].weights == tower and a.ranks[1].weights == b.ranks[1].weights


def test_plan_cli_shows_the_tower(capsys, tmp_path):
    from kimi_mlx.cli.main import main as cli_main

    assert cli_main(["plan", "--model", str(K3_GGUF), "--mmproj", str(MMPROJ), "--hosts", "16,16"]) == 0
    assert "vision tower + projector: 0.84 MB, held by rank 0" in capsys.readouterr().out
    assert cli_main(["plan", "--model", str(KL_FIXTURE / "hf"), "--mmproj", str(MMPROJ), "--hosts", "16"]) == 2
    assert "Kimi Linear is a text-only model" in capsys.readouterr().err
