"""`kimi-mlx bench`: speed/memory measurement on the demo model, and its argument errors."""

import json
import subprocess
import sys


def _bench(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "kimi_mlx.cli.main", "bench", "--model", "demo", *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,  # the installed package, not the source tree
    )


def test_bench_json_reports_every_prompt_length(tmp_path):
    """--json gives one row per --prompt-tokens value with positive prompt/generation tok/s and peak memory."""
    out = _bench(tmp_path, "-p", "8", "24", "-g", "4", "-n", "2", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["trials"] == 2 and [r["prompt_tokens"] for r in info["results"]] == [8, 24]
    for r in info["results"]:
        assert r["generation_tokens"] == 4
        assert r["prompt_tps"] > 0 and r["generation_tps"] > 0 and r["peak_memory_gb"] > 0


def test_bench_table(tmp_path):
    """Without --json it prints a table with a row per prompt length."""
    out = _bench(tmp_path, "-p", "8", "-g", "2", "-n", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "prompt tok/s" in lines[1] and lines[2].split()[:2] == ["8", "2"]


def test_bench_rejects_bad_counts(tmp_path):
    """A non-positive count exits with status 2 and names the flag."""
    out = _bench(tmp_path, "-n", "0")
    assert out.returncode == 2 and "--num-trials must be >= 1" in out.stderr
    out = _bench(tmp_path, "-p", "16", "0")
    assert out.returncode == 2 and "--prompt-tokens must be >= 1" in out.stderr
