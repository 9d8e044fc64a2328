"""``kimi-mlx generate|chat|bench --draft lookup|PATH --num-draft-tokens K`` (the installed command, demo model):
the text is plain decoding's, the stats show the drafted / accepted tokens and the acceptance rate, and bad values
exit 2 with a message naming the flag (no traceback).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KL_FIXTURE

KIMI = str(Path(sys.executable).parent / "kimi-mlx")
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
CHAT = "the cat sat on the mat, the cat sat on the mat\nagain: the cat sat on the mat\n/stats\n"


def _run(*args: str, stdin: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([KIMI, *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_generate_with_lookup_gives_the_plain_text_and_counts(tmp_path):
    args = ["generate", "--model", "demo", "--prompt", PROMPT, "--max-tokens", "40"]
    plain = _run(*args, "--json")
    spec = _run(*args, "--json", "--draft", "lookup", "--num-draft-tokens", "4")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    want, got = json.loads(plain.stdout), json.loads(spec.stdout)
    assert got["text"] == want["text"]
    assert want["stats"]["drafted_tokens"] == 0 and want["stats"]["acceptance_rate"] is None
    st = got["stats"]
    assert st["drafted_tokens"] > 0 and 0 <= st["accepted_tokens"] <= st["drafted_tokens"]
    assert st["acceptance_rate"] == pytest.approx(st["accepted_tokens"] / st["drafted_tokens"])

    line = _run(*args, "--draft", "lookup", "--num-draft-tokens", "4")  # the stats line on stderr
    assert line.returncode == 0 and line.stdout.strip() == want["text"].strip()
    rate = f"{100 * st['accepted_tokens'] / st['drafted_tokens']:.0f}%"
    assert f"drafted {st['drafted_tokens']}, accepted {st['accepted_tokens']} ({rate})" in line.stderr


def test_generate_with_a_draft_model(tmp_path):
    """``--draft demo`` with ``--model demo`` (the target as its own draft: every greedy draft accepted): plain
    decoding's text, drafted = accepted > 0; a draft model of another vocabulary is a CLI error naming --draft."""
    args = ["generate", "--model", "demo", "--prompt", PROMPT, "--max-tokens", "24", "--json"]
    plain, spec = _run(*args), _run(*args, "--draft", "demo", "--num-draft-tokens", "4")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    got = json.loads(spec.stdout)
    assert got["text"] == json.loads(plain.stdout)["text"]
    assert got["stats"]["drafted_tokens"] == got["stats"]["accepted_tokens"] > 0
    assert got["stats"]["acceptance_rate"] == 1.0
    other = str(KL_FIXTURE / "hf")  # the Kimi Linear fixture: 512 ids too, other tokens
    out = _run(*args, "--draft", other)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"kimi-mlx: error: --draft {other}: the draft model's tokenizer differs" in out.stderr, out.stderr


def _transcript(stdout: str) -> str:
    """The chat output without the speed numbers and the speculation counts."""
    return re.sub(r"[\d.]+ tok/s|peak memory [\d.]+ GB| \| drafted \d+, accepted \d+ \([\d-]+%?\)", "", stdout)


def test_chat_with_lookup_gives_the_plain_replies_and_counts():
    args = ["chat", "--model", "demo", "--max-tokens", "24"]
    plain = _run(*args, stdin=CHAT)
    spec = _run(*args, "--draft", "lookup", "--num-draft-tokens", "4", stdin=CHAT)
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert _transcript(spec.stdout) == _transcript(plain.stdout)
    assert "drafted" not in plain.stdout
    counts = [tuple(map(int, m)) for m in re.findall(r"drafted (\d+), accepted (\d+)", spec.stdout)]
    assert len(counts) == 3  # after each reply, and /stats repeats the last
    assert counts[1] == counts[2] and sum(a for _, a in counts[:2]) > 0
    model = _run(*args, "--draft", "demo", stdin=CHAT)  # a draft model (the target itself: all accepted)
    assert model.returncode == 0 and _transcript(model.stdout) == _transcript(plain.stdout), model.stderr
    counts = [tuple(map(int, m)) for m in re.findall(r"drafted (\d+), accepted (\d+)", model.stdout)]
    assert len(counts) == 3 and all(d == a > 0 for d, a in counts)


def test_bench_with_lookup_prints_the_acceptance_rate():
    out = _run("bench", "--model", "demo", "-p", "16", "-g", "8", "-n", "1", "--draft", "lookup", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["draft"] == "lookup" and info["num_draft_tokens"] == 8
    row = info["results"][0]
    spec = row["speculative"]
    assert spec["generation_tps"] > 0 and row["generation_tps"] > 0
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    table = _run("bench", "--model", "demo", "-p", "16", "-g", "8", "-n", "1", "--draft", "lookup")
    assert table.returncode == 0, table.stderr
    head, first = table.stdout.splitlines()[1:3]
    assert head.split()[-3:] == ["tok/s", "speedup", "accepted"] and first.split()[-2].endswith("x")


@pytest.mark.parametrize("cmd, flags, message", [
    ("generate", ["--draft", "nonsense"], "--draft nonsense: expected 'lookup' or a draft model"),
    ("chat", ["--draft", "/no/such/model"], "--draft /no/such/model: expected 'lookup' or a draft model"),
    ("bench", ["--draft", "missing.gguf"], "--draft missing.gguf: expected 'lookup' or a draft model"),
    ("generate", ["--draft", "lookup", "--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1, got 0"),
    ("chat", ["--num-draft-tokens", "4"], "--num-draft-tokens 4 needs --draft"),
    ("generate", ["--draft", "lookup", "--image", __file__], "--draft lookup is not supported with --image"),
])
def test_bad_draft_flags_are_cli_errors(cmd, flags, message):
    out = _run(cmd, "--model", "demo", *flags, stdin="")
    assert out.returncode == 2 and f"kimi-mlx: error: {message}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
