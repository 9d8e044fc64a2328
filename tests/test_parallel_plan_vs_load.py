"""`kimi-mlx plan` predicts what `load(parallel=...)` makes: the split of the fixtures' tiny configs and each rank's
parameter bytes (the issue asks for 5%; both come from one accounting, so they are equal). Sources: the HF
checkpoints (float32, quantized on load to 4 bits) and GGUFs with IQ experts and a Q6_K head kept as GGML blocks
(``test_gguf_native``'s types; the planner counts the file's block bytes, split in units of the block size)."""

import json

import mlx.core as mx
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE
from test_gguf_native import NATIVE_TYPES, _wide_pair

from kimi_mlx.convert.gguf.reader import GGUFFile
from kimi_mlx.loading import load_gguf_model, load_model
from kimi_mlx.parallel import param_bytes
from kimi_mlx.parallel.pipeline import Stages, layer_bytes
from kimi_mlx.parallel.accounting import account_config, account_gguf
from kimi_mlx.parallel.cost import Host, plan_pipeline, plan_tensor
from kimi_mlx.parallel.splits import pipeline_ranges
from kimi_mlx.parallel.shard import shard_model

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
