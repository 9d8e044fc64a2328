"""Distributed runs of GGUF tensors kept as GGML blocks (issue 15): the planner counts the file's block bytes (and a
converted MLX directory's), tensor parallelism cuts block layers by rows (heads, experts) and on whole blocks by
columns, each rank reads only its experts' bytes, and 2 ring ranks (tensor and pipeline) give the single process's
logits.

The Kimi Linear fixture with 256-wide experts (``_wide_pair``) in these types: IQ experts, Q6_K attention q and head,
IQ1_M embedding, and IQ4_NL (32-wide blocks) for every layer cut by column (o_proj, dense and shared down_proj) and
the shared gate, so widths split in units of 32 and the column cuts are real byte ranges of each row. The ranks also
run Kimi-K3 (``test_gguf_native``'s types, with IQ4_NL o_proj and shared down_proj).
"""

import json
import re
import warnings

import mlx.core as mx
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE
from distributed import run_ranks
from test_gguf_native import NATIVE_TYPES, _ggml_layers, _wide_pair
from test_parallel_plan import assert_matches

import kimi_mlx
from kimi_mlx.cli.main import main
from kimi_mlx.layers.ggml import GGMLSwitchLinear
from kimi_mlx.loading import load_model
from kimi_mlx.parallel.accounting import account_config, account_gguf, checkpoint_tensor_names
from kimi_mlx.parallel.cost import Host, plan_tensor
from kimi_mlx.parallel.splits import tensor_shares
from kimi_mlx.parallel.shard import SumGGMLLinear, shard_model, width_unit

TYPES = {
    "ffn_gate_exps.weight": "IQ2_XXS", "ffn_up_exps.weight": "IQ3_XXS", "ffn_down_exps.weight": "IQ1_S",
    "output.weight": "Q6_K", "attn_q.weight": "Q6_K", "token_embd.weight": "IQ1_M",
    "attn_output.weight": "IQ4_NL", "ffn_down.weight": "IQ4_NL", "ffn_down_shexp.weight": "IQ4_NL",
    "ffn_gate_shexp.weight": "IQ4_NL",
}
K3_TYPES = {**NATIVE_TYPES[K3_FIXTURE], "attn_output.weight": "IQ4_NL", "ffn_down_shexp.weight": "IQ4_NL"}
TOL = 1e-4  # tensor parallel: partial sums add up in another order (measured below)


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """The Kimi Linear GGUF (``TYPES``)."""
    return _wide_pair(KL_FIXTURE, tmp_path_factory.mktemp("ggml_kl"), TYPES)[0]


@pytest.fixture(scope="module")
def k3_blocks(tmp_path_factory):
    return _wide_pair(K3_FIXTURE, tmp_path_factory.mktemp("ggml_k3"), K3_TYPES)[0]


@pytest.fixture(scope="module")
def converted(blocks, tmp_path_factory):
    """``kimi-mlx convert`` of ``blocks``: an MLX directory keeping the blocks (``{"ggml_type": ...}`` overrides)."""
    out = tmp_path_factory.mktemp("ggml_mlx") / "mlx"
    assert main(["convert", "--model", str(blocks), "--out", str(out), "--quiet"]) == 0
    return out


def _load(path, **kw):
    return kimi_mlx.load(str(path), dtype=mx.float32, **kw)[0]


def test_plan_counts_the_block_bytes(blocks, capsys):
    """``account_gguf`` (``kimi-mlx plan``) equals the loaded model parameter by parameter: by default the block
    tensors are their GGUF bytes and split in units of their block size (the planner's unit is ``width_unit``'s);
    with ``requantize`` / ``--requantize`` both count the affine conversion."""
    model = _load(blocks)
    acct = account_gguf(blocks)
    assert_matches(model, acct)
    assert {"IQ2_XXS blocks", "IQ1_S blocks", "Q6_K blocks", "IQ4_NL blocks"} <= set(acct.by_layout())
    assert acct.split_unit() == width_unit(model) == 32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the requantization warning
        requantized = _load(blocks, requantize=True)
    assert not _ggml_layers(requantized)
    acct = account_gguf(blocks, requantize=True)
    assert_matches(requantized, acct)
    assert "IQ2_XXS -> affine 3-bit g32 (float32 scales)" in acct.by_layout()

    argv = ["plan", "--model", str(blocks), "--hosts", "24,24", "--parallel", "tensor"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "IQ2_XXS blocks" in out and "affine" not in out
    assert "0-127 (128)" in out and "128-255 (128)" in out  # MLP columns in units of 32
    assert main(argv + ["--requantize"]) == 0 and "IQ2_XXS -> affine 3-bit g32" in capsys.readouterr().out


def test_plan_counts_a_converted_directory(converted):
    """The converted MLX directory: the planner counts the blocks' bytes and unit from its config, with the tensor
    names and without, as ``load_model`` holds them."""
    model, _ = load_model(converted, dtype=mx.float32)
    raw = json.loads((converted / "config.json").read_text())
    for names in (checkpoint_tensor_names(converted), None):
        acct = account_config(raw, dtype="float32", tensor_names=names)
        assert_matches(model, acct)
        assert acct.split_unit() == width_unit(model) == 32


def test_column_cuts_keep_whole_blocks(blocks):
    """Rank 1 of 2 (single-process group): o_proj keeps the byte range of its head's columns in every row (2 IQ4_NL
    blocks of 18 bytes) and sums over ranks; expert stacks keep their experts' rows; a split of the dense width that
    is not on 32-column blocks (3 ranks in units of 1: 86 columns) names the layer, the type and the block size."""
    full = _load(blocks)
    model = _load(blocks)
    cfg = model.args
    shard_model(model, tensor_shares(cfg, 2, width_unit(model))[1], mx.distributed.init())
    o_full, o = full.layers[0].self_attn.o_proj, model.layers[0].self_attn.o_proj
    assert type(o) is SumGGMLLinear and o.input_dims == 64 and o.weight.shape == (256, 36)
    assert mx.array_equal(o.weight, o_full.weight[:, 36:72])
    down = model.layers[0].mlp.down_proj
    assert down.input_dims == 128 and mx.array_equal(down.weight, full.layers[0].mlp.down_proj.weight[:, 72:])
    stack = model.layers[1].mlp.switch_mlp.down_proj
    assert type(stack) is GGMLSwitchLinear and stack.num_experts == 2
    assert mx.array_equal(stack.weight, full.layers[1].mlp.switch_mlp.down_proj.weight[2:])

    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj: columns 0:86 do not fall on IQ4_NL block "
                                         r"boundaries \(block size 32\)"):
        shard_model(_load(blocks), tensor_shares(cfg, 3)[0], mx.distributed.init())


def test_plan_refuses_heads_that_cut_a_block():
    """A KDA o_proj in Q6_K over 2 heads of 128 columns: each rank's head is half a 256-column block, which
    ``load(parallel="tensor")`` cannot cut; the planner says so (parameter, layout, rank, columns)."""
    raw = json.loads((KL_FIXTURE / "hf" / "config.json").read_text())
    raw["linear_attn_config"]["head_dim"] = 128
    raw["quantization"] = {"model.layers.0.self_attn.o_proj": {"ggml_type": "Q6_K"}}
    acct = account_config(raw, dtype="float32")
    assert acct.layout["model.layers.0.self_attn.o_proj.weight"] == "Q6_K blocks"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight \(Q6_K blocks\): rank 0's "
                                         r"heads 0-0 are columns 0:128, which do not fall on its 256-column"):
        plan_tensor(acct, [Host(24)] * 2)
    assert plan_tensor(acct, [Host(24)]).fits  # one rank cuts nothing


# Every rank, each source: the single-process model, then tensor parallel and pipeline parallel loads of the same
# source; a forward of 40 ids and prefill + 6 greedy decode steps through the cache for each. TensorRows.raw is
# wrapped to record which rows of which stacked GGUF tensors this rank read.
RANK_SCRIPT = """
from kimi_mlx import load
from kimi_mlx.layers.ggml import GGML_LAYERS
from kimi_mlx.loading import TensorRows

read = []
raw = TensorRows.raw
TensorRows.raw = lambda self: read.append([self.name, self.rows.start, self.rows.stop]) or raw(self)
ids = mx.array([[(7 * i + 3) % 380 for i in range(40)]])


def run(model):
    cache = model.make_cache()
    steps = [model(ids, cache=cache)[:, -1]]
    tokens = []
    for _ in range(6):
        tokens.append(int(mx.argmax(steps[-1], axis=-1).item()))
        steps.append(model(mx.array([[tokens[-1]]]), cache=cache)[:, -1])
    return model(ids)[0], mx.concatenate(steps), tokens


def experts(model):
    stacks = {p: m for p, m in model.named_modules() if isinstance(m, GGML_LAYERS) and ".switch_mlp." in p}
    return {p: [m.ggml_type, m.weight.shape[0], m.weight.nbytes] for p, m in stacks.items()}


results = {}
for path in sys.argv[1:]:
    ref = load(path, dtype=mx.float32)[0]
    want = run(ref)
    out = results[path] = {"ref_tokens": want[2], "whole": experts(ref)}
    for mode in ("tensor", "pipeline"):
        read.clear()
        model = load(path, dtype=mx.float32, parallel=mode)[0]
        got = run(model)
        out[mode] = {"full": mx.abs(got[0] - want[0]).max().item(), "decode": mx.abs(got[1] - want[1]).max().item(),
                     "tokens": got[2], "experts": experts(model), "read": sorted({tuple(r) for r in read})}
report(results)
"""

# Measured max |logit diff| of tensor parallel (full forward, decode), both ranks: Kimi Linear 3.2e-6 / 3.0e-6 (GGUF
# and converted directory), Kimi-K3 1.5e-5 / 5.0e-6; pipeline 0 for all.


def test_two_ranks_match_one_process(blocks, k3_blocks, converted, tmp_path):
    """2 ring ranks, the Kimi Linear and Kimi-K3 GGUFs and the converted Kimi Linear directory: tensor parallel within
    1e-4 of one process (full forward, prefill, 6 decode steps), pipeline exactly equal, the same greedy tokens; under
    tensor parallelism each rank holds only its 2 of 4 experts, as blocks of half the stack's bytes, and from a GGUF
    reads only their rows of the stacked tensor."""
    sources = {"kimi_linear": blocks, "kimi_k3": k3_blocks, "converted": converted}
    results = run_ranks(RANK_SCRIPT, 2, tmp_path, args=sources.values(), timeout=150)
    for name, path in sources.items():
        for rank, r in enumerate(x[str(path)] for x in results):
            where = f"{name} rank {rank}"
            print(where, {m: (r[m]["full"], r[m]["decode"]) for m in ("tensor", "pipeline")})
            assert r["tensor"]["full"] <= TOL and r["tensor"]["decode"] <= TOL, (where, r["tensor"])
            assert r["pipeline"]["full"] == 0 and r["pipeline"]["decode"] == 0, (where, r["pipeline"])
            assert r["tensor"]["tokens"] == r["pipeline"]["tokens"] == r["ref_tokens"], where
            held = r["tensor"]["experts"]
            assert held.keys() == r["whole"].keys() and len(held) == 9  # 3 MoE layers x gate / up / down
            for module, (qtype, n, nbytes) in held.items():
                whole_type, whole_n, whole_bytes = r["whole"][module]
                assert (qtype, n, nbytes) == (whole_type, 2, whole_bytes // 2), (where, module)
            lo = 2 * rank
            gguf_reads = [] if name == "converted" else sorted([t, lo, lo + 2] for t in _stacked_names(held))
            assert r["tensor"]["read"] == gguf_reads, where


def _stacked_names(held: dict) -> list[str]:
    """GGUF names of the stacked expert tensors behind ``...layers.{i}.mlp.switch_mlp.{p}`` module paths."""
    gguf = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    layer = re.compile(r"layers\.(\d+)\.mlp\.switch_mlp\.(\w+)$")
    return [f"blk.{i}.{gguf[proj]}.weight" for i, proj in (layer.search(p).groups() for p in held)]
