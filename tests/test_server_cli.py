"""``kimi-mlx serve`` as a process: Ctrl-C (SIGINT) or SIGTERM after serving ends it cleanly through its exit path
(the "stopped" line is logged after it synchronizes MLX), exit status 0, no traceback and no abort from MLX at
interpreter exit (MLX 0.32 aborts when compiled CPU kernels ran only on other threads)."""

import signal

import httpx2 as httpx
import pytest
from serve_helpers import Server


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_shuts_down_cleanly(tmp_path, sig):
    with Server(["--model", "demo"], tmp_path, tmp_path / "home") as server:
        r = httpx.post(server.url + "/completions", json={"prompt": "Hello there", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        server.proc.send_signal(sig)
        assert server.proc.wait(timeout=30) == 0, server.log()
    log = server.log()
    assert "Traceback" not in log and "terminate called" not in log, log
    assert log.rstrip().endswith("kimi-mlx serve: stopped"), log
