"""Plant known bugs one at a time in a scratch copy of the repository and check that the test suite catches each.

    python tests/planted_bugs.py            # every bug; exits 0 only when every one is caught
    python tests/planted_bugs.py -k eps     # the bugs whose name contains "eps"
    python tests/planted_bugs.py --list     # the list, with the tests that must catch each

For each bug: copy the working tree (tracked and untracked-but-not-ignored files) to a temporary folder, apply the
bug's text edits (each ``old`` must occur exactly once in its file), lay the package out as ``pip install`` would
(``[tool.setuptools] package-dir`` of pyproject.toml) and put it first on ``PYTHONPATH``, then run the bug's tests
with pytest. A bug is caught when at least one of its tests fails. One line per bug says by which test.
The list of bugs and the tests that catch them is also in tests/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PlantedBug:
    """A bug: text edits ``(file, old, new)`` relative to the repository root, and the tests that must catch it."""

    name: str
    edits: tuple[tuple[str, str, str], ...]
    tests: tuple[str, ...]


BUGS: tuple[PlantedBug, ...] = (
    # -- sampling options (issue 11 item 1)
    # -- eps conventions and parity bounds (items 2, 3, 6)
    # -- cache contents after undo / interrupt / system change / regenerate (item 4)
    # -- error types, platform guards, LoRA truncation (items 5, 7, 8)
    PlantedBug(
        "LoRA training ignores max_seq_length (no truncation)",
        (("kimi_mlx/tuner/trainer.py", "iterate_batches(train_set, args.batch_size, args.max_seq_length,",
          "iterate_batches(train_set, args.batch_size, 2**31,"),),
        ("tests/test_lora.py::test_long_sequence_truncated_with_warning",),
    ),
    PlantedBug(
        "kimi-mlx lora drops --max-seq-length (trains at the 2048 default)",
        (("kimi_mlx/cli/lora.py", "steps_per_save=args.save_every,\n        max_seq_length=args.max_seq_length,\n",
          "steps_per_save=args.save_every,\n"),),
        ("tests/test_lora.py::test_cli_lora_fuse_generate_demo",),
    ),
    PlantedBug(
        "a codebook (IQ) tensor without requantize raises a bare ValueError, not GGUFQuantError",
        (("convert/gguf/quant.py", "    if qtype in CODEBOOK and not requantize:\n        raise GGUFQuantError(",
          "    if qtype in CODEBOOK and not requantize:\n        raise ValueError("),),
        ("tests/test_gguf_load.py::test_codebook_experts_end_to_end",),
    ),
    PlantedBug(
        "a missing local directory is looked up on the Hugging Face Hub",
        (("kimi_mlx/loading.py", "    if text.count(\"/\") != 1 or text.startswith((\".\", \"/\", \"~\")):",
          "    if text.count(\"/\") > 2:"),),
        ("tests/test_convert.py::test_bad_source_exit_2",),
    ),
    PlantedBug(
        "the GGUF loader skips its ggml type check (an F64 matrix reaches the decoder)",
        (("convert/gguf/arch.py",
          "    if info.qtype not in SUPPORTED_FLOAT + SUPPORTED_EXACT + SUPPORTED_REQUANT + CODEBOOK:\n        supported",
          "    if False:\n        supported"),),
        ("tests/test_gguf_malformed.py::test_malformed[kl-weight-as-F64]",),
    ),
    PlantedBug(
        "the GGUF reader takes tensor data for a tensor info without naming n_tensors",
        (("convert/gguf/reader.py", "        if not 0 < len(name.encode()) < GGML_MAX_NAME:",
          "        if len(name.encode()) >= 2**20:"),),
        ("tests/test_gguf_malformed.py::test_malformed[k3-n_tensors-plus-1]",),
    ),
    PlantedBug(
        "a test reads /proc/self/smaps unguarded (errors on macOS)",
        (("tests/test_gguf_load.py", "@pytest.mark.skipif(not Path(\"/proc/self/smaps\").exists(),\n"
          "                    reason=\"needs /proc/self/smaps (Linux) for the resident bytes of one file's mapping\")\n",
          ""),),
        ("tests/test_platform_guards.py",),
    ),
)


def apply(bug: PlantedBug, root: Path) -> None:
    """Apply ``bug``'s edits under ``root``; each ``old`` must occur exactly once in its file."""
    for file, old, new in bug.edits:
        path = root / file
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise ValueError(f"planted bug {bug.name!r}: {file} holds the text to replace {count} times, expected 1:\n"
                             f"{old}")
        path.write_text(text.replace(old, new))


def _tree_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


def scratch_copy(dst: Path) -> Path:
    """Copy the working tree to ``dst/repo``; return it."""
    repo = dst / "repo"
    for f in _tree_files(ROOT):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, repo / f)
    return repo


def package_layout(repo: Path, site: Path) -> None:
    """Lay out the packages under ``site`` as pyproject.toml's ``package-dir`` maps them (longest names last)."""
    mapping = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name in sorted(mapping, key=lambda n: n.count(".")):
        target = site.joinpath(*name.split("."))
        shutil.copytree(repo / mapping[name], target, dirs_exist_ok=True)


def run_bug(bug: PlantedBug, shared: Path, timeout: float) -> tuple[str, str]:
    """(verdict, detail): verdict is "caught" or "NOT CAUGHT"; detail names the first failing test or the reason."""
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        tmp = Path(tmp)
        repo = scratch_copy(tmp)
        apply(bug, repo)
        package_layout(repo, tmp / "site")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp / "site"), os.environ.get("PYTHONPATH", "")]),
                   KIMI_MLX_SHARED=str(shared), PYTHONDONTWRITEBYTECODE="1")
        # run from tmp, not the repository: `python -m` puts the working folder first on sys.path, and the source
        # tree's kimi_mlx/ lacks the subpackages that package-dir maps in
        where = subprocess.run([sys.executable, "-c", "import kimi_mlx; print(kimi_mlx.__file__)"], cwd=tmp, env=env,
                               capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(tmp / "site")):
            raise RuntimeError(f"the scratch copy is not the kimi_mlx that Python imports (it imports {where!r})")
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rfE", "--rootdir", str(repo),
               *(str(repo / t) for t in bug.tests)]
        try:
            out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "NOT CAUGHT", f"tests still running after {timeout:.0f} s"
        log = out.stdout + out.stderr
        failed = [t.removeprefix("repo/") for t in re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", log, re.M)]
        if out.returncode == 0:
            return "NOT CAUGHT", "all its tests passed"
        if failed:
            kind = "failed" if re.search(r"^FAILED ", log, re.M) else "errored"
            return "caught", f"{failed[0]} {kind}"
        tail = log.strip().splitlines()[-1] if log.strip() else f"pytest exit {out.returncode}"
        return "NOT CAUGHT", f"pytest exit {out.returncode} with no failing test: {tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only the bugs whose name contains this text")
    ap.add_argument("--list", action="store_true", help="list the bugs and their tests, run nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed for one bug's tests")
    args = ap.parse_args(argv)
    shared = Path(os.environ.get("KIMI_MLX_SHARED", ROOT.parent / "shared")).resolve()
    bugs = [b for b in BUGS if args.k.lower() in b.name.lower()]
    if not bugs:
        print(f"no planted bug matches {args.k!r}", file=sys.stderr)
        return 2
    if args.list:
        for b in bugs:
            print(f"{b.name}: {', '.join(b.tests)}")
        return 0
    missed = 0
    for b in bugs:
        tic = time.perf_counter()
        verdict, detail = run_bug(b, shared, args.timeout)
        missed += verdict != "caught"
        print(f"{verdict:10s} {b.name}: {detail} ({time.perf_counter() - tic:.0f} s)", flush=True)
    print(f"{len(bugs) - missed} of {len(bugs)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
