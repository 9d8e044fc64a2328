"""One process vs 2 pinned ranks (pipeline, tensor) on the benchmark Kimi Linear: prefill / decode tok/s, bytes each
rank sends per decoded token (counted where kimi-mlx calls send / recv / all_sum, ``parallel.comm.TRAFFIC``) against
``kimi-mlx plan``'s prediction, and peak RSS per rank while loading.

Builds the benchmark checkpoint of ``bench_vs_mlx_lm.py`` (hidden 768, 12 layers, KDA:MLA 3:1, 16 experts; written
once under ``~/.cache/kimi_mlx_bench/``), then runs this file as a worker: alone pinned to core 0 (the anchor), and
under ``mlx.launch -n 2 --backend ring`` with rank r pinned to core r, once per mode. Every worker loads the model
(float32), times ``--runs`` prefills of a ``--prompt``-token prompt and ``--decode`` greedy decode steps (medians).

    python bench/bench_distributed.py                        # prompt 512, 32 decode steps, 3 runs
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_distributed.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("KIMI_BENCH_CACHE", Path.home() / ".cache" / "kimi_mlx_bench"))
MODES = ("pipeline", "tensor")


def peak_rss() -> int:
    """This process's peak resident set in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def worker(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from kimi_mlx import load
    from kimi_mlx.parallel import param_bytes
    from kimi_mlx.parallel.comm import TRAFFIC

    before = peak_rss()
    tic = time.perf_counter()
    parallel = None if args.mode == "single" else args.mode
    model, _ = load(args.path, dtype=mx.float32, parallel=parallel)
    load_s, load_peak = time.perf_counter() - tic, peak_rss()
    group = mx.distributed.init()
    prompt = mx.random.randint(0, 8000, (1, args.prompt), key=mx.random.key(0))
    prefill, cache = [], None
    for _ in range(args.runs + 1):  # the first run warms up
        cache = model.make_cache()
        tic = time.perf_counter()
        logits = model(prompt, cache=cache)
        mx.eval(logits)
        prefill.append(time.perf_counter() - tic)
    y = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(y)
    TRAFFIC.reset()
    decode, tokens = [], []
    for _ in range(args.decode + 1):
        tic = time.perf_counter()
        logits = model(y[:, None], cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(y)
        decode.append(time.perf_counter() - tic)
        tokens.append(y.item())
    steps = args.decode + 1
    out = {
        "rank": group.rank(), "load_s": load_s, "load_rss_growth": load_peak - before, "load_peak_rss": load_peak,
        "param_bytes": param_bytes(model), "prefill_tps": args.prompt / statistics.median(prefill[1:]),
        "decode_tps": 1 / statistics.median(decode[1:]), "tokens": tokens,
        "bytes_per_token": {k: v / steps for k, v in TRAFFIC.bytes.items()},
        "calls_per_token": {k: v / steps for k, v in TRAFFIC.calls.items()},
    }
    Path(args.out, f"{args.mode}-rank{group.rank()}.json").write_text(json.dumps(out))


def with_demo_tokenizer(checkpoint: Path) -> Path:
    """``checkpoint`` (weights + config only) plus the demo model's tokenizer files, as a loadable model directory
    beside it (links; the benchmark never tokenizes text, but ``load`` returns a tokenizer)."""
    from kimi_mlx.demo import demo_model_path

    out = checkpoint.with_name(checkpoint.name + "_with_tokenizer")
    out.mkdir(exist_ok=True)
    for src in [*checkpoint.iterdir(), *(demo_model_path() / f for f in ("tiktoken.model", "tokenizer_config.json"))]:
        if not (out / src.name).exists():
            (out / src.name).symlink_to(src)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned_launch(worker_cmd: list[str], n: int, out: Path) -> list[str]:
    """The command running ``worker_cmd`` on ``n`` ring ranks under mlx.launch, each pinned to its own core (a pin
    script written into ``out``); ``n`` = 1: one process on core 0."""
    if n == 1:
        return ["taskset", "-c", "0", *worker_cmd]
    pin = out / "pin.sh"
    pin.write_text(f'#!/bin/bash\nexec taskset -c $((MLX_RANK % {os.cpu_count()})) "$@"\n')
    pin.chmod(0o755)
    launcher = shutil.which("mlx.launch", path=os.path.dirname(sys.executable)) or "mlx.launch"
    return [launcher, "-n", str(n), "--backend", "ring", "-p", str(_free_port()), "--", str(pin), *worker_cmd]


def run_mode(mode: str, n: int, path: Path, args: argparse.Namespace, out: Path) -> list[dict]:
    """Run the worker for ``mode`` on ``n`` pinned ranks (``n`` = 1: one process on core 0); each rank's result."""
    worker_cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode, "--path", str(path),
                  "--prompt", str(args.prompt), "--decode", str(args.decode), "--runs", str(args.runs),
                  "--out", str(out)]
    proc = subprocess.run(pinned_launch(worker_cmd, n, out), capture_output=True, text=True, timeout=1800)
    files = [out / f"{mode}-rank{r}.json" for r in range(n)]
    if not all(f.exists() for f in files):  # mlx.launch exits 0 even when a rank fails
        sys.exit(f"{mode} on {n} rank(s) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(f.read_text()) for f in files]


def predicted_link_bytes(config: dict, mode: str, n: int) -> float:
    """``kimi-mlx plan``'s bytes sent per decoded token by the busiest rank (float32, equal hosts)."""
    from kimi_mlx.parallel.accounting import account_config
    from kimi_mlx.parallel.cost import Host, plan_pipeline, plan_tensor

    acct = account_config(config, dtype="float32")
    plan = (plan_pipeline if mode == "pipeline" else plan_tensor)(acct, [Host(24)] * n, reserve_gib=1)
    return plan.link_bytes


def sent_bytes(r: dict, n: int) -> float:
    """Bytes a rank puts on its links per token: its sends, plus 2(n-1)/n of each all_sum payload (ring)."""
    b = r["bytes_per_token"]
    return b.get("send", 0.0) + 2 * (n - 1) / n * b.get("all_sum", 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="single", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, str(HERE))
    from bench_vs_mlx_lm import CONFIG, blas_in_use, checkpoint_dir, describe

    path = with_demo_tokenizer(checkpoint_dir(CACHE))
    print(f"BLAS: {blas_in_use()}")
    print(f"model: {describe(CONFIG)}; float32; prompt {args.prompt}, {args.decode} decode steps, medians of "
          f"{args.runs} runs; ranks pinned one per core (ring over localhost)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        single = run_mode("single", 1, path, args, out)[0]
        rows = [("1 process", 1, [single])] + [(m, args.ranks, run_mode(m, args.ranks, path, args, out))
                                               for m in MODES]
    print()
    print("| mode | ranks | prefill tok/s (x 1 process) | decode tok/s (x 1 process) | sent per token, busiest rank: "
          "measured / plan | calls per token | peak RSS while loading per rank (growth) | params per rank |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for name, n, ranks in rows:
        r0 = ranks[0]
        same = all(r["tokens"] == single["tokens"] for r in ranks)
        sent = max(sent_bytes(r, n) for r in ranks)
        plan = predicted_link_bytes(CONFIG, name, n) if n > 1 else 0.0
        calls = ", ".join(f"{k} {v:g}" for k, v in sorted(r0["calls_per_token"].items())) or "-"
        rss = " / ".join(f"{r['load_peak_rss'] / 2**20:.0f} MiB ({r['load_rss_growth'] / 2**20:.0f})" for r in ranks)
        params = " / ".join(f"{r['param_bytes'] / 2**20:.0f} MiB" for r in ranks)
        print(f"| {name}{'' if same else ' (TOKENS DIFFER)'} | {n} | {r0['prefill_tps']:.0f} "
              f"({r0['prefill_tps'] / single['prefill_tps']:.2f}x) | {r0['decode_tps']:.1f} "
              f"({r0['decode_tps'] / single['decode_tps']:.2f}x) | {sent / 1024:.1f} / {plan / 1024:.1f} KiB | {calls} "
              f"| {rss} | {params} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
