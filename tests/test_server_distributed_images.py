"""The serving engine with images on 2 ``ring`` ranks (pipeline and tensor parallel): the plan carries each request's
images (digest, placeholder count, size), the features reach the ranks that embed (``model.image_encoder`` of a
distributed load), prefill chunks of 16 tokens cut the image, and the prefix cache keys images by content on every
rank alike.

Rank 0 compares with one process: ``stream_generate`` on the whole model (the top-5 log-probabilities of each step
it generates, within 1e-4), and with itself: the same image re-sent resumes from the cache (all but the last prompt token) with
the same log-probabilities (<= 1e-5), another image of the same size takes only the text before its image, and the
tower runs once per distinct image.
"""

import pytest
from conftest import SHARED
from distributed import run_ranks

ROOT = SHARED / "fixtures" / "k3_vision"

RANK_SCRIPT = """
import numpy as np
from pathlib import Path
from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load
from kimi_mlx.server.scheduler import GenerationRequest, Scheduler

root, mode = Path(sys.argv[1]), sys.argv[2]
model, tok = load(root / "k3-vl-tiny", dtype=mx.float32, parallel=mode, group=group)
engine = Scheduler(model, max_batch=2, prefill_chunk=16, checkpoint_interval=16, group=group)
if group.rank() != 0:
    engine.serve()  # until rank 0 stops
    report({"served": True})
    sys.exit(0)

ids = np.load(root / "mlx_vlm" / "img0_rgb_224x168.chat.input_ids.npy").reshape(-1).tolist()
img0 = root / "images" / "img0_rgb_224x168.png"
other = np.random.default_rng(5).integers(0, 256, (168, 224, 3), dtype=np.uint8)  # img0's size, other pixels
enc = model.image_encoder
engine.start()

def run(image):
    req = GenerationRequest(ids, 4, top_logprobs=5, images=(enc.prepare(image),))
    events = list(engine.submit(req))
    return {"top": [[[t, lp] for t, lp in e.top_logprobs] for e in events[:-1]], "cached": events[-1].cached_tokens}

a, b, again = run(img0), run(other), run(img0)
engine.stop()
ref_model, ref_tok = load(root / "k3-vl-tiny", dtype=mx.float32)

def ref(image):
    steps = [np.array(r.logprobs) for r in stream_generate(ref_model, ref_tok, ids, 4, images=[image])]
    return [[[int(t), float(lp[t])] for t in np.argsort(-lp, kind="stable")[:5]] for lp in steps]

report({"a": a, "b": b, "again": again, "ref_a": ref(img0), "ref_b": ref(other), "encoded": enc.encoded,
        "prompt": len(ids), "first_pad": ids.index(enc.placeholder_id)})
"""


def _delta(x: list, y: list) -> float:
    assert [[t for t, _ in s] for s in x] == [[t for t, _ in s] for s in y]
    return max(abs(p - q) for sx, sy in zip(x, y) for (_, p), (_, q) in zip(sx, sy))


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_serve_images_as_one_process(mode, tmp_path):
    r0, r1 = run_ranks(RANK_SCRIPT, 2, tmp_path, args=(ROOT, mode), timeout=400)
    assert r1 == {"served": True}
    for got, want in ((r0["a"]["top"], r0["ref_a"]), (r0["b"]["top"], r0["ref_b"])):
        assert want and _delta(got[: len(want)], want) < 1e-4  # stream_generate stops at an eos; the engine does not
    assert r0["a"]["cached"] == 0 and 0 < r0["b"]["cached"] <= r0["first_pad"]
    assert r0["again"]["cached"] == r0["prompt"] - 1
    assert _delta(r0["again"]["top"], r0["a"]["top"]) <= 1e-5
    assert r0["encoded"] == 2
