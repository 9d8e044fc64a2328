"""One LoRA training step, kimi-mlx vs mlx-lm, on the small Kimi Linear and Kimi-K3 bench models.

Same checkpoint (bench_vs_mlx_lm.py / bench_k3_vs_mlx_lm.py build it once into the cache dir), same float32 weights,
same LoRA (rank 8, scale 20, mlx-lm's defaults, on every linear layer of every decoder layer incl. the router and a
per-expert LoRA on the routed experts; K3: not on the AttnRes projections, which mlx-lm 0.32.2 cannot wrap), the
same initial adapter values (copied from ours into mlx-lm's), the same random tokens and Adam, on the same BLAS.

- kimi-mlx: ``kimi_mlx.tuner.trainer.make_step`` (what ``kimi-mlx lora`` runs: uncompiled value_and_grad, chunked
  KDA, dense-per-expert MoE);
- mlx-lm: the step of ``mlx_lm.tuner.trainer.train`` (``mx.compile`` over value_and_grad + optimizer update, as
  ``mlx_lm.lora`` runs it).

Each round times one step of each implementation back to back (after one warm-up round that compiles); the table
shows medians and the median per-round ratio. Run with OpenBLAS preloaded (see bench/README.md):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_lora.py
    python bench/bench_lora.py --sizes 256 --archs kimi_linear --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_k3_vs_mlx_lm as k3_bench  # noqa: E402
from bench_vs_mlx_lm import (  # noqa: E402
    CONFIG,
    KEEP_F32,
    SEED,
    blas_in_use,
    checkpoint_dir,
    describe,
    load_kimi,
    load_mlx_lm,
)

from kimi_mlx.tuner.adapters import ADAPTER_TYPES  # noqa: E402

RANK, SCALE = 8, 20.0


def bench_paths(cache: Path) -> dict[str, tuple[Path, dict]]:
    """{arch: (checkpoint dir, text config)} for the two bench models."""
    k3 = checkpoint_dir(cache, k3_bench.CONFIG, k3_bench.make_k3_checkpoint, "kimi_k3_bench", SEED,
                        KEEP_F32 + ("o_norm.weight",))
    return {"kimi_linear": (checkpoint_dir(cache), CONFIG), "kimi_k3": (mlx_lm_layout(k3), k3_bench.TEXT_CONFIG)}


def mlx_lm_layout(src: Path) -> Path:
    """The K3 checkpoint converted once by ``kimi-mlx convert`` into mlx-lm's layout (KDA q/k/v fused into
    ``qkv_proj``, as mlx-lm's kimi_k3 holds them), so that both sides have the same projections to adapt."""
    from types import SimpleNamespace

    from kimi_mlx.cli.convert import convert

    out = src.with_name(src.name + "_mlx_layout")
    if not (out / "config.json").exists():
        convert(SimpleNamespace(model=str(src), out=str(out), quantize=None, q_group_size=64, dtype=None,
                                requantize=False, gguf_scales="float32", force=True, max_shard_gb=5.0, quiet=True))
    return out


def kimi_lora(path: Path):
    from kimi_mlx.tuner.adapters import PROJECTION_GROUPS, apply_adapters, select_modules

    model = load_kimi(path, mx.float32)
    groups = [g for g in PROJECTION_GROUPS if g != "attn_res"]
    mx.random.seed(0)
    apply_adapters(model, list(select_modules(model, groups)), rank=RANK, scale=SCALE)
    return model


def mlx_lm_lora(path: Path, ours):
    """mlx-lm's model with LoRA on the same projections, its adapters set to ours' initial values."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = load_mlx_lm(path, mx.float32)
    model.freeze()
    keys = set()
    for layer in model.layers:
        for k, m in layer.named_modules():
            if isinstance(m, (nn.Linear, nn.QuantizedLinear)) or type(m).__name__.endswith("SwitchLinear"):
                if not k.endswith("res_proj"):
                    keys.add(k)
    linear_to_lora_layers(model, len(model.layers), {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": keys})
    theirs = dict(tree_flatten(model.trainable_parameters()))
    mine = dict(tree_flatten(ours.trainable_parameters()))
    if theirs.keys() != mine.keys():
        raise SystemExit(f"adapter sets differ: only mlx-lm {sorted(theirs.keys() - mine.keys())[:5]}, only kimi-mlx "
                         f"{sorted(mine.keys() - theirs.keys())[:5]}")
    model.load_weights(list(mine.items()), strict=False)
    mx.eval(model.parameters())
    return model


def kimi_step(model):
    from kimi_mlx.tuner.trainer import make_step

    opt = optim.Adam(learning_rate=1e-5)
    step = make_step(model, opt)

    def run(batch, lengths):
        lvalue, toks, _ = step(batch, lengths, None, True)
        mx.eval(model.trainable_parameters(), opt.state, lvalue, toks)
        return lvalue.item()

    return run


def mlx_lm_step(model):
    """mlx_lm.tuner.trainer.train's compiled step (gradient accumulation 1, one process)."""
    from mlx_lm.tuner.trainer import default_loss

    opt = optim.Adam(learning_rate=1e-5)
    loss_value_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch, lengths):
        (lvalue, toks), grad = loss_value_and_grad(model, batch, lengths)
        opt.update(model, grad)
        return lvalue, toks

    def run(batch, lengths):
        lvalue, toks = step(batch, lengths)
        mx.eval(state, lvalue, toks)
        return lvalue.item()

    run.model = model
    return run


def release_memory() -> None:
    """Drop MLX's buffer cache and hand freed heap pages back to the OS (glibc keeps them otherwise)."""
    import ctypes

    mx.clear_cache()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def worker(conn, impl: str, path: str, limit_gb: float) -> None:
    """One implementation in its own process under an address-space cap (an out-of-memory step fails there with an
    error instead of waking the machine's OOM killer): loads the model with LoRA, then answers each ``T`` received
    with one timed step ``(seconds, loss, peak bytes)``, or an error string."""
    import resource

    cap = int(limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    ours = kimi_lora(Path(path))
    run = kimi_step(ours) if impl == "kimi-mlx" else mlx_lm_step(mlx_lm_lora(Path(path), ours))
    if impl != "kimi-mlx":
        del ours
    conn.send(sum(isinstance(m, ADAPTER_TYPES) for _, m in (ours if impl == "kimi-mlx" else run.model).named_modules()))
    vocab = json.loads((Path(path) / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    while (T := conn.recv()) is not None:
        try:
            batch = mx.random.randint(0, vocab, (1, T + 1), key=mx.random.key(T))
            lengths = mx.array([[0, T + 1]])
            mx.clear_cache()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            loss = run(batch, lengths)
            out = (time.perf_counter() - t0, loss, mx.get_peak_memory())
            release_memory()  # an idle worker holds only its model while the other one runs
            conn.send(out)
        except (RuntimeError, MemoryError) as e:  # MLX reports a failed allocation as a RuntimeError
            release_memory()
            conn.send(f"{type(e).__name__}: {str(e)[:120]}")


def main(argv=None) -> int:
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024], help="tokens per step (batch 1)")
    ap.add_argument("--archs", nargs="+", default=["kimi_linear", "kimi_k3"], choices=["kimi_linear", "kimi_k3"])
    ap.add_argument("--runs", type=int, default=2, help="timed rounds per size (median), after 1 warm-up round")
    ap.add_argument("--mem-limit-gb", type=float, default=10.0,
                    help="address-space cap per implementation's process (a step above it fails and is reported)")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("KIMI_BENCH_CACHE", Path.home() / ".cache" / "kimi_mlx_bench")))
    args = ap.parse_args(argv)

    print(f"BLAS: {blas_in_use()}")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, CPUs {os.cpu_count()}, float32, LoRA rank {RANK} "
          f"scale {SCALE}, Adam; {args.runs} rounds after 1 warm-up round, implementations alternating, each in its "
          f"own process capped at {args.mem_limit_gb:g} GiB of address space")
    ctx = mp.get_context("spawn")
    rows = []
    paths = bench_paths(args.cache_dir)
    for arch in args.archs:
        path, text_config = paths[arch]
        print(f"\n{arch}: {path}; {describe(text_config)}", flush=True)
        conns, procs = {}, []
        for impl in ("kimi-mlx", "mlx-lm"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(child, impl, str(path), args.mem_limit_gb), daemon=True)
            proc.start()
            child.close()  # so that a worker's death reads as EOF here
            conns[impl] = parent
            procs.append(proc)
        print("  LoRA adapters: " + ", ".join(f"{n} {c.recv()}" for n, c in conns.items()), flush=True)
        for T in args.sizes:
            times = {n: [] for n in conns}
            peaks = {n: 0 for n in conns}
            losses, failed = {}, {}
            for i in range(args.runs + 1):
                for name, conn in conns.items():
                    if name in failed:
                        continue
                    try:
                        conn.send(T)
                        out = conn.recv()
                    except (EOFError, BrokenPipeError):  # e.g. a failed allocation MLX did not catch (SIGSEGV)
                        proc = procs[list(conns).index(name)]
                        proc.join(timeout=10)
                        out = f"worker died (exit code {proc.exitcode}; out of memory under the cap?)"
                    if isinstance(out, str):
                        failed[name] = out
                        print(f"  {name:8s} T={T:5d} round {i}: FAILED ({out})", flush=True)
                        continue
                    dt, loss, peak = out
                    print(f"  {name:8s} T={T:5d} round {i}: {dt:7.2f} s  loss {loss:.4f}  peak {peak / 2**30:.2f} GiB",
                          flush=True)
                    losses.setdefault(name, loss)
                    peaks[name] = max(peaks[name], peak)
                    if i:
                        times[name].append(dt)
            if len(losses) == 2:
                print(f"  first-step loss: kimi-mlx {losses['kimi-mlx']:.5f}, mlx-lm {losses['mlx-lm']:.5f}")
            rows.append((arch, T, times, peaks, failed))
        for name, conn in conns.items():
            if procs[list(conns).index(name)].is_alive():
                conn.send(None)
        for proc in procs:
            proc.join(timeout=60)

    print("\n(medians over the rounds; tokens/s = T / step time; speed-up = median of per-round mlx-lm / kimi-mlx "
          "time, i.e. the tokens/s ratio)")
    print("| model | tokens | kimi-mlx step (s) | mlx-lm step (s) | kimi-mlx tok/s | mlx-lm tok/s | speed-up | "
          "peak GiB kimi-mlx / mlx-lm |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arch, T, times, peaks, failed in rows:
        cells = {}
        for n in ("kimi-mlx", "mlx-lm"):
            if n in failed or not times[n]:
                cells[n] = ("failed", "-", f"> {args.mem_limit_gb:g} (failed)" if n in failed else "-")
            else:
                med = statistics.median(times[n])
                cells[n] = (f"{med:.2f}", f"{T / med:.0f}", f"{peaks[n] / 2**30:.2f}")
        if failed or not all(times.values()):
            ratio = "-"
        else:
            ratio = f"{statistics.median(m / k for k, m in zip(times['kimi-mlx'], times['mlx-lm'])):.2f}x"
        print(f"| {arch} | {T} | {cells['kimi-mlx'][0]} | {cells['mlx-lm'][0]} | {cells['kimi-mlx'][1]} | "
              f"{cells['mlx-lm'][1]} | {ratio} | {cells['kimi-mlx'][2]} / {cells['mlx-lm'][2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
