"""Per-module profile of one LoRA training step (forward + backward), on the Kimi Linear and Kimi-K3 bench models.

The model and LoRA are ``bench_lora.py``'s (rank 8 on every projection of every decoder layer incl. the router and
the routed experts; float32; batch 1 of ``--tokens`` random tokens). Each repeat (after one warm-up) runs:

- the whole step: ``kimi_mlx.tuner.trainer.make_step`` (what ``kimi-mlx lora`` runs: value_and_grad of the loss over
  the trainable parameters), evaluated once, then the Adam update on its gradients (``compiled_update``, the step's;
  also ``optimizer.update`` uncompiled, for comparison);
- the step module by module: one forward pass records every module call's inputs, then each call is timed twice on
  its recorded inputs: its forward alone, and its forward + backward (``mx.value_and_grad`` of ``sum(out * c)``
  over the call's trainable (LoRA) parameters and its floating-point array inputs, c a fixed random cotangent of the
  first output), each evaluated before the next call starts; plus the head (final norm, lm_head, cross-entropy; its
  gradient w.r.t. the hidden state) and the optimizer update on the step's gradients.

Rows are summed over the layers (the number of calls in brackets). Indented rows are parts of the row above them
(their time is included in it): the KDA core (short conv, gates, chunked scan, gated RMSNorm: everything between
the input projections and o_proj) and the MoE's routed experts and shared expert. ``rest`` = whole step minus the
top-level rows: the embedding, the residual adds, the layer norms, the backward through the AttnRes snapshots'
inverse RMS, building the graph in Python. Medians over ``--repeats``; spread min-max; also process CPU time.

``--variant NAME`` also runs another behaviour of the step (``VARIANTS``) interleaved with the current one in every
repeat and prints the whole step's ratio variant / current (the per-module rows are the current code's). After the
table: the step's peak memory and page faults after ``mx.clear_cache`` (``bench_lora.py`` clears the cache before
every step), the forward's peak, and the peak with the routed experts on ``SwitchGLU``.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/profile_lora.py
    LD_PRELOAD=... python bench/profile_lora.py --arch kimi_k3 --tokens 512 --repeats 3
    LD_PRELOAD=... python bench/profile_lora.py --arch kimi_k3 --variant switchglu-experts
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora import bench_paths, kimi_lora  # noqa: E402
from bench_vs_mlx_lm import blas_in_use, describe  # noqa: E402

from kimi_mlx.layers import kda as kda_layer  # noqa: E402
from kimi_mlx.layers import moe as moe_layer  # noqa: E402
from kimi_mlx.layers.kda import KimiDeltaAttention  # noqa: E402
from kimi_mlx.layers.mla import KimiMLA  # noqa: E402
from kimi_mlx.layers.moe import MLP, SparseMoE  # noqa: E402
from kimi_mlx.layers.residual import ResidualMix  # noqa: E402
from kimi_mlx.tuner.trainer import compiled_update, make_step  # noqa: E402

# (class or (module, function name), row, parent row or None). A call made inside a recorded call of another row is
# recorded only if its parent is the row it is listed under (the shared expert is an MLP inside the MoE).
RECORDED = [
    (KimiDeltaAttention, "KDA", None),
    ((kda_layer, "_kda_core"), "KDA core (conv, gates, scan, norm)", "KDA"),
    (KimiMLA, "MLA", None),
    (SparseMoE, "MoE", None),
    ((moe_layer, "switch_glu"), "MoE routed experts", "MoE"),
    (MLP, "MoE shared expert", "MoE"),
    (MLP, "dense MLP", None),
    (ResidualMix, "AttnRes mix", None),
]
ROW_ORDER = ["KDA", "KDA core (conv, gates, scan, norm)", "MLA", "MoE", "MoE routed experts", "MoE shared expert",
             "dense MLP", "AttnRes mix", "head (norm, lm_head, loss)", "optimizer update", "rest"]
TOP_LEVEL = ["KDA", "MLA", "MoE", "dense MLP", "AttnRes mix", "head (norm, lm_head, loss)", "optimizer update"]


# ------------------------------------------------------------------------------------------------- recording
class Recorder:
    """While active (``with``), the ``RECORDED`` modules and functions append ``(row, fn, args, kwargs)`` for each
    call (``fn`` the unpatched callable) to ``calls``."""

    def __init__(self):
        self.calls: list[tuple[str, object, tuple, dict]] = []
        self.stack: list[str] = []
        self.undo = []

    def wrap(self, fn, rows: dict):
        def call(*args, **kwargs):
            parent = self.stack[-1] if self.stack else None
            row = rows.get(parent)
            if row is None:
                return fn(*args, **kwargs)
            self.calls.append((row, fn, args, kwargs))
            self.stack.append(row)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()

        return call

    def __enter__(self):
        targets = defaultdict(dict)  # target -> {parent row: row}
        for target, row, parent in RECORDED:
            targets[target][parent] = row
        for target, rows in targets.items():
            obj, attr = (target, "__call__") if isinstance(target, type) else target
            fn = getattr(obj, attr)
            self.undo.append((obj, attr, fn))
            setattr(obj, attr, self.wrap(fn, rows))
        return self

    def __exit__(self, *exc):
        for obj, attr, fn in reversed(self.undo):
            setattr(obj, attr, fn)
        self.undo.clear()


def _split(tree):
    """The floating-point arrays of a tree of tuples / NamedTuples / lists / dicts -> (arrays, rebuild(arrays))."""
    leaves = []

    def walk(x):
        if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating):
            leaves.append(x)
            return lambda it: next(it)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            parts = [walk(v) for v in x]
            return lambda it: type(x)(*[p(it) for p in parts])
        if isinstance(x, (tuple, list)):
            parts = [walk(v) for v in x]
            return lambda it: type(x)(p(it) for p in parts)
        if isinstance(x, dict) and not isinstance(x, nn.Module):  # a module's weights: its trainable ones
            parts = {k: walk(v) for k, v in x.items()}
            return lambda it: {k: p(it) for k, p in parts.items()}
        return lambda it: x

    build = walk(tree)
    return leaves, lambda arrays: build(iter(arrays))


def first_output(out) -> mx.array:
    """The first array of a call's output (the one the rest of the step reads in training)."""
    return out if isinstance(out, mx.array) else out[0]


def timed_call(fn, args: tuple, kwargs: dict):
    """(forward(), forward_backward()) for one recorded call: both return arrays to evaluate."""
    modules = [a for a in args if isinstance(a, nn.Module)]
    arrays, rebuild = _split((args, kwargs))
    cot = mx.random.normal(first_output(fn(*args, **kwargs)).shape, key=mx.random.key(7)) * 1e-2
    mx.eval(cot)

    def loss(params, arrays):
        for m, p in zip(modules, params):
            m.update(p)
        a, kw = rebuild(arrays)
        y = first_output(fn(*a, **kw))
        return (y.astype(mx.float32) * cot).sum()

    grad = mx.value_and_grad(loss, argnums=(0, 1))

    def forward():
        return fn(*args, **kwargs)

    def forward_backward():
        params = [m.trainable_parameters() for m in modules]
        value, grads = grad(params, arrays)
        for m, p in zip(modules, params):  # leave the modules holding their own arrays, not the traced ones
            m.update(p)
        return value, grads

    return forward, forward_backward


def text_parts(model):
    """(the text model (``.norm``, ``.layers``), the module holding ``lm_head`` / ``embed_tokens``)."""
    lm = model.language_model if "language_model" in model else model
    return lm.model, lm


def head_loss(model, targets: mx.array):
    """h [1, T, hidden] (the text model's hidden state before its final norm) -> mean cross-entropy of the logits."""
    text, lm = text_parts(model)

    def fn(h):
        x = text.norm(h)
        logits = lm.lm_head(x) if "lm_head" in lm else text.embed_tokens.as_linear(x)
        return nn.losses.cross_entropy(logits.astype(mx.float32), targets).mean()

    return fn


def record_step(model, batch: mx.array):
    """One recorded forward of the batch's inputs: (calls, h before the final norm)."""
    text, _ = text_parts(model)
    hidden = {}
    norm_cls = type(text.norm)
    original = norm_cls.__call__

    def norm_call(self, x):
        if self is text.norm:
            hidden["h"] = x
        return original(self, x)

    norm_cls.__call__ = norm_call
    try:
        with Recorder() as rec:
            mx.eval(model(batch[:, :-1]))
    finally:
        norm_cls.__call__ = original
    mx.eval(hidden["h"])
    return rec.calls, hidden["h"]


# ------------------------------------------------------------------------------------------------- timing
def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn()`` evaluated."""
    t0, c0 = time.perf_counter(), time.process_time()
    mx.eval(fn())
    return time.perf_counter() - t0, time.process_time() - c0


class Profile:
    """Rows' per-repeat seconds: ``wall`` / ``cpu`` of the forward + backward, ``fwd_cpu`` of the forward alone."""

    def __init__(self):
        self.wall, self.cpu, self.fwd_cpu = defaultdict(list), defaultdict(list), defaultdict(list)
        self.counts: dict[str, int] = {}

    def add(self, samples: dict[str, tuple[float, float, float]]) -> None:
        """samples: row -> (forward CPU, forward + backward wall, forward + backward CPU) of one repeat."""
        for row, (f, w, c) in samples.items():
            self.fwd_cpu[row].append(f)
            self.wall[row].append(w)
            self.cpu[row].append(c)


def profile_once(model, calls, h, targets, prof: Profile) -> None:
    """One repeat of the module-by-module step (adds one sample to every row)."""
    samples = defaultdict(lambda: [0.0, 0.0, 0.0])
    counts = defaultdict(int)
    for row, fn, args, kwargs in calls:
        forward, forward_backward = timed_call(fn, args, kwargs)
        samples[row][0] += timed(forward)[1]
        w, c = timed(forward_backward)
        samples[row][1] += w
        samples[row][2] += c
        counts[row] += 1
    head = head_loss(model, targets)
    row = "head (norm, lm_head, loss)"
    samples[row][0] = timed(lambda: head(h))[1]
    samples[row][1:] = timed(lambda: mx.value_and_grad(head)(h))
    counts[row] = 1
    prof.add(samples)
    prof.counts = dict(counts)


def memory_probe(model, step, batch, lengths) -> None:
    """Prints the peak memory of one step (after ``mx.clear_cache``, as ``bench_lora.py`` runs it) and its minor page
    faults and system CPU time, then two references: the forward alone (mlx-lm's ``default_loss``), and the step
    with the routed experts on ``SwitchGLU`` (no host read of the per-expert counts inside ``value_and_grad``)."""
    import ctypes
    import resource

    from mlx_lm.tuner.trainer import default_loss

    def peak(fn) -> tuple[float, int, float]:
        mx.eval(fn())
        mx.clear_cache()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        mx.reset_peak_memory()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        mx.eval(fn())
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        return mx.get_peak_memory() / 2**30, r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime

    whole, faults, sys_s = peak(lambda: step(batch, lengths, None, False))
    fwd = peak(lambda: default_loss(model, batch, lengths))[0]
    with patched(VARIANTS["switchglu-experts"]):
        gather = peak(lambda: step(batch, lengths, None, False))[0]
    print(f"\npeak memory: step {whole:.2f} GiB ({faults} minor page faults, {sys_s:.2f} s system CPU after "
          f"mx.clear_cache); forward alone {fwd:.2f} GiB; step with the routed experts on SwitchGLU (no host read "
          f"inside value_and_grad) {gather:.2f} GiB")


# ------------------------------------------------------------------------------------------------- main
def _switchglu_experts():
    """The routed experts on mlx-lm's ``SwitchGLU`` (``gather_mm``) at every size: no host read of the per-expert
    counts inside ``value_and_grad`` (what a compiled step would run)."""
    from functools import partial

    return moe_layer, "switch_glu", partial(moe_layer.switch_glu, min_pairs=1 << 62)


VARIANTS = {  # --variant NAME: () -> (object, attribute, replacement) for another behaviour of the step
    "switchglu-experts": _switchglu_experts,
}


class patched:
    """``with patched(VARIANTS[name]):`` the step runs that behaviour; None: unchanged."""

    def __init__(self, variant):
        self.variant, self.undo = variant, None

    def __enter__(self):
        if self.variant:
            obj, attr, repl = self.variant()
            self.undo = (obj, attr, getattr(obj, attr))
            setattr(obj, attr, repl)

    def __exit__(self, *exc):
        if self.undo:
            setattr(*self.undo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["kimi_linear", "kimi_k3"], default="kimi_linear")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after one warm-up")
    ap.add_argument("--variant", choices=sorted(VARIANTS),
                    help="also run another behaviour's whole step, interleaved, and print variant / current")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("KIMI_BENCH_CACHE", Path.home() / ".cache" / "kimi_mlx_bench")))
    args = ap.parse_args(argv)

    print(f"BLAS: {blas_in_use()}")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, CPUs {os.cpu_count()}, float32, {args.tokens} tokens, "
          f"{args.repeats} repeats after 1 warm-up")
    path, text_config = bench_paths(args.cache_dir)[args.arch]
    model = kimi_lora(path)
    model.train()
    print(f"{args.arch}: {describe(text_config)}; trainable parameters "
          f"{sum(v.size for _, v in tree_flatten(model.trainable_parameters())) / 1e6:.2f} M")
    T = args.tokens
    vocab = text_config["vocab_size"]
    batch = mx.random.randint(0, vocab, (1, T + 1), key=mx.random.key(T))
    lengths = mx.array([[0, T + 1]])
    targets = batch[:, 1:]

    opt = optim.Adam(learning_rate=1e-5)
    step = make_step(model, opt)
    variants = [("current", None)] + ([(args.variant, VARIANTS[args.variant])] if args.variant else [])
    whole = {name: ([], []) for name, _ in variants}
    prof = Profile()
    update = compiled_update(model, opt)  # the step's update (make_step's), timed alone
    update_times, update_cpu, plain_cpu = [], [], []
    calls, h = record_step(model, batch)
    for i in range(args.repeats + 1):
        for name, patch in variants if i % 2 else variants[::-1]:
            with patched(patch):
                w, c = timed(lambda: step(batch, lengths, None, False))
            if i:
                whole[name][0].append(w)
                whole[name][1].append(c)
        # the update alone, on one step's gradients (the whole step above does not update: do_update False)
        _, _, grads = step(batch, lengths, None, False)
        mx.eval(grads)
        w, c = timed(lambda: (update(grads), model.trainable_parameters(), opt.state)[1:])
        plain_cpu.append(timed(lambda: (opt.update(model, grads), model.trainable_parameters(), opt.state)[1:])[1])
        profile_once(model, calls, h, targets, prof if i else Profile())  # the warm-up is not kept
        if i:
            update_times.append(w)
            update_cpu.append(c)
            print(f"  repeat {i}: whole step (forward + backward) " + "; ".join(
                f"{n} {whole[n][0][-1]:.2f} s" for n, _ in variants) + f"; update {w * 1e3:.0f} ms", flush=True)
        else:
            print(f"  warm-up: {len(calls)} module calls recorded", flush=True)
    prof.wall["optimizer update"], prof.cpu["optimizer update"] = update_times, update_cpu
    prof.counts["optimizer update"] = 1
    cur_w, cur_c = whole["current"]
    step_w = [s + u for s, u in zip(cur_w, update_times)]
    step_c = [s + u for s, u in zip(cur_c, update_cpu)]
    for k, (sw, sc) in enumerate(zip(step_w, step_c)):
        prof.wall["rest"].append(sw - sum(prof.wall[r][k] for r in TOP_LEVEL if r in prof.wall))
        prof.cpu["rest"].append(sc - sum(prof.cpu[r][k] for r in TOP_LEVEL if r in prof.cpu))
    total = statistics.median(step_c)

    print(f"\nwhole step (value_and_grad + Adam update): {total * 1e3:.0f} ms CPU "
          f"({min(step_c) * 1e3:.0f}-{max(step_c) * 1e3:.0f}), {statistics.median(step_w) * 1e3:.0f} ms wall "
          f"({min(step_w) * 1e3:.0f}-{max(step_w) * 1e3:.0f}); {T / statistics.median(step_w):.0f} tok/s")
    print("| module (calls) | forward CPU ms | forward + backward CPU ms | spread | wall ms | backward / forward "
          "| % of step (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in ROW_ORDER:
        if row not in prof.cpu:
            continue
        v = prof.cpu[row]
        med = statistics.median(v)
        f = statistics.median(prof.fwd_cpu[row]) if prof.fwd_cpu.get(row) else None
        name = ("&nbsp;&nbsp;" if row not in TOP_LEVEL and row != "rest" else "") + row
        n = f" ({prof.counts[row]})" if row in prof.counts else ""
        fwd = f"{f * 1e3:.0f}" if f else "-"
        ratio = f"{(med - f) / f:.1f}" if f else "-"
        print(f"| {name}{n} | {fwd} | {med * 1e3:.0f} | {min(v) * 1e3:.0f}-{max(v) * 1e3:.0f} | "
              f"{statistics.median(prof.wall[row]) * 1e3:.0f} | {ratio} | {100 * med / total:.1f}% |")
    print(f"optimizer update: {statistics.median(update_cpu) * 1e3:.0f} ms CPU compiled (the step's), "
          f"{statistics.median(plain_cpu[1:]) * 1e3:.0f} ms as optimizer.update (uncompiled), same repeats")
    memory_probe(model, step, batch, lengths)
    if args.variant:
        var_w, var_c = whole[args.variant]
        print(f"\nwhole step forward + backward, {args.variant} / current: CPU "
              f"{statistics.median(v / c for v, c in zip(var_c, cur_c)):.2f} ({statistics.median(var_c) * 1e3:.0f} vs "
              f"{statistics.median(cur_c) * 1e3:.0f} ms), wall {statistics.median(v / c for v, c in zip(var_w, cur_w)):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
