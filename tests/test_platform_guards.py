"""The suite runs on macOS (our main platform) as well as Linux: tests that read Linux-only sources skip elsewhere."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent
LINUX_ONLY = ("/proc/",)  # procfs: /proc/self/smaps, /proc/meminfo, ...


def _readers(src: str, tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Module-level functions that read a Linux-only source, directly or through another such function."""
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    readers = {k for k, n in funcs.items() if any(s in ast.get_source_segment(src, n) for s in LINUX_ONLY)}
    grew = True
    while grew:
        calls = {k for k, n in funcs.items() if any(isinstance(c, ast.Name) and c.id in readers for c in ast.walk(n))}
        grew = not calls <= readers
        readers |= calls
    return {k: funcs[k] for k in readers}


def _guarded(src: str, fn: ast.FunctionDef) -> bool:
    """``fn`` carries ``pytest.mark.skipif(<condition naming the Linux-only path>, reason=...)``."""
    for d in fn.decorator_list:
        text = ast.get_source_segment(src, d)
        if isinstance(d, ast.Call) and text.startswith("pytest.mark.skipif") and d.args and \
                any(s in ast.get_source_segment(src, d.args[0]) for s in LINUX_ONLY) and \
                any(k.arg == "reason" for k in d.keywords):
            return True
    return False


def test_linux_only_reads_are_guarded():
    """Every test that reads /proc (itself or through a helper) is skipped, with a reason, where that path is absent."""
    unguarded = []
    for path in sorted(TESTS.glob("test_*.py")):
        src = path.read_text()
        for name, fn in _readers(src, ast.parse(src)).items():
            if name.startswith("test_") and not _guarded(src, fn):
                unguarded.append(f"{path.name}::{name}")
    assert not unguarded, f"tests reading {LINUX_ONLY} without a skipif on that path: {unguarded}"
