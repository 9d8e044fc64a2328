"""Pipeline parallelism (``load(..., parallel="pipeline")``): parity with one process on 2 and 3 ring ranks under
``mlx.launch``, the split choices and their errors, what each rank reads (GGUF tensors and expert rows), and per-rank
peak RSS while loading.

Launched checks (each rank loads the single-process reference itself and compares on the spot), for HF dirs, the
compressed-tensors MXFP4 K3, an mlx-lm 4-bit directory, GGUF Q8_0 files and a split GGUF set: full logits of a
plain forward, prefill + decode through the rank's cache, 32 greedy tokens with ``stream_generate``, a ragged
left-padded ``batch_generate``, a cache checkpoint restore, and a ``ChatSession`` turn + regenerate.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE, edit_checkpoint, mlx_lm_quantized
from distributed import run_ranks
from mlx.utils import tree_flatten

import kimi_mlx
from kimi_mlx.convert.gguf.reader import GGUFFile
from kimi_mlx.loading import load_gguf_model, load_model
from kimi_mlx.parallel import param_bytes
from kimi_mlx.parallel.pipeline import Stages, layer_bytes, stages_of
from kimi_mlx.parallel.accounting import account_gguf
from kimi_mlx.parallel.splits import split_proportional

KL_Q8 = KL_FIXTURE / "kimi-linear-tiny-Q8_0.gguf"
K3_Q8 = K3_FIXTURE / "kimi-k3-tiny-Q8_0.gguf"
K3_F32 = K3_FIXTURE / "kimi-k3-tiny-F32.gguf"
PARITY_TOL = 1e-6  # the bound for pipeline logits (float32); measured: 0 everywhere (see the asserts)


class FakeGroup:
    """Rank ``rank`` of ``size`` for the in-process tests (no collective is called with an explicit split)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


# --------------------------------------------------------------------------------------------- in-process checks


@pytest.mark.parametrize("kwargs, message", [
    ({"parallel": "data"}, r"parallel='data': expected None, 'pipeline' or 'tensor'"),
    ({"parallel": "pipeline", "split": "2;2"}, r"split='2;2': expected 'even' or comma-separated layer counts"),
    ({"parallel": "pipeline", "split": 2.5}, r"split=2\.5: expected None \(by memory\), 'even', or layer counts"),
    ({"parallel": "pipeline", "split": []}, r"split=\[\]: expected None"),
    ({"parallel": "pipeline", "split": "1,3"}, r"split \[1, 3\]: 2 layer counts for 1 ranks"),
    ({"parallel": "pipeline", "split": [5]}, r"split \[5\]: expected positive layer counts summing to the model's 4"),
    ({"parallel": "tensor", "split": "even"}, r"split='even': only parallel='pipeline' takes a split"),
    ({"split": "even"}, r"split='even': only parallel='pipeline' takes a split \(parallel=None\)"),
    ({"group": "G"}, r"group= was given without parallel="),
    ({"parallel": "pipeline", "adapter_path": "adapters"}, r"adapter_path='adapters' with parallel='pipeline'"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    """Bad parallel / split / group values: a ValueError naming the argument and what is accepted (before any
    weight is read; the split counts against the model's layer count on a group of 1)."""
    with pytest.raises(ValueError, match=message):
        kimi_mlx.load(str(KL_FIXTURE / "hf"), **kwargs)


def test_group_of_one_is_the_plain_model():
    """parallel= on a group of size 1 loads the plain single-process model (same class, same logits)."""
    plain, _ = kimi_mlx.load(str(K3_FIXTURE / "hf"))
    one, _ = kimi_mlx.load(str(K3_FIXTURE / "hf"), parallel="pipeline", split="even")
    assert stages_of(one) is None and type(one.language_model.model) is type(plain.language_model.model)
    ids = mx.array([list(range(20))])
    assert mx.array_equal(one(ids), plain(ids)).item()


@pytest.mark.parametrize("split, ranges", [
    ("even", [range(0, 2), range(2, 4)]),
    ("1,3", [range(0, 1), range(1, 4)]),
    ([3, 1], [range(0, 3), range(3, 4)]),
    (" 2, 2", [range(0, 2), range(2, 4)]),
])
def test_explicit_splits(split, ranges):
    """"even", a list or a "a,b" string of layer counts -> contiguous ranges in rank order."""
    costs = [10, 20, 20, 20]
    assert [Stages.split(costs, FakeGroup(r, 2), split).layers for r in range(2)] == ranges


@pytest.mark.parametrize("split, message", [
    ("even", r"split 'even': 4 layers cannot be split over 5 ranks"),
    ([1, 1, 1, 1, 0], r"expected positive layer counts"),
    ("1,1,1", r"3 layer counts for 5 ranks"),
])
def test_impossible_splits(split, message):
    with pytest.raises(ValueError, match=message):
        Stages.split([1, 1, 1, 1], FakeGroup(0, 5), split)


def _lazy(source: str):
    """A freshly built model with lazy weights (nothing evaluated), as ``load`` splits it."""
    model, _ = load_model(Path(source), lazy=True)
    return model


def _renumbered(name: str, start: int) -> str:
    return re.sub(r"(model\.layers\.)(\d+)\.", lambda m: f"{m.group(1)}{int(m.group(2)) - start}.", name)


@pytest.mark.parametrize("fixture", ["kimi_linear", "kimi_k3", "kimi_linear_tied"])
@pytest.mark.parametrize("split", [[1, 3], [2, 1, 1], [1, 1, 1, 1]], ids=["1,3", "2,1,1", "1,1,1,1"])
def test_selector_is_what_the_stage_keeps(fixture, split, kl_copy):
    """For every rank: ``select`` (what a loader reads) picks exactly the parameters the stage keeps after
    ``apply`` (layer indices counted from the stage's first layer); each layer lives on one rank; the embedding on
    rank 0 only (every rank when tied: it is the head), K3's output_attn_res on the last rank only, the final norm and
    head everywhere; and the ranks' parameter bytes add up to the model's plus the replicated parts."""
    if fixture == "kimi_linear_tied":
        edit_checkpoint(kl_copy, config=lambda c: c.__setitem__("tie_word_embeddings", True))
        source = str(kl_copy)
    else:
        source = str((KL_FIXTURE if fixture == "kimi_linear" else K3_FIXTURE) / "hf")
    full = _lazy(source)
    names = dict(tree_flatten(full.parameters()))
    tied = full.args.tie_word_embeddings
    assert tied == (fixture == "kimi_linear_tied")
    total, held = param_bytes(full), 0
    for r in range(len(split)):
        stages = Stages.split(layer_bytes(full), FakeGroup(r, len(split)), split, tied)
        selected = {_renumbered(n, stages.layers.start) for n in names if stages.select(n)}
        stage = stages.apply(_lazy(source))
        kept = set(dict(tree_flatten(stage.parameters())))
        assert kept == selected
        assert len(stage.layers) == split[r] and stages_of(stage) is stages
        assert any("embed_tokens" in n for n in kept) == (r == 0 or tied)
        assert any("output_attn_res" in n for n in kept) == (fixture == "kimi_k3" and r == len(split) - 1)
        assert any(n.endswith("model.norm.weight") for n in kept)
        assert any("lm_head" in n for n in kept) != tied
        held += param_bytes(stage)
    replicated = sum(v.nbytes for n, v in names.items() if n.endswith(("model.norm.weight", "lm_head.weight"))
                     or (tied and "embed_tokens" in n))
    assert held == total + (len(split) - 1) * replicated


def _spy_gguf(monkeypatch) -> dict:
    """Record the GGUF tensors the loader decodes: name -> bytes handed to the decoder."""
    import kimi_mlx.convert.gguf.arch as arch
    import kimi_mlx.loading as loading

    read = {}

    def spy(fn):
        def wrapped(name, qtype, data, shape, **kw):
            read[name] = read.get(name, 0) + data.nbytes
            return fn(name, qtype, data, shape, **kw)
        return wrapped

    monkeypatch.setattr(loading, "to_mlx", spy(loading.to_mlx))
    monkeypatch.setattr(arch, "to_mlx", spy(arch.to_mlx))
    return read


@pytest.mark.parametrize("path", [KL_Q8, K3_Q8])
def test_gguf_rank_decodes_only_its_tensors(path, monkeypatch):
    """A pipeline rank's GGUF load decodes only the tensors of its layers (+ norm and head; no embedding on rank 1)
    and gives the same weights as the whole load."""
    whole, _ = load_gguf_model(GGUFFile(path))
    read = _spy_gguf(monkeypatch)
    g = GGUFFile(path)
    stages = Stages.split([1, 1, 1, 1], FakeGroup(1, 2), [1, 3])
    model, _ = load_gguf_model(g, select=stages.select)
    layers = {int(n.split(".")[1]) for n in read if n.startswith("blk.")}
    assert layers == {1, 2, 3} and "token_embd.weight" not in read and "output.weight" in read
    assert sum(read.values()) < sum(i.raw().nbytes for i in g.tensors.values())
    stage = stages.apply(model)
    ref = dict(tree_flatten(whole.parameters()))
    for name, value in tree_flatten(stage.parameters()):
        assert mx.array_equal(value, ref[_renumbered(name, -1)]).item(), name


@pytest.mark.parametrize("path", [K3_F32, KL_Q8], ids=["F32", "Q8_0"])
def test_gguf_expert_rows_are_read_alone(path, monkeypatch):
    """select -> range for the stacked routed experts: only those experts' bytes reach the decoder (F32 decoded to
    float, Q8_0 kept quantized), and the parameters hold exactly those rows of the whole load's."""
    whole, _ = load_gguf_model(GGUFFile(path))
    read = _spy_gguf(monkeypatch)
    rows = range(1, 3)
    model, _ = load_gguf_model(GGUFFile(path), select=lambda p: rows if ".switch_mlp." in p else True)
    g = GGUFFile(path)
    exps = [n for n in g.tensors if n.endswith("_exps.weight")]
    assert exps and all(read[n] == g.tensors[n].raw().nbytes // 2 for n in exps)  # 2 of 4 experts
    ref = dict(tree_flatten(whole.parameters()))
    switch = [(n, v) for n, v in tree_flatten(model.parameters()) if ".switch_mlp." in n]
    assert switch
    for name, value in switch:
        assert value.shape[0] == 2 and mx.array_equal(value, ref[name][1:3]).item(), name


def test_gguf_rows_for_a_built_tensor_are_refused():
    with pytest.raises(ValueError, match=r"A_log.*built from several GGUF tensors"):
        load_gguf_model(GGUFFile(KL_Q8), select=lambda p: range(0, 1) if p.endswith("A_log") else True)


# ------------------------------------------------------------------------------------------------ launched ranks

RANK_CHECKS = r"""
import sys
import mlx.core as mx
import kimi_mlx
from kimi_mlx.chat.session import ChatSession
from kimi_mlx.generate import batch_generate, stream_generate
from kimi_mlx.parallel import param_bytes
from kimi_mlx.parallel.pipeline import stages_of

def diff(a, b):
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())

def step(m, x, cache=None):  # each forward is evaluated before the next is built, on every rank (lockstep)
    out = m(x, cache=cache)
    mx.eval(out)
    return out

def prefill_decode(m, ids):
    cache = m.make_cache()
    out = [step(m, ids[:, :-4], cache)[:, -1]]
    for t in range(4, 0, -1):
        out.append(step(m, ids[:, -t:][:, :1], cache)[:, -1])
    return mx.stack(out)

def lazy_steps(m, ids):  # forwards built first, evaluated together later, one never evaluated
    cache = m.make_cache()
    m(ids[:, :7])
    out = [m(ids[:, :-4], cache=cache)[:, -1]]
    out += [m(ids[:, -t:][:, :1], cache=cache)[:, -1] for t in range(4, 0, -1)]
    return mx.stack(out)

def restore(m, ids):
    cache = m.make_cache()
    step(m, ids[:, :-3], cache)
    cp = cache.checkpoint()
    first = step(m, ids[:, -3:], cache)
    step(m, ids[:, :5], cache)
    cache.restore(cp)
    return mx.concatenate([first, step(m, ids[:, -3:], cache)]), cache.offset

def greedy(m, tok, prompt):
    return [r.token for r in stream_generate(m, tok, prompt, 32)]

def chat(m, tok):
    s = ChatSession(m, tok, max_tokens=6)
    list(s.send("Hello there")); list(s.send("And again?")); list(s.regenerate())
    return s.tokens

results = []
for source, split, with_chat in json.loads(sys.argv[1]):
    ref, tok = kimi_mlx.load(source)
    par, _ = kimi_mlx.load(source, parallel="pipeline", split=split)
    prompt = [(7 * i + 3) % 500 for i in range(37)]
    ids = mx.array([prompt])
    ragged = [prompt[:5], prompt[3:20], prompt[10:19]]
    (bt_ref, lp_ref), (bt_par, lp_par) = batch_generate(ref, ragged, 6), batch_generate(par, ragged, 6)
    (r_ref, off_ref), (r_par, off_par) = restore(ref, ids), restore(par, ids)
    g_ref, g_par = greedy(ref, tok, prompt), greedy(par, tok, prompt)
    stages, logits = stages_of(par), step(par, ids)
    results.append({
        "source": source, "layers": [stages.layers.start, stages.layers.stop], "param_bytes": param_bytes(par),
        "logits": diff(ref(ids), logits), "shape": list(logits.shape),
        "prefill_decode": diff(prefill_decode(ref, ids), prefill_decode(par, ids)),
        "lazy": diff(lazy_steps(ref, ids), lazy_steps(par, ids)),
        "greedy": [g_ref == g_par, len(g_par)],
        "batch": [bt_ref == bt_par, diff(mx.stack(lp_ref), mx.stack(lp_par))],
        "restore": [diff(r_ref, r_par), diff(r_par[0], r_par[1]), off_ref == off_par],
        "chat": chat(ref, tok) == chat(par, tok) if with_chat else True,
    })
report(results)
"""


def _check_ranks(results: list, n: int, expected_counts: dict) -> None:
    """Every rank, every source: bit-exact parity (within PARITY_TOL), same tokens, a contiguous cover of the
    layers with the expected counts (where given)."""
    for source_index in range(len(results[0])):
        per_rank = [results[r][source_index] for r in range(n)]
        source = per_rank[0]["source"]
        spans = [tuple(x["layers"]) for x in per_rank]
        assert spans[0][0] == 0 and spans[-1][1] == 4 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
        if source in expected_counts:
            assert [b - a for a, b in spans] == expected_counts[source], (source, spans)
        for r, x in enumerate(per_rank):
            where = f"{source} rank {r}"
            assert x["shape"] == [1, 37, 512], where
            assert max(x["logits"], x["prefill_decode"], x["lazy"]) <= PARITY_TOL, f"{where}: {x}"
            assert x["greedy"][0] and x["batch"][0] and x["restore"][2] and x["chat"], f"{where}: {x}"
            assert x["batch"][1] <= PARITY_TOL and x["restore"][0] <= PARITY_TOL, f"{where}: {x}"
            assert x["restore"][1] == 0, (where, x)  # the restored cache replays the same step exactly
        print("MEASURED", source, n, "ranks: max |logits diff|",
              max(max(x["logits"], x["prefill_decode"], x["lazy"], x["batch"][1], x["restore"][0]) for x in per_rank),
              "layers", spans, "param bytes", [x["param_bytes"] for x in per_rank])


@pytest.fixture(scope="module")
def built_sources(tmp_path_factory):
    """Sources made from the fixtures: the MXFP4 K3 (compressed-tensors experts), an mlx-lm 4-bit Kimi Linear
    directory, a split K3 GGUF set and a Kimi Linear with tied embeddings."""
    from test_gguf_load import _rewrite
    from test_k3 import _experts_to_mxfp4, _mxfp4_from_mlx

    from conftest import _writable_copy

    root = tmp_path_factory.mktemp("pipeline_sources")
    mxfp4 = _writable_copy(K3_FIXTURE / "hf", root / "k3_mxfp4")
    _experts_to_mxfp4(mxfp4, _mxfp4_from_mlx, np.random.default_rng(4))
    q4 = root / "kl_mlx_q4"
    mlx_lm_quantized(KL_FIXTURE / "hf", q4)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (q4 / name).write_bytes((KL_FIXTURE / "hf" / name).read_bytes())
    _rewrite(K3_F32, root / "k3.gguf", split_max_tensors=40)
    tied = _writable_copy(KL_FIXTURE / "hf", root / "kl_tied")
    edit_checkpoint(tied, config=lambda c: c.__setitem__("tie_word_embeddings", True))
    return {"mxfp4": str(mxfp4), "q4": str(q4), "split_gguf": str(sorted(root.glob("k3-*-of-*.gguf"))[0]),
            "tied": str(tied)}


def _by_memory(costs: list, n: int) -> list:
    """Layer counts of the default split on ranks of equal memory (all ranks on this machine)."""
    return [len(r) for r in split_proportional(costs, [1] * n)]


def test_two_ranks_match_one_process(built_sources, tmp_path):
    """2 ranks: the default split (by memory) and explicit ones (1,3 / 3,1) over an HF dir, the MXFP4 K3, an mlx-lm
    4-bit dir and a GGUF Q8_0: every rank's logits, cached steps, greedy tokens, ragged batch, checkpoint restore
    and chat turns equal one process's."""
    jobs = [
        (str(KL_FIXTURE / "hf"), None, False),
        (str(K3_FIXTURE / "hf"), "1,3", True),
        (built_sources["mxfp4"], [3, 1], False),
        (built_sources["q4"], [3, 1], False),
        (str(KL_Q8), None, False),
    ]
    results = run_ranks(RANK_CHECKS, 2, tmp_path, args=[json.dumps(jobs)], timeout=120)
    _check_ranks(results, 2, {
        jobs[0][0]: _by_memory(layer_bytes(_lazy(jobs[0][0])), 2), jobs[1][0]: [1, 3], jobs[2][0]: [3, 1],
        jobs[3][0]: [3, 1], jobs[4][0]: _by_memory(account_gguf(KL_Q8).layer_bytes(), 2),
    })


def test_three_ranks_uneven(built_sources, tmp_path):
    """3 ranks over 4 layers (uneven): K3 split 1,2,1 (a stage holding an AttnRes block start), a split K3 GGUF set
    by memory, and Kimi Linear with tied embeddings (the head is the embedding on every rank) split "even" (2,1,1)."""
    jobs = [
        (str(K3_FIXTURE / "hf"), [1, 2, 1], True),
        (built_sources["split_gguf"], None, False),
        (built_sources["tied"], "even", False),
    ]
    results = run_ranks(RANK_CHECKS, 3, tmp_path, args=[json.dumps(jobs)], timeout=120)
    split_set = account_gguf(built_sources["split_gguf"]).layer_bytes()  # what `kimi-mlx plan` counts
    _check_ranks(results, 3, {jobs[0][0]: [1, 2, 1], jobs[1][0]: _by_memory(split_set, 3), jobs[2][0]: [2, 1, 1]})


# --------------------------------------------------------------------------------------------- peak RSS per rank

RSS_REPORT = r"""
import resource
import kimi_mlx
import kimi_mlx.loading  # the code (and mlx-lm, which kimi_mlx imports on first use) is not the load's memory
from kimi_mlx.parallel import param_bytes
def peak():  # ru_maxrss: KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
before = peak()
model, _ = kimi_mlx.load(sys.argv[1], **json.loads(sys.argv[2]))
report({"load_peak": peak() - before, "param_bytes": param_bytes(model)})
"""


@pytest.fixture(scope="module")
def big_mlx_dir(tmp_path_factory) -> str:
    """A ~300 MB MLX directory (4/8-bit quantized Kimi Linear, 8 layers): ``kimi-mlx convert`` of the mixed-quant
    GGUF that bench_gguf_load writes (Q4_K experts, Q8_0 matrices)."""
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_gguf_load import write_gguf

    root = tmp_path_factory.mktemp("pipeline_big")
    gguf = root / "big.gguf"
    write_gguf(gguf, argparse.Namespace(layers=8, hidden=1024, heads=8, experts=32, expert_ff=512))
    kimi_mlx_cli = Path(sys.executable).parent / "kimi-mlx"
    subprocess.run([str(kimi_mlx_cli), "convert", "--model", str(gguf), "--out", str(root / "mlx"), "--quiet"],
                   check=True, capture_output=True)
    return str(root / "mlx")


def test_rank_load_peak_rss(big_mlx_dir, tmp_path):
    """Each of 2 ranks reads only its share of the lazily loaded safetensors: its peak-RSS growth while loading
    tracks its own parameter bytes and stays well under the whole model's (the ranks' bytes together: the model plus
    the replicated norm and head). (GGUF ranks never decode other ranks' tensors: test_gguf_rank_decodes_only_its_
    tensors.)"""
    ranks = run_ranks(RSS_REPORT, 2, tmp_path, args=[big_mlx_dir, json.dumps({"parallel": "pipeline"})])
    print("MEASURED peak RSS growth while loading", ranks)
    whole = sum(x["param_bytes"] for x in ranks)
    for r, x in enumerate(ranks):
        assert x["param_bytes"] < 0.6 * whole, (r, x)
        assert x["load_peak"] < 0.7 * whole, (r, x, whole)
        assert x["load_peak"] < 1.25 * x["param_bytes"] + 64e6, (r, x)
