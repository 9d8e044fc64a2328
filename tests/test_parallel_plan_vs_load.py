"""`kimi-mlx plan` predicts what `load(parallel=...)` makes: the split of the fixtures' tiny configs and each rank's
parameter bytes (the issue asks for 5%; both come from one accounting, so they are equal), also for a parameter
added to a layer without editing ``parallel/``. Sources: the HF
checkpoints (float32, quantized on load to 4 bits) and GGUFs with IQ experts and a Q6_K head kept as GGML blocks
(``test_gguf_native``'s types; the planner counts the file's block bytes, split in units of the block size)."""

import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE
from test_gguf_native import NATIVE_TYPES, _wide_pair

from kimi_mlx.config import KimiConfig
from kimi_mlx.convert.gguf.reader import GGUFFile
from kimi_mlx.layers.mla import KimiMLA
from kimi_mlx.loading import load_gguf_model, load_model
from kimi_mlx.parallel import param_bytes
from kimi_mlx.parallel.pipeline import Stages, layer_bytes
from kimi_mlx.parallel.accounting import account_config, account_gguf
from kimi_mlx.parallel.cost import Host, plan_pipeline, plan_tensor
from kimi_mlx.parallel.splits import pipeline_ranges
from kimi_mlx.models.kimi_linear import Model
from kimi_mlx.parallel.shard import ROWS, TENSOR_SPLITS, Cut, shard_model

FIXTURES = {"kimi_linear": KL_FIXTURE / "hf", "kimi_k3": K3_FIXTURE / "hf"}
QUANT = {"float32": None, "4-bit": {"bits": 4, "group_size": 32}, "gguf-blocks": None}


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> dict:
    """Fixture name -> its GGUF with 256-wide IQ experts and a Q6_K head (more K-quant / IQ types besides)."""
    return {name: _wide_pair(hf.parent, tmp_path_factory.mktemp(name), NATIVE_TYPES[hf.parent])[0]
            for name, hf in FIXTURES.items()}


def _plan_and_model(name: str, quant: str, native: dict):
    from kimi_mlx.parallel.accounting import QuantSpec

    if quant == "gguf-blocks":
        gguf = native[name]
        return account_gguf(gguf), lambda: load_gguf_model(GGUFFile(gguf))[0]
    path = FIXTURES[name]
    q = QUANT[quant]
    acct = account_config(json.loads((path / "config.json").read_text()), dtype="float32",
                          quantize=q and QuantSpec(q["bits"], q["group_size"]))
    return acct, lambda: load_model(path, dtype=mx.float32, quantize=q, lazy=True)[0]


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_plan_is_the_load(name, quant, n, native):
    """Equal hosts: the planned layer ranges are the ones load's memory-proportional split makes from the built
    model's layer bytes, and each stage holds the planned weight bytes."""
    acct, build = _plan_and_model(name, quant, native)
    plan = plan_pipeline(acct, [Host(24)] * n, reserve_gib=1)
    model = build()
    ranges = pipeline_ranges(layer_bytes(model), [1] * n)
    assert [rp.layers for rp in plan.ranks] == ranges
    for rp in plan.ranks:
        stage = Stages(tuple(ranges), rp.rank, None, model.args.tie_word_embeddings).apply(build())
        held = param_bytes(stage)
        assert abs(held - rp.weights) <= 0.05 * rp.weights and held == rp.weights, (rp.rank, held, rp.weights)


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("n", [2, 3])
def test_tensor_plan_is_the_load(name, quant, n, native):
    """Each rank's planned share (heads, experts, widths) cut from the model holds the planned weight bytes."""
    acct, build = _plan_and_model(name, quant, native)
    plan = plan_tensor(acct, [Host(24)] * n, reserve_gib=1)
    for rp in plan.ranks:
        held = param_bytes(shard_model(build(), rp.share, mx.distributed.init()))
        assert abs(held - rp.weights) <= 0.05 * rp.weights and held == rp.weights, (rp.rank, held, rp.weights)


SCRATCH_ROWS = 8  # per MLA head


@pytest.mark.parametrize("declared", [False, True], ids=["replicated", "declared-split"])
def test_a_parameter_added_to_a_layer(monkeypatch, declared):
    """A scratch Linear added to the MLA block (its ``__init__`` patched; nothing in ``parallel/`` edited) is counted
    by the planner: undeclared, tensor parallelism replicates it (every rank holding heads keeps it whole; a rank
    holding none keeps the idle block without it) and the planner counts it so; declared as a head-split child of the
    block (one ``TENSOR_SPLITS`` entry, read by both) each rank keeps its heads' rows and the planner counts that."""
    raw = json.loads((FIXTURES["kimi_linear"] / "config.json").read_text())
    cfg = KimiConfig.from_hf(raw)
    before = account_config(raw, dtype="float32")
    init = KimiMLA.__init__

    def with_scratch(self, cfg):
        init(self, cfg)
        self.scratch_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * SCRATCH_ROWS, bias=False)

    monkeypatch.setattr(KimiMLA, "__init__", with_scratch)
    if declared:
        spec = TENSOR_SPLITS[KimiMLA]
        cut = Cut("mla_heads", ROWS, lambda c: SCRATCH_ROWS)
        monkeypatch.setitem(TENSOR_SPLITS, KimiMLA, dataclasses.replace(spec, cuts={**spec.cuts, "scratch_proj": cut}))
    acct = account_config(raw, dtype="float32")
    mla_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)]
    scratch = [p for p in acct.params if ".scratch_proj." in p.name]
    assert [p.layer for p in scratch] == mla_layers and all(p.kind == "matrix" for p in scratch)
    one = cfg.num_attention_heads * SCRATCH_ROWS * cfg.hidden_size * 4
    assert acct.total == before.total + len(mla_layers) * one
    plan = plan_tensor(acct, [Host(24)] * 3, reserve_gib=1)  # 2 MLA heads: ranks hold 1, 1 and 0 of them
    for rp in plan.ranks:
        model = shard_model(Model(cfg), rp.share, mx.distributed.init())
        attn = model.layers[mla_layers[0]].self_attn
        rows = len(rp.share.mla_heads) * SCRATCH_ROWS if declared else cfg.num_attention_heads * SCRATCH_ROWS
        assert ("scratch_proj" in attn) == bool(rp.share.mla_heads)
        if rp.share.mla_heads:
            assert attn.scratch_proj.weight.shape == (rows, cfg.hidden_size)
        assert param_bytes(model) == rp.weights, (rp.rank, declared)
