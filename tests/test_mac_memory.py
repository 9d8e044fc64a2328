"""Memory on a Mac (issue 20 item 5): the GPU working set macOS allows, wiring the model's memory while generating on
every path (API, CLI commands, server), the load-time warning with the ``iogpu.wired_limit_mb`` that fits, and the
server's cap on MLX's buffer cache.

This machine has no Metal GPU, so the device plumbing (``ops.memory.gpu_memory`` / ``set_wired_limit``) is replaced
by ``FakeMac`` where a test needs a Mac; each such test also runs the real CPU path (no working set: nothing wired,
no warning, the same output). The working-set model is checked against working sets that real Macs reported.
"""

import argparse
import math
import warnings

import mlx.core as mx
import pytest
from conftest import KL_FIXTURE
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_load import _file

import kimi_mlx
from kimi_mlx import batch_generate, generate, stream_generate
from kimi_mlx.chat.session import ChatSession
from kimi_mlx.cli import serve
from kimi_mlx.cli.main import main
from kimi_mlx.ops import memory
from kimi_mlx.ops.memory import FILL, GIB, MIB, GPUMemory, WorkingSetWarning

PROMPT = "The quick brown fox"


class FakeMac:
    """The device plumbing of a Mac with ``working_set`` bytes of GPU working set and ``memory`` bytes of RAM:
    what ``gpu_memory`` reports, and the wired limit MLX was last given (``set_wired_limit``)."""

    def __init__(self, working_set: int, memory: int):
        self.gpu = GPUMemory(working_set, memory)
        self.limit = 0
        self.history: list[int] = []

    def set_wired_limit(self, limit: int) -> int:
        previous, self.limit = self.limit, limit
        self.history.append(limit)
        return previous


@pytest.fixture
def fake_mac(monkeypatch):
    def make(working_set: int = 12 * GIB, ram: int = 16 * GIB) -> FakeMac:
        mac = FakeMac(working_set, ram)
        monkeypatch.setattr(memory, "gpu_memory", lambda: mac.gpu)
        monkeypatch.setattr(memory, "set_wired_limit", mac.set_wired_limit)
        return mac

    return make


@pytest.fixture(scope="module")
def demo():
    return kimi_mlx.load("demo", dtype=mx.float32)


def _nbytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


# ------------------------------------------------------------------------------------------------ the working set


@pytest.mark.parametrize("ram_gib, reported", [
    (16, 10922.67 * MIB),  # M1 Pro, llama-cpp-python#687
    (24, 17179.89e6),  # M2 (other builds print 17179.87: the last digit varies)
    (32, 21845.34 * MIB),  # M2 Max, ollama#434; M1 Max, llama.cpp#2011
    (36, 28991.03e6),  # M4 Max
    (64, 49152.00 * MIB),  # M1 / M2 Max, llama.cpp#1870
    (96, 73728.00 * MIB),  # M2 Max, llama.cpp#3213
])
def test_default_working_set_is_what_macs_report(ram_gib, reported):
    """macOS 13-15's default working set (recommendedMaxWorkingSetSize) as Macs reported it (sources in
    ops/memory.py): 2/3 of the memory up to 32 GiB, 3/4 above. llama.cpp prints 2 decimals of MiB or of 1e6 bytes."""
    assert memory.default_working_set(ram_gib * GIB) == pytest.approx(reported, rel=2e-6)


@settings(max_examples=300, deadline=None)
@given(ram_gib=st.sampled_from([8, 16, 24, 32, 36, 48, 64, 96, 128, 192, 256, 512]),
       fraction=st.floats(0.05, 1.5), raised=st.floats(1.0, 1.3))
def test_fit_advice_is_a_limit_that_fits(ram_gib, fraction, raised):
    """No advice up to FILL of the working set. Past it, either a sysctl value that raises the limit (never lowers
    it), leaves macOS its share, and under which the same bytes need no advice; or, when that value would not leave
    macOS its share, the advice to quantize or split."""
    ram = ram_gib * GIB
    gpu = GPUMemory(min(int(memory.default_working_set(ram) * raised), ram), ram)
    nbytes = int(fraction * gpu.working_set)
    advice = memory.fit_advice(nbytes, gpu)
    if nbytes <= FILL * gpu.working_set:
        assert advice is None
        return
    assert advice is not None and f" take {memory._size(nbytes)}, " in advice
    limit = memory.wired_limit_mib(nbytes)
    if limit * MIB <= ram - memory.macos_share(ram):
        assert f"sudo sysctl iogpu.wired_limit_mb={limit} " in advice
        assert limit * MIB > gpu.working_set
        assert memory.fit_advice(nbytes, GPUMemory(limit * MIB, ram)) is None
    else:
        assert "sysctl" not in advice and "quantize" in advice and "kimi-mlx plan" in advice


def test_fit_advice_text():
    """K3's largest pipeline rank on 4 x 512 GiB (395.61 GB, kimi-mlx plan) under macOS 13-15's default."""
    gpu = GPUMemory(memory.default_working_set(512 * GIB), 512 * GIB)
    assert gpu.working_set == 384 * GIB
    advice = memory.fit_advice(395_610_000_000, gpu)
    limit = math.ceil(395.61e9 / 0.9 / 2**20)
    assert advice == (
        "the model's weights take 395.6 GB, 96% of this Mac's GPU working set of 384.0 GiB (512 GiB of memory): "
        "little is left for the cache and activations, so long prompts page memory in and out (slow). Raise the "
        f"limit (until the next reboot) with: sudo sysctl iogpu.wired_limit_mb={limit} (the model's weights plus "
        f"10% of the limit for the cache and activations; it leaves {512 - limit / 1024:,.1f} GiB to macOS), or "
        "quantize the model or split it over several Macs (kimi-mlx plan).")
    assert "more than this Mac's GPU working set" in memory.fit_advice(400 * GIB, gpu)
    assert memory.fit_advice(int(0.9 * 384 * GIB), gpu) is None


# ------------------------------------------------------------------------------------------------ wiring


def test_cpu_backend_has_nothing_to_wire(demo):
    """The real device here: no Metal GPU, so nothing is wired and nothing is advised."""
    assert memory.gpu_memory() is None
    assert memory.keep_wired() is None
    with memory.wired():
        assert mx.set_wired_limit(0) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memory.check_fits(10**15, "huge")


def test_every_api_path_generates_wired(demo, fake_mac):
    """``stream_generate``, ``generate``, ``batch_generate`` and ``ChatSession`` run with the working set wired and
    restore the previous limit when done (or when a stream is closed early); their output is that of the CPU path."""
    model, tok = demo
    ids = tok.encode(PROMPT)
    plain = generate(model, tok, PROMPT, max_tokens=8)
    plain_batch = batch_generate(model, [ids, ids[1:]], 4)[0]
    session = ChatSession(model, tok, max_tokens=6)
    plain_chat = "".join(ev.text for ev in session.send("hi"))

    mac = fake_mac(working_set=12 * GIB)
    during = [mac.limit for _ in stream_generate(model, tok, PROMPT, 8)]
    assert set(during) == {12 * GIB} and mac.limit == 0
    assert generate(model, tok, PROMPT, max_tokens=8) == plain and mac.limit == 0
    seen = []

    def sampler(logprobs):
        seen.append(mac.limit)
        return mx.argmax(logprobs, axis=-1)

    assert batch_generate(model, [ids, ids[1:]], 4, sampler=sampler)[0] == plain_batch
    assert set(seen) == {12 * GIB} and mac.limit == 0
    stream = stream_generate(model, tok, PROMPT, 8)
    next(stream)
    assert mac.limit == 12 * GIB
    stream.close()
    assert mac.limit == 0
    session = ChatSession(model, tok, max_tokens=6)
    texts, during = [], []
    for ev in session.send("hi"):
        texts.append(ev.text)
        during.append(mac.limit)
    assert "".join(texts) == plain_chat and set(during) == {12 * GIB} and mac.limit == 0


@pytest.mark.parametrize("command", [
    ["generate", "--model", "demo", "--prompt", PROMPT, "--max-tokens", "4", "--quiet"],
    ["bench", "--model", "demo", "-p", "8", "-g", "2", "-n", "1", "--json"],
])
def test_cli_commands_keep_the_memory_wired(command, fake_mac, capsys):
    """``kimi-mlx generate`` and ``bench`` (``chat`` and ``serve`` load through the same ``load_from_args``) keep the
    working set wired from the load until the process exits; without Metal they run as before."""
    assert main(command) == 0
    mac = fake_mac(working_set=12 * GIB)
    assert main(command) == 0
    assert mac.history[0] == 12 * GIB and mac.limit == 12 * GIB


def test_lora_keeps_the_memory_wired(fake_mac, tmp_path, capsys):
    """``kimi-mlx lora`` (its own load, not ``load_from_args``) keeps the working set wired while it trains."""
    command = ["lora", "--model", "demo", "--train", "--data", "demo", "--iters", "1", "--batch-size", "2",
               "--adapter-path", str(tmp_path / "adapters")]
    mac = fake_mac(working_set=12 * GIB)
    assert main(command) == 0
    assert mac.history[0] == 12 * GIB and mac.limit == 12 * GIB


# ------------------------------------------------------------------------------------------------ load-time advice


@pytest.mark.parametrize("source", ["demo", "gguf"])
def test_load_warns_past_the_working_set(source, fake_mac):
    """``load`` says when the weights take more than FILL of the working set, with the sysctl value that fits
    them; not below FILL, and never on the CPU backend."""
    path = "demo" if source == "demo" else str(_file(KL_FIXTURE, "F32"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = kimi_mlx.load(path, dtype=mx.float32)  # the real CPU path: no advice
    nbytes = _nbytes(model)
    fake_mac(working_set=int(nbytes / 0.8), ram=64 * GIB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kimi_mlx.load(path, dtype=mx.float32)  # 80%: fine
    fake_mac(working_set=int(nbytes / 0.95), ram=64 * GIB)
    with pytest.warns(WorkingSetWarning) as caught:
        kimi_mlx.load(path, dtype=mx.float32)
    text = str(caught[0].message)
    named = path if source == "gguf" else str(kimi_mlx.loading.resolve_model_path("demo"))
    assert text.startswith(f"{named}: the model's weights take {nbytes / 1e6:,.1f} MB, 95% of this Mac's GPU working "
                           "set of ")
    assert f"sudo sysctl iogpu.wired_limit_mb={math.ceil(nbytes / 0.9 / 2**20)} " in text
    fake_mac(working_set=nbytes // 2, ram=nbytes + nbytes // 10)
    with pytest.warns(WorkingSetWarning, match="more than this Mac's GPU working set.*do not fit beside macOS"):
        kimi_mlx.load(path, dtype=mx.float32)


# ------------------------------------------------------------------------------------------------ serve's buffer cache


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", "demo", *flags])


@pytest.mark.parametrize("flags, expected", [
    ((), lambda mac: min(2 * GIB, mac.gpu.working_set // 8)),
    (("--cache-limit", "512M"), lambda mac: 512 * MIB),
    (("--cache-limit", "0"), lambda mac: 0),
])
def test_serve_caps_the_buffer_cache(flags, expected, fake_mac):
    """Every rank of ``serve`` sets MLX's buffer-cache cap (the flag, else an eighth of the working set, at most
    2 GiB; an eighth of the RAM without Metal) and wires the working set."""
    before = mx.set_cache_limit(0)
    try:
        serve._backend_parts(_serve_args(*flags), None)  # the real CPU path
        ram = memory.default_cache_limit()
        assert mx.set_cache_limit(0) == (ram if not flags else expected(None))
        mac = fake_mac(working_set=6 * GIB)
        serve._backend_parts(_serve_args(*flags), None)
        assert mx.set_cache_limit(0) == expected(mac)
        assert mac.limit == 6 * GIB
    finally:
        mx.set_cache_limit(before)


# ------------------------------------------------------------------------------------------------ distributed ranks

RANK_CODE = """
import math, warnings
import kimi_mlx
from kimi_mlx.ops import memory
from mlx.utils import tree_flatten

class FakeMac:  # the device plumbing of a Mac whose GPU working set is 1 MB (every rank's share is over it)
    limit, seen = 0, []
    def set_wired_limit(self, n):
        previous, self.limit = self.limit, n
        return previous

mac = FakeMac()
memory.gpu_memory = lambda: memory.GPUMemory(2**20, 64 * 2**30)
memory.set_wired_limit = mac.set_wired_limit
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model, tok = kimi_mlx.load(sys.argv[1], dtype=mx.float32, parallel="pipeline", group=group)
advice = [str(w.message) for w in caught if issubclass(w.category, memory.WorkingSetWarning)]

def sampler(logprobs):
    mac.seen.append(mac.limit)
    return mx.argmax(logprobs, axis=-1)

kimi_mlx.generate(model, tok, "The quick brown fox", max_tokens=3, sampler=sampler)
report({"advice": advice, "bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        "seen": sorted(set(mac.seen)), "after": mac.limit})
"""


def test_every_rank_warns_for_its_share_and_generates_wired(tmp_path):
    """Under ``load(parallel="pipeline")`` on 2 ranks (a Mac's device plumbing replaced in each rank's script), each
    rank advises for the weights it holds, naming itself, and generates with the working set wired."""
    from distributed import run_ranks

    results = run_ranks(RANK_CODE, 2, tmp_path, args=[KL_FIXTURE / "hf"], timeout=240)
    for rank, r in enumerate(results):
        assert len(r["advice"]) == 1
        text = r["advice"][0]
        assert text.startswith(f"{KL_FIXTURE / 'hf'} (rank {rank} of 2): the model's weights take "
                               f"{r['bytes'] / 1e6:,.1f} MB, more than this Mac's GPU working set")
        assert f"sudo sysctl iogpu.wired_limit_mb={math.ceil(r['bytes'] / 0.9 / MIB)} " in text
        assert r["seen"] == [MIB] and r["after"] == 0
    assert results[0]["bytes"] != results[1]["bytes"]
