"""The package is a house of floors: every import goes down (or stays on its floor), there are no import circles,
only the model math's own users reach into ``layers/`` and ``ops/``, only ``ops/`` knows Metal, the CLI starts
without mlx-lm (which imports transformers), and the functions of the math, caches, generation and server stay short
(at most ``MAX_FUNCTION_LINES``).

Imports are read with ``ast`` from every module of the installed package (``kimi_mlx.convert`` and
``kimi_mlx.metal_kernels`` included), at module level and inside functions; ``from . import x`` counts as an import
of the submodule ``x`` when there is one. Imports by computed name (``importlib.import_module``: the package's
``__init__`` and ``cli/main.py``, both on the top floor) are not seen.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kimi_mlx

# Floors, top to bottom (README "What is inside"): a module may import from its own floor and the floors below.
# Keyed by the first name under ``kimi_mlx`` ("" is the package's own ``__init__``: the public face).
FLOORS = {
    "": 5, "cli": 5,
    "server": 4,
    "loading": 3, "demo": 3, "parallel": 3, "tuner": 3,
    "models": 2, "vision": 2,
    "layers": 1, "generate": 1, "speculative": 1, "image_prompt": 1, "sampling": 1, "text_stream": 1, "chat": 1,
    "ops": 0, "convert": 0, "cache": 0, "prompt_cache": 0, "config": 0, "tokenizer": 0, "validation": 0,
    "metal": 0, "metal_kernels": 0, "data": 0,
}
# The model math: reached through models/, or by the modules that rebuild a built model's layers (loading's GGML
# layers, parallel/shard's splits, tuner's adapters) or count their bytes (parallel/accounting).
# ``ops.memory`` (the GPU working set) and ``ops.latent`` (the latent cache's storage type, which the cache keeps
# and attention reads) are not model math.
MATH = ("kimi_mlx.layers", "kimi_mlx.ops")
NOT_MATH = ("kimi_mlx.ops.memory", "kimi_mlx.ops.latent")
MATH_USERS = ("kimi_mlx.models", "kimi_mlx.layers", "kimi_mlx.ops", "kimi_mlx.loading", "kimi_mlx.parallel.shard",
              "kimi_mlx.parallel.accounting", "kimi_mlx.tuner")
METAL_USERS = ("kimi_mlx.ops", "kimi_mlx.metal")


def _package_files() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``) for every ``.py`` of the installed package. Sub-packages that
    the install maps from elsewhere (``kimi_mlx.convert`` from ``convert/`` in a source checkout) are found by their
    import spec, without running them."""
    roots = {"kimi_mlx": Path(kimi_mlx.__file__).parent}
    for name in FLOORS:
        if name and not (roots["kimi_mlx"] / name).exists() and not (roots["kimi_mlx"] / f"{name}.py").exists():
            spec = importlib.util.find_spec(f"kimi_mlx.{name}")
            assert spec is not None and spec.submodule_search_locations, f"kimi_mlx.{name} is in FLOORS but not found"
            roots[f"kimi_mlx.{name}"] = Path(list(spec.submodule_search_locations)[0])
    files = {}
    for package, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            files[".".join([package, *parts[:-1]] if is_init else [package, *parts])] = (path, is_init)
    return files


def _imports(files: dict[str, tuple[Path, bool]]) -> set[tuple[str, str]]:
    """``(importer, imported)`` for every import of a ``kimi_mlx`` module, at any depth of the importer's code."""
    edges = set()
    for name, (path, is_init) in files.items():
        package = name if is_init else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {(name, t) for t in targets if t == "kimi_mlx" or t.startswith("kimi_mlx.")}
    return edges


def _floor(module: str) -> int:
    key = module.split(".")[1] if module != "kimi_mlx" else ""
    assert key in FLOORS, f"{module}: no floor in FLOORS (give the new module or package a floor)"
    return FLOORS[key]


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(edges: set[tuple[str, str]]) -> list[str]:
    """Upward imports, reaches into the model math, Metal outside ops/, then every import circle (one line each)."""
    out = []
    for a, b in sorted(edges):
        if _floor(b) > _floor(a):
            out.append(f"upward: {a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})")
        if _under(b, MATH) and not _under(b, NOT_MATH) and not _under(a, MATH_USERS):
            out.append(f"reach: {a} imports the model math {b} (go through models/ or the floor that owns the job)")
        if _under(b, ("kimi_mlx.metal",)) and not _under(a, METAL_USERS):
            out.append(f"metal: {a} imports {b} (only ops/ knows Metal)")
    out += [f"circle: {' -> '.join(c)}" for c in _circles(edges)]
    return out


def _circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Each strongly connected group of two or more modules (or a module importing itself), as a closed path."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(sorted(group) + [sorted(group)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


@pytest.fixture(scope="module")
def edges() -> set[tuple[str, str]]:
    return _imports(_package_files())


def test_every_module_has_a_floor():
    """Every module of the installed package sits on a floor of FLOORS (a new top-level module needs one)."""
    files = _package_files()
    assert len(files) > 50
    for name in files:
        _floor(name)


def test_no_upward_imports_and_no_circles(edges):
    """No import goes up a floor, reaches into layers/ or ops/ from outside their users, or names Metal outside
    ops/; no circles."""
    assert _violations(edges) == []


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The checker itself: an import inside a method, resolved from ``from . import x``, is an upward import; a
    reach into layers/ and a circle are reported."""
    source = tmp_path / "tokenizer.py"
    source.write_text("class T:\n    def f(self):\n        from .chat import format\n        from . import config\n")
    empty = tmp_path / "empty.py"
    empty.write_text("")
    files = {"kimi_mlx.tokenizer": (source, False), "kimi_mlx.chat.format": (empty, False),
             "kimi_mlx.config": (empty, False)}
    edges = _imports(files)
    assert edges == {("kimi_mlx.tokenizer", "kimi_mlx.chat.format"), ("kimi_mlx.tokenizer", "kimi_mlx.config")}
    edges |= {("kimi_mlx.chat.a", "kimi_mlx.chat.b"), ("kimi_mlx.chat.b", "kimi_mlx.chat.a"),
              ("kimi_mlx.cli.convert", "kimi_mlx.layers.ggml")}
    assert _violations(edges) == [
        "reach: kimi_mlx.cli.convert imports the model math kimi_mlx.layers.ggml (go through models/ or the floor "
        "that owns the job)",
        "upward: kimi_mlx.tokenizer (floor 0) imports kimi_mlx.chat.format (floor 1)",
        "circle: kimi_mlx.chat.a -> kimi_mlx.chat.b -> kimi_mlx.chat.a",
    ]


# Where every function stays short (the math, the caches, the generation loop, the HTTP layer): at most this many
# lines from ``def`` to its last line, docstring included (a nested function counts on its own and in its parent).
SHORT = ("kimi_mlx.models", "kimi_mlx.layers", "kimi_mlx.ops", "kimi_mlx.cache", "kimi_mlx.generate",
         "kimi_mlx.sampling", "kimi_mlx.text_stream", "kimi_mlx.server")
MAX_FUNCTION_LINES = 60


def _long_functions(files: dict[str, tuple[Path, bool]], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (n lines)`` for every function of a ``SHORT`` module longer than ``limit`` lines."""
    out = []
    for name, (path, _) in sorted(files.items()):
        if not _under(name, SHORT):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_functions_are_short():
    """No function in models/, layers/, ops/, cache.py, generate.py, sampling.py, text_stream.py or server/ is
    over ``MAX_FUNCTION_LINES`` lines: a longer one is split into named steps."""
    long = _long_functions(_package_files())
    assert not long, f"{len(long)} functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_length_check_counts_from_def_to_the_last_line(tmp_path):
    """The checker itself: a function of 61 lines in a ``SHORT`` module is reported, one of 60 is not, nor a long
    one outside ``SHORT``."""
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    source = tmp_path / "cache.py"
    source.write_text(f"def fits():\n{body}\n\nasync def too_long():\n{body}    return x0\n")
    files = {"kimi_mlx.cache": (source, False), "kimi_mlx.config": (source, False)}
    assert _long_functions(files) == [f"{source}:63 too_long (61 lines)"]


HEAVY = ("mlx_lm", "transformers")


def _modules_after(code: str) -> list[str]:
    """The heavy top-level modules imported by running ``code`` in a fresh interpreter (SystemExit tolerated)."""
    script = (f"import json, sys\ntry:\n    {code}\nexcept SystemExit:\n    pass\n"
              f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_and_cli_help_do_not_import_mlx_lm():
    """``import kimi_mlx`` and ``kimi-mlx --help`` import neither mlx-lm nor transformers (each costs most of a
    second); mlx-lm is imported where a model is built or generated with."""
    assert _modules_after("import kimi_mlx") == []
    assert _modules_after("from kimi_mlx.cli.main import main; main(['--help'])") == []
