"""Run a test script on several ``ring`` ranks on localhost under MLX's own launcher, each rank pinned to a core.

    results = run_ranks(CODE, 2, tmp_path)      # one JSON value per rank, from report(...) in CODE

``CODE`` runs with ``group = mx.distributed.init()`` already made and ``report(obj)`` defined (writes this rank's
JSON result). On a machine with fewer cores than ranks, ranks share cores round-robin (``taskset``). Each call uses
its own free port range, so concurrent runs do not collide. ``mlx.launch`` exits 0 even when a rank fails, so a run
counts as failed when any rank reported nothing or the launcher warns that a rank exited non-zero.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

PREAMBLE = """\
import json, os, sys
import mlx.core as mx
group = mx.distributed.init(strict=True)
def report(obj):
    path = os.path.join(os.environ["KIMI_RANK_OUT"], f"rank{group.rank()}.json")
    with open(path, "w") as f:
        json.dump(obj, f)
"""


def _free_port_base(n: int) -> int:
    """A port p with p..p+n-1 free now (the launcher gives rank r port p + r)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range for the ring backend")


def launch_command(n: int, tmp_path: Path, *command: str) -> list[str]:
    """``mlx.launch -n N --backend ring -p PORT -- pin.sh COMMAND``: the launcher line a user would type."""
    pin = tmp_path / "pin.sh"
    pin.write_text(f'#!/bin/bash\nexec taskset -c $((MLX_RANK % {os.cpu_count() or 1})) "$@"\n')
    pin.chmod(0o755)
    launcher = shutil.which("mlx.launch", path=os.path.dirname(sys.executable)) or shutil.which("mlx.launch")
    return [launcher, "-n", str(n), "--backend", "ring", "-p", str(_free_port_base(n)), "--", str(pin), *command]


def _run_group(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (the launcher and every rank: killing
    ``mlx.launch`` alone leaves ranks that wait on each other running), then raise ``TimeoutExpired``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_ranks(code: str, n: int, tmp_path: Path, args=(), timeout: float = 300, check: bool = True):
    """Run ``code`` on ``n`` ranks; return each rank's ``report``ed value (``check=False``: the CompletedProcess)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "rank_script.py"
    script.write_text(PREAMBLE + textwrap.dedent(code))
    env = dict(os.environ, KIMI_RANK_OUT=str(tmp_path))
    cmd = launch_command(n, tmp_path, sys.executable, str(script), *map(str, args))
    proc = _run_group(cmd, timeout, env=env, cwd=tmp_path)
    if not check:
        return proc
    # mlx.launch exits 0 even when a rank fails (it only warns "Node with rank R exited with code C")
    missing = [r for r in range(n) if not (tmp_path / f"rank{r}.json").exists()]
    failed = proc.returncode != 0 or missing or re.search(r"rank \d+ exited with code [1-9]", proc.stderr)
    assert not failed, (f"ranks failed (launcher exit {proc.returncode}, no result from ranks {missing}):\n"
                        f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
