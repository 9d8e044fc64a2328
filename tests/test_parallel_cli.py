"""``mlx.launch -n 2 --backend ring -- kimi-mlx generate|chat|bench --parallel pipeline|tensor``: real launcher, two
pinned ranks. Rank 0 alone prints, and what it prints equals the single-process CLI (greedy, and sampled with the
same --seed); without --seed the ranks still sample the same tokens (rank 0's seed is shared); chat commands run in
lockstep; bad --parallel / --split values exit 2 with a ``kimi-mlx: error:`` message.

``mlx.launch`` exits 0 even when a rank fails, so every run also checks the launcher's per-rank warnings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KL_FIXTURE
from distributed import _free_port_base, _run_group, launch_command

MODEL = str(KL_FIXTURE / "hf")
KIMI = shutil.which("kimi-mlx", path=os.path.dirname(sys.executable)) or "kimi-mlx"
TIMEOUT = 120
GEN = ["generate", "--model", MODEL, "--prompt", "The quick brown fox", "--max-tokens", "12", "--json"]
SAMPLED = ["--temp", "1", "--top-k", "0"]


def _single(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KIMI, *args], input=stdin, capture_output=True, text=True, timeout=TIMEOUT)


def _launch(tmp_path: Path, *args: str, stdin: str | None = None, program=(KIMI,), env=None):
    """Run on 2 ranks; returns the CompletedProcess and the ranks that the launcher says failed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = launch_command(2, tmp_path, *program, *args)
    if stdin is None:
        proc = _run_group(cmd, TIMEOUT, cwd=tmp_path, stdin=subprocess.DEVNULL, env=env)
    else:
        stdin_file = tmp_path / "stdin.txt"
        stdin_file.write_text(stdin)
        with open(stdin_file) as f:
            proc = _run_group(cmd, TIMEOUT, cwd=tmp_path, stdin=f, env=env)
    failed = {int(r): int(c) for r, c in re.findall(r"rank (\d+) exited with code (\d+)", proc.stderr)}
    return proc, failed


def _ok(proc, failed) -> None:
    assert proc.returncode == 0 and not failed, f"ranks failed {failed}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _one_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one completion (rank 0's), got {len(lines)} lines:\n{stdout}"
    return json.loads(lines[0])


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_generate_equals_single_process(tmp_path, mode):
    """Greedy and sampled (--temp 1 --seed 7): one completion, equal to one process's."""
    for extra in ([], [*SAMPLED, "--seed", "7"]):
        want = _single(*GEN, *extra)
        assert want.returncode == 0, want.stderr
        proc, failed = _launch(tmp_path / ("s" if extra else "g"), *GEN, *extra, "--parallel", mode)
        _ok(proc, failed)
        got = _one_json(proc.stdout)
        assert got["text"] == json.loads(want.stdout)["text"]
        assert got["stats"]["generation_tokens"] == 12


RECORD_EVERY_RANK = """\
import contextlib, os, sys
from kimi_mlx.cli import main, ranks

on_ranks = ranks.on_ranks

@contextlib.contextmanager
def to_file(group):
    with on_ranks(group), open(f"out{group.rank()}.json", "w") as f, contextlib.redirect_stdout(f):
        yield

ranks.on_ranks = to_file  # every rank's stdout to its own file
sys.exit(main.main(sys.argv[1:]))
"""


def test_generate_without_seed_ranks_agree(tmp_path):
    """--temp 1 without --seed: rank 0 picks the seed and shares it, so both ranks sample the same tokens (each
    rank's output captured in its own file); a second run picks another seed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "record.py"
    script.write_text(RECORD_EVERY_RANK)
    texts = []
    for run in ("a", "b"):
        d = tmp_path / run
        d.mkdir()
        shutil.copy(script, d / "record.py")
        proc, failed = _launch(d, *GEN, *SAMPLED, "--max-tokens", "16", "--parallel", "pipeline",
                               program=(sys.executable, str(d / "record.py")))
        _ok(proc, failed)
        outs = [_one_json((d / f"out{r}.json").read_text())["text"] for r in range(2)]
        assert outs[0] == outs[1]
        texts.append(outs[0])
    assert texts[0] != texts[1], "two runs without --seed sampled the same 16 tokens: is the seed fixed?"


def test_generate_prompt_from_stdin(tmp_path):
    """``--prompt -``: rank 0 reads stdin and hands the text to rank 1 (ranks started by hand, like ``mpirun``
    does: only rank 0 gets the input and its end; ``mlx.launch`` does not pass end-of-input on)."""
    prompt = "Grüße, fox 🦊\nsecond line"
    want = _single(*GEN[:3], "--prompt", prompt, *GEN[5:])
    assert want.returncode == 0, want.stderr
    base = _free_port_base(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    cpus = os.cpu_count() or 1
    procs = []
    for r in range(2):
        env = dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile))
        cmd = ["taskset", "-c", str(r % cpus), KIMI, *GEN[:3], "--prompt", "-", *GEN[5:], "--parallel", "tensor"]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out0, err0 = procs[0].communicate(prompt, timeout=TIMEOUT)
        out1, err1 = procs[1].communicate(timeout=TIMEOUT)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err0 + err1
    assert out1 == ""  # rank 1 is silent
    got = _one_json(out0)
    assert got["text"] == json.loads(want.stdout)["text"]
    assert got["stats"]["prompt_tokens"] == json.loads(want.stdout)["stats"]["prompt_tokens"]


def _transcript(stdout: str) -> str:
    """The chat output without the speed numbers (they differ run to run)."""
    return re.sub(r"[\d.]+ tok/s|peak memory [\d.]+ GB", "", stdout)


def test_chat_lockstep_equals_single_process(tmp_path):
    """Two turns, /regenerate, /undo, /system, a third turn, /quit: rank 0's transcript equals one process's
    (sampled with --seed), the other rank prints nothing."""
    lines = ["hello there", "tell me more", "/regenerate", "/undo", "/system be brief", "again", "/quit"]
    stdin = "\n".join(lines) + "\n"
    args = ["chat", "--model", MODEL, "--max-tokens", "6", *SAMPLED, "--seed", "3"]
    want = _single(*args, stdin=stdin)
    assert want.returncode == 0, want.stderr
    proc, failed = _launch(tmp_path, *args, "--parallel", "pipeline", stdin=stdin)
    _ok(proc, failed)
    assert _transcript(proc.stdout) == _transcript(want.stdout)
    assert proc.stdout.count("kimi-mlx chat:") == 1
    assert proc.stdout.count("[removed 2 messages]") == 1


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_chat_save_and_load_per_rank(tmp_path, mode):
    """/save writes each rank's part (x.safetensors on rank 0, x.rank1.safetensors on rank 1); a new run with --load
    continues the conversation as one process does after /save and --load; swapped parts are refused (a part records
    the layers / shard it holds), and with rank 1's part missing every rank refuses the load, naming rank 1."""
    args = ["chat", "--model", MODEL, "--max-tokens", "6", *SAMPLED, "--seed", "3"]
    first, second = "hello there\n/save x.safetensors\n/quit\n", "tell me more\n/quit\n"
    single = tmp_path / "single"
    single.mkdir()
    for stdin, extra in ((first, []), (second, ["--load", "x.safetensors"])):
        want = subprocess.run([KIMI, *args, *extra], input=stdin, capture_output=True, text=True, timeout=TIMEOUT,
                              cwd=single)
        assert want.returncode == 0, want.stderr
    par = tmp_path / "par"
    _ok(*_launch(par, *args, "--parallel", mode, stdin=first))
    assert (par / "x.safetensors").exists() and (par / "x.rank1.safetensors").exists()
    proc, failed = _launch(par, *args, "--parallel", mode, "--load", "x.safetensors", stdin=second)
    _ok(proc, failed)
    assert _transcript(proc.stdout) == _transcript(want.stdout)

    (par / "x.safetensors").rename(par / "swap")
    (par / "x.rank1.safetensors").rename(par / "x.safetensors")
    (par / "swap").rename(par / "x.rank1.safetensors")
    proc, failed = _launch(par, *args, "--parallel", mode, "--load", "x.safetensors", stdin=second)
    assert 2 in failed.values() and "made for another model" in proc.stderr, proc.stderr
    (par / "x.safetensors").replace(par / "rank1")  # rank 0's part back in place, rank 1's gone
    (par / "x.rank1.safetensors").replace(par / "x.safetensors")
    proc, failed = _launch(par, *args, "--parallel", mode, "--load", "x.safetensors", stdin=second)
    assert 2 in failed.values() and "loading x.safetensors failed on rank 1" in proc.stderr, proc.stderr


def test_bench_parallel(tmp_path):
    proc, failed = _launch(tmp_path, "bench", "--model", MODEL, "-p", "8", "-g", "4", "-n", "1", "--json",
                           "--parallel", "tensor")
    _ok(proc, failed)
    out = _one_json(proc.stdout)
    assert [r["prompt_tokens"] for r in out["results"]] == [8]


@pytest.mark.parametrize("cmd, flags, message", [
    ("generate", ["--parallel", "data"], "--parallel data: expected one of pipeline, tensor"),
    ("chat", ["--parallel", "tensor", "--split", "even"], "--split even: only --parallel pipeline takes a split"),
    ("bench", ["--split", "2,2"], "--split 2,2: only --parallel pipeline takes a split"),
    ("chat", ["--parallel", "pipeline", "--split", "2,x"], "--split 2,x: expected 'even' or positive layer counts"),
])
def test_bad_values_exit_2_single_process(cmd, flags, message):
    proc = _single(cmd, "--model", MODEL, *flags, stdin="")
    assert proc.returncode == 2, (cmd, proc.stdout, proc.stderr)
    assert f"kimi-mlx: error: {message}" in proc.stderr


def test_bad_values_under_launch(tmp_path):
    """Under mlx.launch: a bad --parallel is said once (by rank 0) and both ranks exit 2; a --split that does not
    cover the model's layers (found while loading) exits 2 with load's message."""
    proc, _ = _launch(tmp_path / "mode", *GEN, "--parallel", "data")
    assert proc.stderr.count("kimi-mlx: error: --parallel data: expected one of pipeline, tensor") == 1, proc.stderr
    assert proc.stdout == ""
    assert not re.search(r"exited with code 0\b", proc.stderr)
    assert re.search(r"rank \d exited with code 2", proc.stderr), proc.stderr
    proc, _ = _launch(tmp_path / "split", *GEN, "--parallel", "pipeline", "--split", "3,3")
    assert re.search(r"kimi-mlx: error: .*split", proc.stderr), proc.stderr
    assert re.search(r"rank \d exited with code 2", proc.stderr), proc.stderr
    assert proc.stdout == ""
