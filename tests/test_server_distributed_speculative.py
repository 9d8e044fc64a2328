"""Speculative serving on 2 ``ring`` ranks under ``mlx.launch``: every rank runs the engine's speculative passes in
lockstep with rank 0's drafts and accepted tokens, and rank 0's output equals one process's engine.

Each rank loads the tiny Kimi Linear fixture with its share; rank 0 then loads the whole model and runs the same
requests on a one-process engine with the same drafter (and greedy ``stream_generate`` as the plain reference).
"""

import pytest
from conftest import KL_FIXTURE
from distributed import run_ranks

RANK_SCRIPT = """
import numpy as np
from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load
from kimi_mlx.server.scheduler import GenerationRequest, ReasoningBudget, Scheduler

path, mode = sys.argv[1], sys.argv[2]
model, tok = load(path, dtype=mx.float32, parallel=mode, group=group)
engine = Scheduler(model, max_batch=3, prefill_chunk=16, draft="lookup", num_draft_tokens=4, group=group)
if group.rank() != 0:
    engine.serve()  # until rank 0 stops
    report({"served": True})
    sys.exit(0)

ref_model, ref_tok = load(path, dtype=mx.float32)
rng = np.random.default_rng(0)
heads = [rng.integers(0, 512, 10).tolist() for _ in range(3)]
prompts = [h + h[:6] for h in heads]
plain = [[r.token for r in stream_generate(ref_model, ref_tok, p, 12)] for p in prompts]
# request 0 predicts its reply (drafts accepted), 1 predicts wrongly everywhere, 2 has prompt lookup only;
# 0, then 1, alone (speculative passes); then 1 again and 2 together (batched steps)
requests = [dict(prediction=tuple(plain[0])), dict(prediction=tuple((t + 1) % 512 for t in plain[1])), {}]

def run(engine, parallel):
    engine.start() if not parallel else None
    out = []
    for p, kw in zip(prompts[:2], requests[:2]):
        events = list(engine.submit(GenerationRequest(p, 12, **kw)))
        out.append(([e.token for e in events[:-1]], events[-1].drafted, events[-1].accepted))
    streams = [engine.submit(GenerationRequest(p, 12, **kw)) for p, kw in zip(prompts[1:], requests[1:])]
    for s in streams:
        events = list(s)
        out.append(([e.token for e in events[:-1]], events[-1].drafted, events[-1].accepted))
    # a reasoning budget (rank 0's turns: passes until the closer is given, batched steps while it is)
    events = list(engine.submit(GenerationRequest(prompts[0], 12, prediction=tuple(plain[0]),
                                                  reasoning=ReasoningBudget(5, (300, 301), frozenset()))))
    out.append(([e.token for e in events[:-1]], events[-1].drafted, events[-1].accepted))
    engine.stop()
    return out

engine.start()
dist = run(engine, True)
single = run(Scheduler(ref_model, max_batch=3, prefill_chunk=16, draft="lookup", num_draft_tokens=4), False)
budget = plain[0][:5] + [300, 301]
budget += [r.token for r in stream_generate(ref_model, ref_tok, prompts[0] + budget, 5)]
report({"dist": dist, "single": single, "plain": plain[:2] + plain[1:] + [budget]})
"""


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_speculate_as_one_process(mode, tmp_path):
    """Rank 0's tokens, drafted and accepted counts equal one process's engine, and the
    tokens equal plain greedy decoding (a reasoning budget's closer included); the other rank follows every pass
    and returns when rank 0 stops."""
    r0, r1 = run_ranks(RANK_SCRIPT, 2, tmp_path, args=(KL_FIXTURE / "hf", mode), timeout=400)
    assert r1 == {"served": True}
    assert r0["dist"] == r0["single"]
    assert [tokens for tokens, _, _ in r0["dist"]] == r0["plain"]
    (_, drafted, accepted), (_, wrong_drafted, wrong_accepted) = r0["dist"][:2]
    assert accepted == drafted > 0 and wrong_drafted > 0 == wrong_accepted
