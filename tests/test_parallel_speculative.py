"""Speculative decoding on 2 ``ring`` ranks (``mlx.launch``, each rank pinned to a core), ``--parallel pipeline`` and
``tensor``: every rank runs the same loop in lockstep and takes rank 0's drafts and outcomes (``model.rank0_ids``).

One launch per mode runs everything on both ranks and reports it per rank:

- ``kimi-mlx generate --draft lookup|MODEL --parallel MODE`` (the draft model whole on every rank: the target's own
  checkpoint, so every draft is accepted): rank 0's greedy text equals one process's plain text;
- drafts that differ between the ranks (rank 0: the target's own greedy continuation with every third draft wrong,
  so that passes accept some drafts and roll back others; rank 1: every draft wrong): both ranks give plain
  decoding's tokens and the same counts (rank 0's drafts were verified everywhere), on the Kimi Linear fixture with
  a float and an 8-bit latent cache and on the K3 fixture with both;
- sampled speculation with a different seed on each rank: both ranks give the same tokens (rank 0's draws);
- a ``ChatSession`` with prompt lookup, two turns: both ranks give one process's plain session's replies.

The references are one process's plain decoding (``stream_generate`` without ``draft``), computed here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from conftest import K3_FIXTURE, KL_FIXTURE
from distributed import run_ranks

MODEL = str(KL_FIXTURE / "hf")
K3_MODEL = str(K3_FIXTURE / "hf")
RANKED = {"kl": (MODEL, None), "kl8": (MODEL, 8), "k3": (K3_MODEL, None), "k38": (K3_MODEL, 8)}
KIMI = shutil.which("kimi-mlx", path=os.path.dirname(sys.executable)) or "kimi-mlx"
PROMPT = "one two three four five six one two three four five six one two"
N = 24
TURNS = ["one two three four one two three four", "again: one two three four"]

SCRIPT = """
import contextlib, io
from kimi_mlx import load
from kimi_mlx.cli import main
from kimi_mlx.generate import stream_generate

mode, ref_path = sys.argv[1], sys.argv[2]
ref = json.load(open(ref_path))
out = {}

for name, draft in (("cli", "lookup"), ("cli_model", ref["model"])):
    buf = io.StringIO()  # rank 0 prints the completion; the other ranks print nothing
    with contextlib.redirect_stdout(buf):
        rc = main.main(["generate", "--model", ref["model"], "--prompt", ref["prompt"], "--max-tokens",
                        str(ref["n"]), "--json", "--draft", draft, "--num-draft-tokens", "4", "--parallel", mode])
    out[name] = {"rc": rc, "stdout": buf.getvalue()}



class RankDrafter:
    # rank 0: the plain continuation with every third draft wrong; other ranks: every draft wrong
    def propose(self, history, k):
        at = len(history) - len(prompt)
        true = plain[at : at + k]
        if group.rank() != 0:
            return [(t + 1) % vocab for t in true]
        return [(t + 1) % vocab if i % 3 == 2 else t for i, t in enumerate(true)]

    def observe(self, accepted, proposed):
        pass


loaded = {}
for name, (path, kv_bits, prompt, plain, vocab) in ref["ranked"].items():
    if path not in loaded:
        loaded[path] = load(path, parallel=mode)
    model, tok = loaded[path]
    rs = list(stream_generate(model, tok, prompt, ref["n"], draft=RankDrafter(), num_draft_tokens=4, kv_bits=kv_bits))
    out["ranked_" + name] = {"tokens": [r.token for r in rs], "drafted": rs[-1].drafted_tokens,
                             "accepted": rs[-1].accepted_tokens}
model, tok = loaded[ref["model"]]
prompt = ref["prompt_ids"]

from kimi_mlx.chat.session import ChatSession

chat = ChatSession(model, tok, max_tokens=ref["n"], draft="lookup", num_draft_tokens=4)
out["chat"] = []
for text in ref["turns"]:
    list(chat.send(text))
    out["chat"].append(chat.last.tokens)

mx.random.seed(100 + group.rank())  # each rank its own draws: rank 0's are taken
rs = list(stream_generate(model, tok, prompt, ref["n"], draft="lookup", num_draft_tokens=4, temp=1.0))
out["sampled"] = [r.token for r in rs]
report(out)
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process's plain greedy decoding of PROMPT (tokens and text) and plain chat replies to TURNS, for the ranks
    to match."""
    from kimi_mlx import load
    from kimi_mlx.generate import stream_generate

    model, tok = load(MODEL)
    ids = tok.encode(PROMPT)
    rs = list(stream_generate(model, tok, ids, N + 8))
    ref = {"model": MODEL, "prompt": PROMPT, "prompt_ids": ids, "n": N,
           "plain": [r.token for r in rs], "text": "".join(r.text for r in rs[:N]), "ranked": {}}
    for name, (path, kv_bits) in RANKED.items():  # plain greedy tokens of each model / latent cache, for the ranks
        m, t = (model, tok) if path == MODEL else load(path)
        p = t.encode(PROMPT)
        plain = [r.token for r in stream_generate(m, t, p, N + 8, kv_bits=kv_bits)]
        ref["ranked"][name] = (path, kv_bits, p, plain, m.args.vocab_size)
    from kimi_mlx.chat.session import ChatSession

    chat = ChatSession(model, tok, max_tokens=N)
    ref["turns"], ref["chat"] = TURNS, []
    for text in TURNS:
        list(chat.send(text))
        ref["chat"].append(chat.last.tokens)
    path = tmp_path_factory.mktemp("ref") / "ref.json"
    path.write_text(json.dumps(ref))
    # the CLI's plain text (what --draft must reproduce)
    plain_cli = "".join(r.text for r in stream_generate(model, tok, ids, N))
    return ref, path, plain_cli


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_speculation_on_two_ranks(tmp_path, reference, mode):
    ref, path, plain_text = reference
    ranks = run_ranks(SCRIPT, 2, tmp_path, args=(mode, path), timeout=240)
    for name in ("cli", "cli_model"):
        cli = ranks[0][name]
        assert cli["rc"] == 0 and ranks[1][name] == {"rc": 0, "stdout": ""}
        got = json.loads(cli["stdout"])
        assert got["text"] == plain_text, name
        st = got["stats"]
        assert st["generation_tokens"] == N and st["drafted_tokens"] >= st["accepted_tokens"]
        if name == "cli_model":  # the target as its own draft model, whole on every rank: every draft accepted
            assert st["drafted_tokens"] == st["accepted_tokens"] > 0

    for name, (_, _, _, plain, _) in ref["ranked"].items():
        for r in ranks:
            assert r["ranked_" + name]["tokens"] == plain[:N], f"{name}, rank {ranks.index(r)}"
        counts = [(r["ranked_" + name]["drafted"], r["ranked_" + name]["accepted"]) for r in ranks]
        drafted, accepted = counts[0]
        assert counts[1] == counts[0] and 0 < accepted < drafted, name  # rank 0's drafts: some accepted, some not

    assert ranks[0]["sampled"] == ranks[1]["sampled"] and ranks[0]["sampled"]
    assert ranks[0]["chat"] == ranks[1]["chat"] == ref["chat"]  # a speculative chat: the plain session's replies
