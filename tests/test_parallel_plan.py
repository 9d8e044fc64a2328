"""The planner (``kimi_mlx.parallel.accounting``, ``cost``, ``splits``) and ``kimi-mlx plan``: byte accounting from
a config (or a GGUF header) equals the built models' parameter bytes, parameter by parameter; the split primitives'
edge cases and errors; plans of the real-size configs against the sizes stated in ../shared/spec; the cost model's
formulas; the CLI."""

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import KL_FIXTURE, K3_FIXTURE, SHARED, mlx_lm_quantized
from mlx.utils import tree_flatten

from kimi_mlx.cli.main import main
from kimi_mlx.config import KimiConfig
from kimi_mlx.loading import load, load_model
from kimi_mlx.parallel.accounting import (
    GB,
    GIB,
    QuantSpec,
    account_config,
    account_gguf,
    cache_bytes,
    checkpoint_tensor_names,
    parameters,
)
from kimi_mlx.parallel.cost import Host, Link, decode_bytes, plan_pipeline, plan_tensor, token_flops
from kimi_mlx.parallel.splits import pipeline_ranges, split_evenly, split_proportional, tensor_shares

CONFIGS = SHARED / "fixtures" / "configs"
FIXTURES = {"kimi_linear": KL_FIXTURE, "kimi_k3": K3_FIXTURE}
LINK = Link(8.0, 25.5)


def raw_config(path: Path) -> dict:
    return json.loads(path.read_text())


def per_param(model) -> dict[str, int]:
    """Bytes per parameter of a built model, a quantized module's weight/scales/biases summed under ``.weight``."""
    out: dict[str, int] = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith((".scales", ".biases")):
            k = k.rsplit(".", 1)[0] + ".weight"
        out[k] = out.get(k, 0) + v.nbytes
    return out


def fused_qkv(nbytes: dict[str, int]) -> dict[str, int]:
    """KDA q/k/v projections summed under ``qkv_proj`` (a model built from a fused checkpoint has that one)."""
    out: dict[str, int] = {}
    for k, v in nbytes.items():
        for p in ("q", "k", "v"):
            k = k.replace(f".self_attn.{p}_proj.", ".self_attn.qkv_proj.") if ".self_attn.g_proj" not in k else k
        out[k] = out.get(k, 0) + v
    return out


def assert_matches(model, acct) -> None:
    """Per parameter, per decoder layer (``model.layers[i]``) and in total: the accounting is the model's nbytes."""
    actual = per_param(model)
    fused = any(".qkv_proj." in k for k in actual)
    assert (fused_qkv(acct.nbytes) if fused else acct.nbytes) == actual
    layers = [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in model.layers]
    assert acct.layer_bytes() == layers
    assert acct.total == sum(v.nbytes for _, v in tree_flatten(model.parameters()))


# ------------------------------------------------------------------------------------------ accounting vs models


def test_parameter_table_is_the_model(arch):
    """Names and shapes from the config alone are exactly the built model's parameters (both architectures)."""
    name, path, _, model = arch
    cfg = KimiConfig.from_hf(raw_config(path / "hf" / "config.json"))
    assert {p.name: p.shape for p in parameters(cfg)} == {k: v.shape for k, v in tree_flatten(model.parameters())}


def test_float32_accounting(arch):
    name, path, _, model = arch
    assert_matches(model, account_config(raw_config(path / "hf" / "config.json"), dtype="float32"))


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_bfloat16_keeps_float32_parameters(name):
    """bfloat16: A_log, dt_bias, the conv and the router bias stay float32 (cast_predicate), the rest is bf16."""
    hf = FIXTURES[name] / "hf"
    model, _ = load_model(hf, dtype=mx.bfloat16)
    acct = account_config(raw_config(hf / "config.json"), dtype="bfloat16")
    assert_matches(model, acct)
    assert set(acct.by_layout()) == {"bfloat16", "float32"}


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_quantized_on_load(name):
    """load(quantize={"bits": 4, "group_size": 32}) on the CPU: affine 4-bit with float32 scales; routers, norms and
    AttnRes projections stay float."""
    hf = FIXTURES[name] / "hf"
    model, _ = load(hf, quantize={"bits": 4, "group_size": 32})
    assert_matches(model, account_config(raw_config(hf / "config.json"), dtype="float32", quantize=QuantSpec(4, 32)))


def test_group_size_that_does_not_divide_leaves_float():
    """Group 64 does not divide the tiny expert width (32): those matrices stay float, as quantize_model leaves them."""
    hf = KL_FIXTURE / "hf"
    model, _ = load(hf, quantize={"bits": 8, "group_size": 64}, dtype=mx.bfloat16)
    acct = account_config(raw_config(hf / "config.json"), dtype="bfloat16", quantize=QuantSpec(8, 64))
    assert_matches(model, acct)
    assert acct.layout["model.layers.1.mlp.switch_mlp.down_proj.weight"] == "bfloat16"


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_mxfp4_experts(name):
    """Routed experts as MLX mxfp4 (how load holds the released K3's compressed-tensors experts), the rest float."""
    hf = FIXTURES[name] / "hf"
    model, _ = load_model(hf, dtype=mx.float32)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: ".switch_mlp." in p and hasattr(m, "to_quantized"))
    assert_matches(model, account_config(raw_config(hf / "config.json"), dtype="float32", experts_mxfp4=True))


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_mlx_lm_quantized_directory(name, tmp_path):
    """An mlx-lm 4-bit directory (8-bit router overrides; K3 with fused qkv_proj), from its config and tensor names,
    and from its config alone."""
    dst = tmp_path / "q"
    mlx_lm_quantized(FIXTURES[name] / "hf", dst)
    model, _ = load_model(dst, dtype=mx.float32)
    raw = raw_config(dst / "config.json")
    for names in (checkpoint_tensor_names(dst), None):
        assert_matches(model, account_config(raw, dtype="float32", tensor_names=names))


@pytest.mark.parametrize("quant", ["F16", "Q8_0"])
@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_gguf_header_accounting(name, quant):
    """From the GGUF header only: F16 tensors load as float32, Q8_0 as affine 8-bit g32 with float32 scales."""
    gguf = FIXTURES[name] / f"{name.replace('_', '-')}-tiny-{quant}.gguf"
    model, _ = load(gguf)
    acct = account_gguf(gguf)
    assert_matches(model, acct)
    if quant == "Q8_0":
        assert "Q8_0 -> affine 8-bit g32 (float32 scales)" in acct.by_layout()


def test_gguf_quantized_on_load():
    gguf = K3_FIXTURE / "kimi-k3-tiny-F16.gguf"
    model, _ = load(gguf, quantize={"bits": 4, "group_size": 32})
    assert_matches(model, account_gguf(gguf, quantize=QuantSpec(4, 32)))


# ------------------------------------------------------------------------------------------ split primitives


def test_split_evenly_edges():
    assert [len(r) for r in split_evenly(10, 3)] == [4, 3, 3]  # uneven: earlier ranges larger
    assert [len(r) for r in split_evenly(2, 3)] == [1, 1, 0]  # more ranks than heads: an empty range
    assert split_evenly(256, 3, unit=64) == [range(0, 128), range(128, 192), range(192, 256)]
    with pytest.raises(ValueError, match="units of 64"):
        split_evenly(100, 2, unit=64)
    with pytest.raises(ValueError, match="at least 1"):
        split_evenly(10, 0)


def test_split_proportional_edges():
    assert split_proportional([1] * 10, [3, 1]) == [range(0, 7), range(7, 10)]  # 7 and 8 tie for 7.5: the lower
    assert split_proportional([5, 1, 1, 1], [1, 1]) == [range(0, 1), range(1, 4)]
    assert split_proportional([1, 1, 1], [1, 100, 1]) == [range(0, 1), range(1, 2), range(2, 3)]  # >= 1 layer each
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        split_proportional([1, 1, 1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="positive value per rank"):
        split_proportional([1, 1], [1, 0])


def test_tensor_shares_more_ranks_than_heads():
    """3 ranks over the tiny K3's 2 heads and 4 experts: one rank gets no heads, nothing is refused."""
    cfg = KimiConfig.from_hf(raw_config(K3_FIXTURE / "hf" / "config.json"))
    shares = tensor_shares(cfg, 3, unit=32)
    assert [len(s.kda_heads) for s in shares] == [1, 1, 0]
    assert [len(s.experts) for s in shares] == [2, 1, 1]
    assert [len(s.ffn) for s in shares] == [96, 96, 64]  # 256 columns in units of 32


@pytest.mark.parametrize("split, match", [
    ("20,7,1", "3 layer counts for 2 ranks"),   # wrong count
    ("27,0", "expected positive layer counts"),  # non-positive
    ("-1,28", "expected positive layer counts"),
    ("20,6", "they sum to 26"),                  # wrong sum
    ("13.5,13.5", "expected 'even' or comma-separated layer counts"),  # non-integer
    ("a,b", "expected 'even' or comma-separated layer counts"),
])
def test_bad_split_values(split, match):
    with pytest.raises(ValueError, match=match):
        pipeline_ranges([1] * 27, [1, 1], split)


def test_split_values():
    assert pipeline_ranges([1] * 27, [1, 1], "20,7") == [range(0, 20), range(20, 27)]
    assert pipeline_ranges([1] * 27, [1, 1], [7, 20]) == [range(0, 7), range(7, 27)]
    assert pipeline_ranges([1] * 27, [5, 1], "even") == [range(0, 14), range(14, 27)]
    with pytest.raises(ValueError, match="4 layers cannot be split over 5 ranks"):
        pipeline_ranges([1] * 4, [1] * 5, "even")


# ------------------------------------------------------------------------------------------ real-size configs


@pytest.fixture(scope="module")
def k3_raw():
    return raw_config(CONFIGS / "kimi-k3.json")


@pytest.fixture(scope="module")
def kl_raw():
    return raw_config(CONFIGS / "kimi-linear-48b-a3b-instruct.json")


def _active(acct) -> float:
    """Parameters one token uses (top-k experts, the head, no embedding gather), as the spec counts them."""
    cfg = acct.cfg
    return sum(p.numel * (cfg.num_experts_per_token / cfg.num_experts if p.expert else 1)
               for p in acct.params if p.part != "embed")


def test_released_k3_size(k3_raw):
    """Spec §2.1: 2.78 T params (2.7227 T MXFP4 experts, 57.2 B BF16, 11 M F32), 104.2 B active, 1560.94 GB.

    Reconciled: the checkpoint also holds the vision tower (MoonViT-V2, 401 M params) and the projector in BF16,
    which kimi-mlx does not load (text only): ~0.47 B params, ~0.95 GB. Our text model is 56.73 B BF16 and
    1559.97 GB, 0.06 % under the checkpoint."""
    acct = account_config(k3_raw)
    experts = sum(p.numel for p in acct.params if p.expert)
    bf16 = sum(p.numel for p in acct.params if not p.expert and acct.layout[p.name] == "bfloat16")
    f32 = sum(p.numel for p in acct.params if acct.layout[p.name] == "float32")
    assert experts == pytest.approx(2.7227e12, rel=1e-4)
    assert 57.2e9 - 0.55e9 < bf16 < 57.2e9 - 0.40e9  # the vision tower and projector are the difference
    assert f32 == pytest.approx(11e6, rel=0.02)
    assert _active(acct) == pytest.approx(104.2e9, rel=1e-3)
    assert acct.total == pytest.approx(1560.94e9, rel=1e-3)
    assert acct.by_layout()["mxfp4"] == experts * 0.53125  # 4 bits + one E8M0 byte per 32


def test_unsupported_quantization_config(kl_raw):
    raw = dict(kl_raw, quantization_config={"quant_method": "fp8", "format": "float-quantized"})
    with pytest.raises(ValueError, match="quant_method='fp8' .* is not supported"):
        account_config(raw)


def test_kimi_linear_size(kl_raw):
    """Spec §1.2: 49.12 B total, 3.11 B active; 4-bit (affine g64, bf16 scales) ~27.6 GB like mlx-community's."""
    acct = account_config(kl_raw)
    assert sum(p.numel for p in acct.params) == pytest.approx(49.12e9, rel=1e-3)
    assert _active(acct) == pytest.approx(3.11e9, rel=2e-3)
    assert account_config(kl_raw, quantize=QuantSpec(4, 64)).total == pytest.approx(27.6e9, rel=0.01)


def test_cache_sizes_match_the_spec(kl_raw, k3_raw):
    """Spec §1.7 / distributed_and_server §2.3: KL MLA latent 8,064 B/token (7.9 GiB at 1M), KDA state 40 MiB +
    conv 1.4 MiB; K3 27.6 KB/token, KDA state 414 MiB + conv 14.6 MiB."""
    for raw, per_token, state, conv in ((kl_raw, 8064, 40 * 2**20, 1.4 * 2**20),
                                        (k3_raw, 27648, 414 * 2**20, 14.6 * 2**20)):
        acct = account_config(raw)
        layers = range(acct.cfg.num_hidden_layers)
        assert cache_bytes(acct.cfg, 1, layers) - cache_bytes(acct.cfg, 0, layers) == per_token
        assert cache_bytes(acct.cfg, 0, layers) == pytest.approx(state + conv, rel=0.01)
    acct = account_config(kl_raw)
    mla = [i for i in range(27) if not acct.cfg.is_kda_layer(i)]
    assert cache_bytes(acct.cfg, 2**20, mla) / GIB == 7.875


def test_k3_as_released_needs_four_512gb_macs(k3_raw):
    acct = account_config(k3_raw)
    two = plan_pipeline(acct, [Host(512)] * 2, LINK)
    assert not two.fits
    short = two.shortfall()
    assert len(short) == 3 and all("short by" in line for line in short)
    assert "short by 481" in short[-1]  # 1563.7 GB needed, 2 x (512 GiB - 8 GiB) = 1082.3 GB usable
    four = plan_pipeline(acct, [Host(512)] * 4, LINK)
    assert four.fits and four.shortfall() == []
    assert [len(r.layers) for r in four.ranks] == [24, 23, 23, 23]
    # the embedding on rank 0 only, the head on every rank
    head = acct.part_bytes("head")
    assert four.ranks[1].weights == sum(acct.layer_bytes()[24:47]) + head + acct.part_bytes("norm")
    assert four.ranks[0].weights == (sum(acct.layer_bytes()[:24]) + head + acct.part_bytes("norm")
                                     + acct.part_bytes("embed"))


def test_k3_4bit_on_three_and_kimi_linear_at_1m(k3_raw, kl_raw):
    k3 = plan_pipeline(account_config(k3_raw, quantize=QuantSpec(4, 64)), [Host(512)] * 3, LINK)
    assert k3.fits
    kl = plan_pipeline(account_config(kl_raw, quantize=QuantSpec(4, 64)), [Host(64, 546)], LINK, context=2**20)
    assert kl.fits and kl.ranks[0].cache > 8 * GB
    assert not plan_pipeline(account_config(kl_raw), [Host(64, 546)], LINK, context=2**20).fits  # bf16: 98 GB


def test_tensor_plan_replicates_and_splits(k3_raw):
    """Per rank: the replicated parameters whole plus a share of the split ones; 3 ranks split 96 heads and 896
    experts unevenly. The KDA state is split by heads, the MLA latent cache is whole on every rank."""
    acct = account_config(k3_raw)
    plan = plan_tensor(acct, [Host(512)] * 3, LINK, context=4096)
    replicated = sum(acct.nbytes[p.name] for p in acct.params if p.split is None)
    assert sum(r.weights for r in plan.ranks) == pytest.approx(acct.total + 2 * replicated, abs=3)
    assert [len(r.share.experts) for r in plan.ranks] == [299, 299, 298]
    single = cache_bytes(acct.cfg, 4096, range(93), act_bytes=acct.act_bytes)
    mla = 4096 * 576 * 2 * 24
    assert sum(r.cache for r in plan.ranks) == pytest.approx(single + 2 * mla, rel=1e-9)


def test_cost_model_formulas(kl_raw):
    """One host: decode time = bytes read / bandwidth (no links). Tensor: + 2 all_sums per layer, each 2(n-1) steps
    of latency + hidden/n bytes. Compute-bound when the FLOPs take longer than the bytes."""
    acct = account_config(kl_raw)
    every = frozenset({"embed", "norm", "head"})
    one = plan_pipeline(acct, [Host(64, 500)], LINK, context=1000)
    assert one.decode.seconds == pytest.approx(decode_bytes(acct, 1000, range(27), every) / 500e9)
    n = 4
    tp = plan_tensor(acct, [Host(512, 800)] * n, LINK, context=1000)
    hidden = 2304 * 2
    assert tp.decode.links == pytest.approx(2 * 27 * 2 * (n - 1) * (25.5e-6 + hidden / n / 8e9))
    slow = plan_pipeline(acct, [Host(64, 500, tflops=0.001)], LINK, context=1000)
    assert slow.decode.seconds == pytest.approx(token_flops(acct, 1000, range(27), every) / 1e9)
    assert slow.prefill.tokens == 1000 and slow.prefill.seconds > 1000 * slow.decode.seconds / 2
    # pipeline messages: hidden plus the K3 AttnRes blocks completed before the boundary
    k3 = account_config(raw_config(CONFIGS / "kimi-k3.json"))
    two = plan_pipeline(k3, [Host(512)] * 2, LINK, split="47,46")
    assert two.link_bytes == (math.ceil(47 / 12) + 1) * 7168 * 2 + 7168 * 2


# ------------------------------------------------------------------------------------------ CLI


def test_cli_k3_does_not_fit_two_macs(capsys):
    rc = main(["plan", "--model", str(CONFIGS / "kimi-k3.json"), "--hosts", "512,512"])
    out = capsys.readouterr().out
    assert rc == 2
    assert "DOES NOT FIT" in out and "short by 481.3 GB in all" in out
    assert "0-46 (47)" in out and "47-92 (46)" in out


def test_cli_k3_fits_four_macs_and_predicts(capsys):
    rc = main(["plan", "--model", str(CONFIGS / "kimi-k3.json"), "--hosts", "512,512,512,512", "--tflops", "28",
               "--context", "8192"])
    out = capsys.readouterr().out
    assert rc == 0 and "fits: every rank has room" in out
    assert "decode at 8,192 tokens of context:" in out and "prefill of 8,192 tokens:" in out


def test_cli_tensor_on_gguf_and_unknown_bandwidth(capsys):
    gguf = K3_FIXTURE / "kimi-k3-tiny-Q8_0.gguf"
    rc = main(["plan", "--model", str(gguf), "--hosts", "16,16,16", "--parallel", "tensor"])
    out = capsys.readouterr().out
    assert rc == 0 and "none (0)" in out  # 3 ranks, 2 heads
    assert "decode: not predicted: no memory bandwidth for rank(s) [0, 1, 2]" in out


@pytest.mark.parametrize("argv, message", [
    (["--split", "40,50"], "--split 40,50: split [40, 50]: expected positive layer counts"),
    (["--split", "even", "--parallel", "tensor"], "only --parallel pipeline takes a split"),
    (["--bandwidth", "1,2,3"], "3 values for 2 hosts"),
    (["--hosts", "512,-1"], "expected positive numbers"),
    (["--quantize", "7"], "supports (2, 3, 4, 5, 6, 8) bits"),
])
def test_cli_bad_arguments(capsys, argv, message):
    base = ["plan", "--model", str(CONFIGS / "kimi-k3.json"), "--hosts", "512,512"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_cli_subprocess_kimi_linear_one_mac(tmp_path):
    """The console entry point in a fresh process: Kimi Linear 4-bit at 1M tokens of context on one 64 GB Mac."""
    cmd = [sys.executable, "-m", "kimi_mlx.cli.main", "plan", "--model", str(CONFIGS /
           "kimi-linear-48b-a3b-instruct.json"), "--hosts", "64", "--quantize", "4", "--context", "1048576",
           "--bandwidth", "546"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)  # the installed package
    assert proc.returncode == 0, proc.stderr
    assert "weights as loaded: 27.66 GB" in proc.stdout and "fits" in proc.stdout


# ------------------------------------------------------------------------------------------ the GPU working set

MIB = 2**20


def test_k3_on_four_macs_needs_the_wired_limit_raised(k3_raw):
    """By default macOS lets the GPU of a 512 GiB Mac wire 384 GiB (macOS 13-15: 3/4 of memory), 412.3 GB: K3's
    ranks need 390.5-395.6 GB at 32K tokens, over 90% of it, so every host is raised to the limit at which the
    largest takes 90% (all by the same factor: load's split by working set stays the planned one). With that limit,
    or macOS 26's measured 464 GiB, nothing is left to raise."""
    acct = account_config(k3_raw)
    four = plan_pipeline(acct, [Host(512)] * 4, LINK)
    assert [r.host.working_set for r in four.ranks] == [384 * GIB] * 4
    assert four.fits and [round(r.need / GB, 2) for r in four.ranks] == [395.61, 391.31, 390.92, 390.53]
    assert not any(r.wired_ok for r in four.ranks)
    limit = math.ceil(395.61e9 / 0.9 / MIB)
    assert four.wired_limits() == {r: pytest.approx(limit, abs=6) for r in range(4)}  # need rounded to 0.01 GB
    raised = plan_pipeline(acct, [Host(512, wired_limit_gib=four.wired_limits()[0] / 1024)] * 4, LINK)
    assert raised.wired_limits() == {} and [len(r.layers) for r in raised.ranks] == [24, 23, 23, 23]
    assert plan_pipeline(acct, [Host(512, wired_limit_gib=464)] * 4, LINK).wired_limits() == {}


def test_pipeline_split_follows_the_working_sets(k3_raw):
    """Layers in proportion to each host's working set (what load's split gets from each Mac): a host with a raised
    limit takes more; raising both keeps the ratio of their working sets, so the split stays; a given split is
    kept and only the ranks short of their working set are raised."""
    acct = account_config(k3_raw)
    hosts = [Host(512, wired_limit_gib=480), Host(512), Host(512), Host(512)]
    plan = plan_pipeline(acct, hosts, LINK)
    assert [r.layers for r in plan.ranks] == pipeline_ranges(acct.layer_bytes(), [480 * GIB] + [384 * GIB] * 3)
    assert [len(r.layers) for r in plan.ranks] == [28, 22, 21, 22]
    assert plan.fits and [r.wired_ok for r in plan.ranks] == [True, False, True, False]
    limits = plan.wired_limits()
    assert sorted(limits) == [0, 1, 2, 3] and plan.tight(limits) == []
    ratios = [limits[r] * MIB / h.working_set for r, h in enumerate(hosts)]
    assert max(ratios) - min(ratios) < 1e-5
    given = plan_pipeline(account_config(k3_raw, quantize=QuantSpec(4, 64)), [Host(512)] * 4, LINK,
                          split="30,21,21,21")
    assert [r.rank for r in given.ranks if not r.wired_ok] == [0]
    assert given.wired_limits() == {0: math.ceil(given.ranks[0].need / 0.9 / MIB)}


def test_tensor_plan_raises_only_the_short_rank_and_caps_at_usable(kl_raw, k3_raw):
    """Tensor parallelism over a 128 and a 64 GiB Mac: the halves are equal, so only the smaller host is short of
    its working set. Ranks that fit memory - reserve but not with 10% to spare are raised to memory - reserve (the
    same factor for all: 392 / 300 GiB) and named tight."""
    plan = plan_tensor(account_config(kl_raw), [Host(128), Host(64)], LINK, context=200_000)
    assert plan.fits and [r.wired_ok for r in plan.ranks] == [True, False]
    assert plan.wired_limits() == {1: math.ceil(plan.ranks[1].need / 0.9 / MIB)}
    tight = plan_pipeline(account_config(k3_raw), [Host(400)] * 4, LINK)
    assert tight.fits and tight.wired_limits() == {r: (400 - 8) * 1024 for r in range(4)}
    assert tight.tight(tight.wired_limits()) == [0, 1, 2, 3]


def test_cli_says_when_to_raise_the_wired_limit(capsys):
    base = ["plan", "--model", str(CONFIGS / "kimi-k3.json"), "--hosts", "512,512,512,512"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "GPU set" in out and out.count(" 412.32 ") == 4
    assert "fits: every rank has room (least free: rank 0, 145.55 GB) once the GPU wired limit is raised:" in out
    assert "rank 0 96%, rank 1 95%, rank 2 95%, rank 3 95%" in out
    assert "on the host of ranks 0, 1, 2, 3: sudo sysctl iogpu.wired_limit_mb=419208 (409.4 GiB; until reboot)" in out
    assert main(base + ["--wired-limit", "464"]) == 0
    assert "within each host's GPU working set (fullest: rank 0, 79% of it)" in capsys.readouterr().out
    assert main(base + ["--wired-limit", "464,0,0,0"]) == 0
    assert "sysctl" in capsys.readouterr().out  # 0: the host's default
    assert main(["plan", "--model", str(CONFIGS / "kimi-k3.json"), "--hosts", "400,400,400,400"]) == 0
    out = capsys.readouterr().out
    assert "sudo sysctl iogpu.wired_limit_mb=401408 (392.0 GiB; until reboot)" in out
    assert "TIGHT: rank(s) [0, 1, 2, 3] still take more than 90%" in out


@pytest.mark.parametrize("argv, message", [
    (["--wired-limit", "600"], "host 0: wired limit 600 GiB; expected a positive number no larger than its 512 GiB"),
    (["--wired-limit", "400,400,400"], "3 values for 2 hosts"),
    (["--wired-limit", "-1"], "expected positive numbers (or 0)"),
])
def test_cli_bad_wired_limits(capsys, argv, message):
    assert main(["plan", "--model", str(CONFIGS / "kimi-k3.json"), "--hosts", "512,512"] + argv) == 2
    assert message in capsys.readouterr().err
