"""A real ``kimi-mlx serve`` process on a free local port, for the server tests (one per test module).

    with Server(["--model", "demo"], cwd=tmp_dir, home=home_dir) as server:
        httpx.get(server.url + "/v1/models")
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``kimi-mlx serve FLAGS --port P`` run from ``cwd`` (never the source tree: the installed package), its
    demo model under ``home``; entering waits until ``/health`` says 200 (the log is in ``cwd/serve.log``)."""

    def __init__(self, flags: list[str], cwd: Path, home: Path, startup_s: float = 90.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        self.log_path = Path(cwd) / "serve.log"
        self.cmd = [sys.executable, "-m", "kimi_mlx.cli.main", "serve", *flags, "--port", str(self.port)]
        self.cwd, self.home, self.startup_s = Path(cwd), Path(home), startup_s
        self.proc = None

    def __enter__(self) -> "Server":
        env = {**os.environ, "KIMI_MLX_HOME": str(self.home)}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_s
        statuses = []
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kimi-mlx serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.base + "/health", timeout=2)
                statuses.append(r.status_code)
                if r.status_code == 200:
                    self.health_statuses = statuses
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"kimi-mlx serve not ready after {self.startup_s} s:\n{self.log()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text()
