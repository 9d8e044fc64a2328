"""Tensor + expert parallel (kimi_mlx/parallel/shard.py): ring ranks on localhost against one float32 process, and
in-process checks of what each rank keeps and of the all_sums per forward."""

import types

import mlx.core as mx
import numpy as np
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE
from distributed import run_ranks
from mlx.utils import tree_flatten

from kimi_mlx.loading import load_model
from kimi_mlx.models.kimi_k3 import K3Model
from kimi_mlx.parallel import param_bytes
from kimi_mlx.parallel.splits import tensor_shares
from kimi_mlx.parallel.shard import (
    ExpertParallelMoE,
    IdleKDA,
    IdleMLA,
    IdleMLP,
    shard_model,
    tensor_parallel,
    tensor_select,
    width_unit,
)

Q4 = {"bits": 4, "group_size": 32}

# Each rank loads every case (fixture, variant, decode length), computes the single-process reference itself, shards
# the same model in place and repeats: a full forward of 40 ids, prefill + 4 greedy tokens through the cache after a
# checkpoint and 4 again after restoring it, and greedy tokens for a ragged left-padded batch of 3 (batch_generate);
# each rank's MoE runs only its local (token, slot) pairs, prefill and decode alike.
RANK_SCRIPT = """
import hashlib
from pathlib import Path
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from kimi_mlx.cache import cache_from_snapshot
from kimi_mlx.generate import batch_generate
from kimi_mlx.loading import load_model
from kimi_mlx.parallel import param_bytes
from kimi_mlx.parallel.shard import tensor_parallel

fixtures, cases = Path(sys.argv[1]), sys.argv[2].split(",")
PROMPT = [(7 * i + 3) % 380 for i in range(40)]
BATCH = [PROMPT[:33], PROMPT[5:12], PROMPT]


def build(name, variant):
    quantize = {"bits": 4, "group_size": 32} if variant == "q4" else None
    model, cfg = load_model(fixtures / name / "hf", dtype=mx.float32, quantize=quantize)
    if variant == "mxfp4":
        experts = lambda p, m: ".switch_mlp." in p and hasattr(m, "to_quantized")
        nn.quantize(model, group_size=32, bits=4, mode="mxfp4", class_predicate=experts)
    if variant == "fused":  # KDA q/k/v fused into one qkv_proj
        weights = dict(tree_flatten(model.parameters()))
        for i, layer in enumerate(model.layers):
            if layer.is_linear:
                p = f"model.layers.{i}.self_attn."
                weights[p + "qkv_proj.weight"] = mx.concatenate([weights.pop(p + n + "_proj.weight") for n in "qkv"])
        model = type(model)(cfg, fused_qkv=True)
        model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def greedy(model, cache, logits, n):
    tokens, steps = [], []
    for _ in range(n):
        steps.append(logits)
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1]
    return tokens, mx.concatenate(steps)


def run(model, n_tokens):
    ids = mx.array([PROMPT])
    out = {"full": model(ids)[0]}
    cache = model.make_cache()
    first = model(ids, cache=cache)[:, -1]
    cp = cache.checkpoint()
    out["tokens"], out["decode"] = greedy(model, cache, first, 4)
    cache.restore(cp)
    out["restored_tokens"], out["restored"] = greedy(model, cache, first, 4)
    out["batch_tokens"], steps = batch_generate(model, BATCH, n_tokens)
    out["batch"] = mx.stack(steps)
    marked = model.make_cache()  # a snapshot inside one call (the server's prefill), resumed for the rest
    marked.mark([13])
    model(ids, cache=marked)
    out["marked"] = model(ids[:, 13:], cache=cache_from_snapshot(marked.snapshot(at=13)))[:, -1]
    return out


results = {}
for case in cases:
    name, variant, n_tokens = case.split(":")
    model = build(name, variant)
    ref = run(model, int(n_tokens))
    full_bytes = param_bytes(model)
    tensor_parallel(model, group)
    mx.eval(model.parameters())
    got = run(model, int(n_tokens))
    diff = lambda key: float(mx.abs(got[key] - ref[key]).max())
    logits = b"".join(np.array(got[k]).tobytes() for k in ("full", "decode", "batch"))
    results[case] = {
        "max_diff": {k: diff(k) for k in ("full", "decode", "restored", "batch", "marked")},
        "restored_vs_first": float(mx.abs(got["restored"] - got["decode"]).max()),
        "tokens": got["tokens"], "ref_tokens": ref["tokens"], "restored_tokens": got["restored_tokens"],
        "batch_tokens": got["batch_tokens"], "ref_batch_tokens": ref["batch_tokens"],
        "logits_sha1": hashlib.sha1(logits).hexdigest(),
        "bytes": param_bytes(model), "full_bytes": full_bytes,
    }
report(results)
"""

# Tensor-parallel logits vs one float32 process: max |logit diff| over the full forward, the cached prefill + decode,
# the restored decode and the ragged batch (max |logit| ~4); only the order in which partial sums add up differs.
# Measured (same on every rank):
#   Kimi Linear  2 ranks: float 5.2e-6, fused 5.2e-6, q4 4.2e-6   3 ranks: float 4.3e-6, q4 3.6e-6
#   Kimi-K3      2 ranks: float 1.9e-5, q4 1.8e-5, mxfp4 2.1e-5   3 ranks: float 2.6e-5, q4 1.9e-5
# (K3's tiny model amplifies float32 rounding: its own prefill vs decode differ by 1.4e-5, test_model_parity.py.)
TOL = 1e-4

# One launch per rank count, "fixture:variant:batch tokens". With 3 ranks on 2 cores an all_sum costs ~15 ms (the
# ring backend's busy-polling threads share cores), so there the quantized cases decode 8 batch tokens, not 32.
CASES = {
    2: "kimi_linear:float:32,kimi_linear:fused:32,kimi_linear:q4:32,kimi_k3:float:32,kimi_k3:q4:32,kimi_k3:mxfp4:32",
    # rank 2 holds no KDA / MLA heads; 4-bit (widths in units of 32): no shared-expert columns on ranks 1-2 (Kimi
    # Linear, 32 wide) or 2 (K3, 64 wide)
    3: "kimi_linear:float:32,kimi_linear:q4:8,kimi_k3:float:32,kimi_k3:q4:8",
}


@pytest.mark.parametrize("n", [2, 3])
def test_tensor_parallel_matches_single_process(tmp_path, n):
    """Every rank, every case: logits within TOL of one process (full forward, prefill + decode through the cache,
    restored checkpoint, ragged batch, a prefill resumed from a snapshot marked inside one call), the same greedy
    tokens, bit-identical logits on all ranks, and less than the whole model's parameter bytes."""
    ranks = run_ranks(RANK_SCRIPT, n, tmp_path, args=(KL_FIXTURE.parent, CASES[n]))
    for case in CASES[n].split(","):
        per_rank = [r[case] for r in ranks]
        print(case, n, [max(r["max_diff"].values()) for r in per_rank], [r["bytes"] for r in per_rank])
        for rank, r in enumerate(per_rank):
            where = f"{case}, rank {rank} of {n}"
            assert max(r["max_diff"].values()) <= TOL, f"{where}: {r['max_diff']}"
            assert r["tokens"] == r["ref_tokens"], where
            assert r["restored_tokens"] == r["tokens"] and r["restored_vs_first"] == 0, where
            assert r["batch_tokens"] == r["ref_batch_tokens"], where
            assert r["bytes"] < r["full_bytes"], where
        assert len({r["logits_sha1"] for r in per_rank}) == 1, f"{case}: ranks computed different logits"


LOAD_SCRIPT = """
import numpy as np
from kimi_mlx import load, stream_generate

path = sys.argv[1]
ref, tok = load(path, dtype=mx.float32)
par, _ = load(path, dtype=mx.float32, parallel="tensor")
ids = mx.array([[(7 * i + 3) % 380 for i in range(40)]])
diff = mx.abs(par(ids) - ref(ids)).max().item()
prompt = ids[0].tolist()
tokens = [r.token for r in stream_generate(par, tok, prompt, 32)]
ref_tokens = [r.token for r in stream_generate(ref, tok, prompt, 32)]
report({"diff": diff, "tokens": tokens, "ref_tokens": ref_tokens})
"""


@pytest.mark.parametrize("gguf", ["kimi-linear-tiny-Q8_0.gguf", "kimi-k3-tiny-Q8_0.gguf"])
def test_load_tensor_parallel_gguf(tmp_path, gguf):
    """``load(FILE.gguf, parallel="tensor")`` on 2 ranks (each decodes only its experts' rows): logits within TOL of
    one process, 32 greedy tokens identical (stream_generate)."""
    fixture = KL_FIXTURE if gguf.startswith("kimi-linear") else K3_FIXTURE
    for r in run_ranks(LOAD_SCRIPT, 2, tmp_path, args=(fixture / gguf,)):
        assert r["diff"] <= TOL, r["diff"]
        assert r["tokens"] == r["ref_tokens"]


# --- in process: what each rank keeps --------------------------------------------------------------------------


def _load(fixture, quantize=None):
    return load_model(fixture / "hf", dtype=mx.float32, quantize=quantize)


def _shards(fixture, n, quantize=None):
    """One freshly loaded model per rank of n, each cut to its share on the single-process group (all_sum = id)."""
    _, cfg = _load(fixture, quantize)
    shares = tensor_shares(cfg, n, quantize["group_size"] if quantize else 1)
    return [shard_model(_load(fixture, quantize)[0], share, mx.distributed.init()) for share in shares]


def _params(model):
    return {k: v for k, v in tree_flatten(model.parameters())}


def test_kimi_linear_shapes_per_rank_three_ranks():
    """2 heads, 4 experts, widths 256 / 32 over 3 ranks: heads 1/1/0, experts 2/1/1, widths 86/85/85 and 11/11/10;
    rank 2 holds no heads, its KDA / MLA blocks are idle (MLA keeps the latent projection for its cache)."""
    full = _params(_load(KL_FIXTURE)[0])
    ranks = [_params(m) for m in _shards(KL_FIXTURE, 3)]
    kda, mla, moe = "model.layers.0.self_attn", "model.layers.2.self_attn", "model.layers.1.mlp"
    for r, (lo, hi) in enumerate([(0, 1), (1, 2)]):
        p = ranks[r]
        assert p[f"{kda}.q_proj.weight"].shape == (64, 256)
        assert p[f"{kda}.qkv_conv.weight"].shape == (192, 4)
        for seg in range(3):  # the head's rows of q, k and v
            np.testing.assert_array_equal(p[f"{kda}.qkv_conv.weight"][seg * 64 : (seg + 1) * 64],
                                          full[f"{kda}.qkv_conv.weight"][seg * 128 + lo * 64 : seg * 128 + hi * 64])
        assert p[f"{kda}.b_proj.weight"].shape == (1, 256) and p[f"{kda}.A_log"].shape == (1,)
        assert p[f"{kda}.dt_bias"].shape == (64,) and p[f"{kda}.g_b_proj.weight"].shape == (64, 64)
        assert p[f"{kda}.f_a_proj.weight"].shape == (64, 256) and p[f"{kda}.o_norm.weight"].shape == (64,)
        np.testing.assert_array_equal(p[f"{kda}.o_proj.weight"], full[f"{kda}.o_proj.weight"][:, lo * 64 : hi * 64])
        assert p[f"{mla}.q_proj.weight"].shape == (96, 256) and p[f"{mla}.embed_q.weight"].shape == (1, 128, 64)
        assert p[f"{mla}.kv_a_proj_with_mqa.weight"].shape == (160, 256)  # latent stays whole
        assert p[f"{mla}.o_proj.weight"].shape == (256, 64)
    assert [p[f"{moe}.switch_mlp.gate_proj.weight"].shape[0] for p in ranks] == [2, 1, 1]
    np.testing.assert_array_equal(ranks[1][f"{moe}.switch_mlp.down_proj.weight"][0],
                                  full[f"{moe}.switch_mlp.down_proj.weight"][2])
    assert [p[f"{moe}.gate.weight"].shape for p in ranks] == [(4, 256)] * 3  # router whole
    assert [p["model.layers.0.mlp.gate_proj.weight"].shape[0] for p in ranks] == [86, 85, 85]
    assert [p[f"{moe}.shared_experts.down_proj.weight"].shape[1] for p in ranks] == [11, 11, 10]
    idle = _shards(KL_FIXTURE, 3)[2]
    assert type(idle.layers[0].self_attn) is IdleKDA and type(idle.layers[2].self_attn) is IdleMLA
    assert type(idle.layers[1].mlp) is ExpertParallelMoE
    assert not any(k.startswith(kda) for k in ranks[2])


def test_quantized_cuts_on_group_boundaries():
    """4-bit (group 32): the output projections keep whole groups of input columns (packed words and scales cut
    alike), widths split in units of 32, so the shared experts' 32 columns go to rank 0 and rank 1 has none."""
    assert width_unit(_load(KL_FIXTURE, Q4)[0]) == 32 and width_unit(_load(KL_FIXTURE)[0]) == 1
    ranks = [_params(m) for m in _shards(KL_FIXTURE, 2, Q4)]
    o = "model.layers.0.self_attn.o_proj"
    assert ranks[0][f"{o}.weight"].shape == (256, 8) and ranks[0][f"{o}.scales"].shape == (256, 2)
    assert ranks[0][f"{o}.weight"].dtype == mx.uint32
    assert [p["model.layers.0.mlp.down_proj.scales"].shape for p in ranks] == [(256, 4)] * 2
    assert ranks[0]["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (256, 4)
    assert not any(".shared_experts." in k for k in ranks[1])
    assert ranks[1]["model.layers.1.mlp.switch_mlp.up_proj.scales"].shape == (2, 32, 8)


def test_fused_qkv_keeps_each_segments_heads():
    """A fused qkv_proj [3 * 128, 256] keeps rows h*64:(h+1)*64 of each of its q, k and v segments."""
    model, cfg = _load(KL_FIXTURE)
    w = dict(tree_flatten(model.parameters()))
    for i, layer in enumerate(model.layers):
        if layer.is_linear:
            p = f"model.layers.{i}.self_attn."
            w[p + "qkv_proj.weight"] = mx.concatenate([w.pop(p + n + "_proj.weight") for n in "qkv"])
    fused = type(model)(cfg, fused_qkv=True)
    fused.load_weights(list(w.items()))
    shard_model(fused, tensor_shares(cfg, 2)[1], mx.distributed.init())
    full = w["model.layers.0.self_attn.qkv_proj.weight"]
    kept = fused.layers[0].self_attn.qkv_proj.weight
    np.testing.assert_array_equal(kept, mx.concatenate([full[s * 128 + 64 : s * 128 + 128] for s in range(3)]))


@pytest.mark.parametrize(
    "fixture, n, quantize",
    [(KL_FIXTURE, 3, None), (K3_FIXTURE, 3, Q4), (KL_FIXTURE, 9, Q4)],
    ids=["kimi_linear-3", "kimi_k3-q4-3", "kimi_linear-q4-9"],
)
def test_one_all_sum_per_block(monkeypatch, fixture, n, quantize):
    """Prefill and decode (each rank's local expert pairs only): exactly one all_sum per attention block and one per
    MLP / MoE block on every rank, including ranks holding no heads, no shared-expert columns, and (9 ranks of a
    model with 8 units of dense width and 4 experts) nothing at all; the caches stay in step through a checkpoint."""
    calls = []
    real = mx.distributed.all_sum
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, **kw: (calls.append(x.shape), real(x, **kw))[1])
    models = _shards(fixture, n, quantize)
    if n == 9:
        assert type(models[8].layers[0].mlp) is IdleMLP and not models[8].layers[1].mlp.experts
    for model in models:
        cache = model.make_cache()
        for ids in ([list(range(40))], [[5]]):
            calls.clear()
            mx.eval(model(mx.array(ids), cache=cache))
            assert len(calls) == 2 * len(model.layers)
        cp = cache.checkpoint()
        model(mx.array([[6]]), cache=cache)
        cache.restore(cp)
        assert [c.offset for c in cache] == [41] * len(model.layers)


def test_tensor_select_and_pre_cut_expert_stacks():
    """tensor_select gives this rank's expert range for stacked routed-expert weights/scales/biases and True for
    everything else; stacks that arrive holding only those experts (a GGUF read with it) are kept, not cut again."""
    _, cfg = _load(K3_FIXTURE)
    group = types.SimpleNamespace(size=lambda: 3, rank=lambda: 1)
    select = tensor_select(cfg, group)
    prefix = "language_model.model.layers.1.mlp."
    for name in ("switch_mlp.gate_proj.weight", "switch_mlp.up_proj.scales", "switch_mlp.down_proj.biases"):
        assert select(prefix + name) == range(2, 3)
    for name in ("shared_experts.down_proj.weight", "gate.weight", "routed_expert_down_proj.weight"):
        assert select(prefix + name) is True
    assert select("language_model.model.layers.0.self_attn.q_proj.weight") is True

    share = tensor_shares(cfg, 3)[1]
    cut_here = shard_model(_load(K3_FIXTURE)[0], share, mx.distributed.init())
    pre_cut, _ = _load(K3_FIXTURE)
    for i, layer in enumerate(pre_cut.layers):
        if "switch_mlp" in layer.mlp:
            for p in ("gate_proj", "up_proj", "down_proj"):
                rows = select(f"language_model.model.layers.{i}.mlp.switch_mlp.{p}.weight")
                stack = layer.mlp.switch_mlp[p]
                stack.weight = stack.weight[rows.start : rows.stop]
    shard_model(pre_cut, share, mx.distributed.init())
    a, b = _params(cut_here), _params(pre_cut)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)


def test_lazy_weights_are_cut_before_they_are_read(tmp_path):
    """Sharding a model whose weights are still lazy (mx.load) and then evaluating holds only this rank's share:
    active memory after eval ~ param_bytes of the shard, far below the whole model."""
    model, cfg = _load(K3_FIXTURE)
    full = param_bytes(model)
    mx.save_safetensors(str(tmp_path / "w.safetensors"), dict(tree_flatten(model.parameters())))
    del model
    mx.clear_cache()
    base = mx.get_active_memory()
    lazy = K3Model(cfg)
    lazy.load_weights(str(tmp_path / "w.safetensors"))
    shard_model(lazy, tensor_shares(cfg, 3)[2], mx.distributed.init())
    mx.eval(lazy.parameters())
    mx.clear_cache()
    held = mx.get_active_memory() - base
    kept = param_bytes(lazy)
    print("lazy shard: held", held, "kept", kept, "whole", full)
    assert held <= kept * 1.05 + 65536 and kept < 0.5 * full


def test_single_process_group_leaves_model_unchanged():
    model, _ = _load(KL_FIXTURE)
    before = _params(model)
    assert tensor_parallel(model, mx.distributed.init()) is model
    assert _params(model).keys() == before.keys() and type(model.layers[0].self_attn).__name__ == "KimiDeltaAttention"


def test_errors_name_the_layer_and_shape():
    """A quantized o_proj whose group (128) straddles the head boundary (64), and a model cut twice."""
    model, cfg = _load(KL_FIXTURE, {"bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj: columns 64:128 do not fall on quantization "
                                         r"group boundaries \(group size 128\)"):
        shard_model(model, tensor_shares(cfg, 2)[1], mx.distributed.init())
    model, cfg = _load(KL_FIXTURE)
    share = tensor_shares(cfg, 2)[0]
    shard_model(model, share, mx.distributed.init())
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.weight: expected 128 rows on axis 0, got "
                                         r"shape \(64, 256\)"):
        shard_model(model, share, mx.distributed.init())


def test_parameter_bytes_per_rank():
    """Per-rank bytes: the replicated part (embeddings, head, norms, routers, latent projections) on every rank plus
    a disjoint share of the rest, so 2 ranks hold more than half each and together more than the whole."""
    whole = param_bytes(_load(K3_FIXTURE)[0])
    per_rank = [param_bytes(m) for m in _shards(K3_FIXTURE, 2)]
    print("K3 parameter bytes per rank of 2:", per_rank, "whole", whole)
    assert all(whole / 2 < b < whole for b in per_rank) and sum(per_rank) > whole


@pytest.mark.parametrize("fixture, n", [(KL_FIXTURE, 3), (K3_FIXTURE, 2)], ids=["kimi_linear-3", "kimi_k3-2"])
def test_expert_parallel_decode_runs_only_local_pairs(monkeypatch, fixture, n):
    """Decode of a batch of 6 (one token each, 12 (token, slot) pairs): each rank's experts compute exactly its local
    pairs' rows (every pair on exactly one rank; no other rank's slot run on its expert 0), and the ranks' routed
    sums add up to the single-process one (mlx-lm's SwitchGLU over all slots). Inside ``mx.compile`` (no host reads)
    every slot runs and other ranks' slots are zeroed: the same sum."""
    import kimi_mlx.parallel.shard as shard

    full = _load(fixture)[0].layers[1].mlp
    blocks = [m.layers[1].mlp for m in _shards(fixture, n)]
    x = mx.random.normal((6, 1, full.cfg.hidden_size), key=mx.random.key(3))  # [B, 1, hidden]
    z = full.routed_expert_down_proj(x) if "routed_expert_down_proj" in full else x  # [B, 1, width]
    inds, weights = full.routing(x)  # [B, 1, k] each (the router is replicated)
    ref = (full.switch_mlp(z, inds) * weights[..., None]).sum(axis=-2)  # [B, 1, width]
    pairs = np.array(inds).reshape(-1)
    seen = []  # per switch_glu call: its index array (traced inside mx.compile: only its size is read then)
    real = shard.switch_glu
    monkeypatch.setattr(shard, "switch_glu", lambda s, h, i, *a: (seen.append(i), real(s, h, i, *a))[1])

    total, foreign = 0, 0
    for block in blocks:
        mine = sorted(int(e) for e in pairs if e in block.experts)
        foreign += len(pairs) - len(mine)
        seen.clear()
        y = block._local_experts(z, inds, weights)
        mx.eval(y)
        got = sorted(int(e) + block.experts.start for i in seen for e in np.array(i).reshape(-1))
        assert got == mine, f"experts {block.experts}: computed rows for experts {got}, local pairs {mine}"
        total = total + y
        seen.clear()
        y_compiled = mx.compile(block._local_experts)(z, inds, weights)
        mx.eval(y_compiled)
        assert sum(i.size for i in seen) == len(pairs)  # the masked path: every slot
        np.testing.assert_allclose(y_compiled, y, atol=1e-5)
    assert foreign > 0  # some rank had other ranks' slots, which must not run on its experts
    np.testing.assert_allclose(total, ref, atol=1e-5, rtol=1e-5)
