"""bench/kernels.py runs every timed path (tiny shapes: emulated kernels on Linux, at the real head dims and latent
rank and held to the launch limits; the real GPU on a Mac) and says so and exits 0 on a machine with neither Metal nor
the emulator flag."""

import subprocess
import sys
from pathlib import Path

from metal_support import EMU_DIR, backend_name

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"


def test_bench_runs_every_path(tmp_path):
    tiny = [
        "--T",
        "1,70",
        "--H",
        "1",
        "--D",
        "32",
        "--K",
        "2",
        "--d",
        "64",
        "--reps",
        "1",
        "--mla-heads",
        "2",
        "--mla-context",
        "40",
        "--mla-decode-contexts",
        "600",
        "--mla-page",
        "256",
        "--ggml-rows",
        "40",
        "--ggml-cols",
        "512",
    ]
    args = tiny if backend_name() == "gpu" else ["--emulator", str(EMU_DIR)]

    r = subprocess.run([sys.executable, str(BENCH), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for row in (
        "kimi-mlx kernels",
        "recurrent kernel",
        "pure MLX",
        "mlx-lm",
        "kimi-mlx kernel",
        "chunked kernels",
        "one SIMD-group",
        "staged sg4",
        "pure expanded",
        "affine 3-bit",
        "split-K kernels",
        "one-pass mla_decode",
        "mx.fast sdpa",
        "MLX GQA-128 yardstick",
    ):
        assert row in r.stdout, r.stdout
    assert "reads of its own outputs 0" in r.stdout, r.stdout  # the prep kernel's traffic header
    assert len([ln for ln in r.stdout.splitlines() if ln.strip().startswith("70 |")]) == 6, r.stdout
    # every timed row is followed by each path's max |output - pure MLX| (bf16 inputs): the paths compute the same op
    parity = [ln.split(":", 1)[1] for ln in r.stdout.splitlines() if "max |output - " in ln]
    assert len(parity) == 11, r.stdout
    assert "split-K ran 2 splits (mla_attention picks 2 splits)" in r.stdout, r.stdout
    for ln in parity:
        for item in ln.split(","):
            name, value = item.rsplit(" ", 1)
            if name.strip().startswith("affine"):  # the lossy requantized alternative: not the same op
                continue
            assert float(value) < 0.05, f"{name.strip()} differs from the pure path by {value}"


def test_bench_without_metal_says_so(tmp_path):
    if backend_name() == "gpu":
        probe = "import mlx.core as mx; mx.set_default_device(mx.cpu); import runpy, sys; sys.argv = ['kernels.py']; "
        cmd = [sys.executable, "-c", probe + f"runpy.run_path({str(BENCH)!r}, run_name='__main__')"]
    else:
        cmd = [sys.executable, str(BENCH)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no Metal GPU" in r.stdout
