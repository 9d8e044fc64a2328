"""Issue 14 item 4: ``parallel.accounting.cache_bytes`` (config, context, kv_bits) is what ``model.make_cache()`` holds."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from kimi_mlx.cli.main import main
from kimi_mlx.config import KimiConfig
from kimi_mlx.loading import load_model
from kimi_mlx.parallel.accounting import cache_bytes
from kimi_mlx.parallel.splits import tensor_shares


@pytest.mark.parametrize("dtype, size", [(mx.float32, 4), (mx.bfloat16, 2)])
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_formula_equals_the_real_cache(arch, dtype, size, tokens):
    """Sum of the arrays' nbytes of a cache after ``tokens`` tokens (prefill + decode steps) == the formula."""
    _, path, _, _ = arch
    model, _ = load_model(path / "hf", dtype=dtype)
    cache = model.make_cache()
    ids = mx.arange(1, tokens + 1)[None] % model.args.vocab_size
    model(ids[:, : max(tokens - 2, 1)], cache=cache)
    for t in range(max(tokens - 2, 1), tokens):
        model(ids[:, t : t + 1], cache=cache)
    mx.eval([c.state for c in cache])
    real = sum(a.nbytes for c in cache for a in c.state)
    assert real == cache_bytes(model.args, tokens, act_bytes=size)
    kda = [i for i in range(model.args.num_hidden_layers) if model.args.is_kda_layer(i)]
    assert sum(a.nbytes for i in kda for a in cache[i].state) == cache_bytes(model.args, tokens, kda, act_bytes=size)


def _cfg(name: str) -> KimiConfig:
    from conftest import SHARED

    return KimiConfig.from_hf(json.loads((SHARED / "fixtures" / "configs" / name).read_text()))


def test_quantized_latent_layout():
    """Kimi Linear: 7 MLA layers x (512 + 64) latent values per token; affine layout of mx.quantize: bits/8 bytes a
    value plus a bf16 scale and bias per group; the 64-wide k_pe stays bf16 under group 128 (not divisible)."""
    cfg = _cfg("kimi-linear-48b-a3b-instruct.json")
    mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)]
    assert len(mla) == 7

    def per_token(**kv):
        return cache_bytes(cfg, 1, mla, **kv) - cache_bytes(cfg, 0, mla, **kv)

    assert per_token() == 7 * 576 * 2
    assert per_token(kv_bits=8, kv_group_size=64) == 7 * (576 + 9 * 2 * 2)
    assert per_token(kv_bits=4, kv_group_size=64) == 7 * (288 + 9 * 2 * 2)
    assert per_token(kv_bits=4, kv_group_size=32) == 7 * (288 + 18 * 2 * 2)
    assert per_token(kv_bits=8, kv_group_size=128) == 7 * (512 + 4 * 2 * 2 + 64 * 2)
    assert per_token(kv_bits=8, act_bytes=4) == 7 * (576 + 9 * 2 * 4)
    # the KDA state does not depend on kv_bits, nor on the context
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)]
    assert cache_bytes(cfg, 10**6, kda, kv_bits=4) == cache_bytes(cfg, 0, kda) == 20 * 32 * 128 * (9 * 2 + 128 * 4)


def test_matches_the_real_quantized_layout():
    """The packed size the formula assumes is what mx.quantize produces for a latent row."""
    for bits, group in ((8, 64), (4, 64), (4, 32)):
        for width in (512, 64):
            w, scales, biases = mx.quantize(mx.zeros((3, width), mx.bfloat16), group_size=group, bits=bits)
            assert scales.dtype == biases.dtype == mx.bfloat16
            cfg = KimiConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                             intermediate_size=8, rms_norm_eps=1e-6, kda_layers=[], kda_num_heads=1, kda_head_dim=8,
                             short_conv_kernel_size=4, kv_lora_rank=width, qk_nope_head_dim=8, qk_rope_head_dim=0,
                             v_head_dim=8)
            assert cache_bytes(cfg, 3, kv_bits=bits, kv_group_size=group) == w.nbytes + scales.nbytes + biases.nbytes


def test_tensor_share_splits_only_the_kda_state():
    cfg = _cfg("kimi-linear-48b-a3b-instruct.json")
    shares = tensor_shares(cfg, 4)
    whole = cache_bytes(cfg, 1000)
    mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)]
    kda_whole = whole - cache_bytes(cfg, 1000, mla)
    assert [cache_bytes(cfg, 1000, share=s) for s in shares] == [whole - kda_whole * 3 // 4] * 4


def test_plan_reports_the_quantized_cache(capsys):
    from conftest import SHARED

    config = SHARED / "fixtures" / "configs" / "kimi-linear-48b-a3b-instruct.json"
    args = ["plan", "--model", str(config), "--hosts", "512", "--context", "1048576"]
    main(args)
    float_out = capsys.readouterr().out
    main(args + ["--kv-bits", "8"])
    q8 = capsys.readouterr().out
    assert "context 1,048,576 tokens (float latent cache)" in float_out
    assert "context 1,048,576 tokens (8-bit g64 latent cache)" in q8
    gb = lambda n: f"{n / 1e9:,.2f}"  # noqa: E731
    cfg = _cfg("kimi-linear-48b-a3b-instruct.json")
    assert gb(cache_bytes(cfg, 2**20)) in float_out
    assert gb(cache_bytes(cfg, 2**20, kv_bits=8)) in q8


def test_bench_reports_cache_bytes(kl_dir, capsys):
    assert main(["bench", "--model", str(kl_dir / "hf"), "-p", "64", "-g", "2", "-n", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    model, _ = load_model(kl_dir / "hf")
    size = model.model.embed_tokens.weight.dtype.size
    assert row["cache_bytes"] == cache_bytes(model.args, 64, act_bytes=size)
