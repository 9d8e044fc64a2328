"""The serving engine on 2 ``ring`` ranks under ``mlx.launch`` (pipeline and tensor parallel): rank 0 takes the
requests, every rank runs the same turns from rank 0's broadcast plans, and the outputs equal one process's.

Each rank loads the tiny Kimi Linear fixture with its share; rank 0 also loads the whole model and computes the
single-process greedy reference with ``stream_generate``.
"""

import pytest
from conftest import KL_FIXTURE
from distributed import run_ranks

RANK_SCRIPT = """
import numpy as np
from kimi_mlx.generate import stream_generate
from kimi_mlx.loading import load
from kimi_mlx.server.scheduler import FinishEvent, GenerationRequest, SamplingParams, Scheduler

path, mode = sys.argv[1], sys.argv[2]
model, tok = load(path, dtype=mx.float32, parallel=mode, group=group)
engine = Scheduler(model, max_batch=3, prefill_chunk=16, checkpoint_interval=16, group=group)
if group.rank() != 0:
    engine.serve()  # until rank 0 stops
    report({"served": True})
    sys.exit(0)

rng = np.random.default_rng(0)
prompts = [rng.integers(0, 512, n).tolist() for n in (7, 40, 3, 25)]
engine.start()

def run(stream):
    events = list(stream)
    return [e.token for e in events[:-1]], events[-1]

streams = [engine.submit(GenerationRequest(p, 8)) for p in prompts]
sampled = engine.submit(GenerationRequest(prompts[0], 8, SamplingParams(temp=0.8, top_k=20, seed=5)))
cancelled = engine.submit(GenerationRequest(prompts[1], 100000))
outs = [run(s)[0] for s in streams]
sampled_out = run(sampled)[0]
cancelled.cancel()
_, cancel_fin = run(cancelled)
# the next turn of prompt 0's conversation resumes from its reply snapshot
turn2 = prompts[0] + outs[0] + [5, 6, 7]
turn2_out, turn2_fin = run(engine.submit(GenerationRequest(turn2, 8)))
engine.stop()

ref_model, ref_tok = load(path, dtype=mx.float32)
ref = [[r.token for r in stream_generate(ref_model, ref_tok, p, 8)] for p in prompts]
mx.random.seed(5)
ref_sampled = [r.token for r in stream_generate(ref_model, ref_tok, prompts[0], 8, temp=0.8, top_k=20)]
ref_turn2 = [r.token for r in stream_generate(ref_model, ref_tok, turn2, 8)]
report({"outs": outs, "ref": ref, "sampled": sampled_out, "ref_sampled": ref_sampled, "turn2": turn2_out,
        "ref_turn2": ref_turn2, "turn2_cached": turn2_fin.cached_tokens, "expected_cached": len(prompts[0]) + 7,
        "cancel": cancel_fin.reason})
"""


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_serve_the_single_process_output(mode, tmp_path):
    """Concurrent greedy requests, a seeded sampled one, a cancelled one and a resumed second turn on 2 ranks:
    rank 0's tokens equal one process's; the other rank follows every plan and returns when rank 0 stops."""
    r0, r1 = run_ranks(RANK_SCRIPT, 2, tmp_path, args=(KL_FIXTURE / "hf", mode), timeout=400)
    assert r1 == {"served": True}
    assert r0["outs"] == r0["ref"]
    assert r0["sampled"] == r0["ref_sampled"]
    assert r0["turn2"] == r0["ref_turn2"]
    assert r0["turn2_cached"] == r0["expected_cached"]
    assert r0["cancel"] == "cancelled"


def test_two_ranks_serve_chat_completions_over_http(tmp_path):
    """``mlx.launch -n 2 -- kimi-mlx serve --parallel pipeline``: rank 0 answers the OpenAI client (streamed and
    not, two conversations at once; then the Responses API, whole and streamed) and the Ollama client with the
    single-process greedy text of the rendered conversation."""
    import concurrent.futures
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx2 as httpx
    import mlx.core as mx
    import ollama
    from distributed import launch_command
    from openai import OpenAI
    from serve_helpers import free_port

    from kimi_mlx.chat.format import render_chat
    from kimi_mlx.generate import generate
    from kimi_mlx.loading import load

    model_dir = KL_FIXTURE / "hf"
    port = free_port()
    cmd = launch_command(2, tmp_path, sys.executable, "-m", "kimi_mlx.cli.main", "serve", "--model", str(model_dir),
                         "--parallel", "pipeline", "--port", str(port), "--dtype", "float32")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        chats = [[{"role": "user", "content": "Hello there"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: 1 2 3"}]]

        def ask(messages, stream):
            kw = dict(model=str(model_dir), messages=messages, max_tokens=12, temperature=0)
            if not stream:
                return client.chat.completions.create(**kw).choices[0].message.content
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda a: ask(*a), [(m, s) for m in chats for s in (False, True)]))
        kw = dict(model=str(model_dir), input=chats[0], max_output_tokens=12, temperature=0)
        got.append(client.responses.create(**kw).output_text)
        with client.responses.stream(**kw) as stream:
            got.append("".join(e.delta for e in stream if e.type == "response.output_text.delta"))
        ol = ollama.Client(host=f"http://127.0.0.1:{port}")  # the Ollama API on the same engine
        got_ollama = [ol.chat(model=str(model_dir), messages=m, options={"temperature": 0, "num_predict": 12})
                      .message.content for m in chats]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
        ranks_left = _wait_for_group_exit(proc.pid, 45)  # the ranks too, not only the launcher
    assert not ranks_left, f"ranks still running 45 s after SIGTERM: {ranks_left}"
    model, tok = load(model_dir, dtype=mx.float32)
    want = [generate(model, tok, render_chat(tok, m), 12, stop_strings=()) for m in chats]
    assert got == [want[0], want[0], want[1], want[1], want[0], want[0]], (tmp_path / "serve.log").read_text()
    assert got_ollama == want


def _wait_for_group_exit(pgid: int, timeout_s: float) -> list[str]:
    """Wait until no process of group ``pgid`` is left; past ``timeout_s`` kill the rest and return their command
    lines (a rank left blocked in a collective would otherwise outlive the test)."""
    import os
    import signal
    import time
    from pathlib import Path

    def members() -> list[str]:
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append((stat.parent / "cmdline").read_text().replace("\0", " ").strip())
            except (OSError, IndexError, ValueError):
                pass
        return out

    deadline = time.monotonic() + timeout_s
    while (left := members()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        os.killpg(pgid, signal.SIGKILL)
    return left
