"""The LoRA training loop: mlx-lm's batching, loss, evaluation and ``TrainingArgs``, with our own step.

mlx-lm's ``train`` compiles the whole step with ``mx.compile``. Our MoE runs the routed experts (and their per-expert
LoRA) as one dense matmul per expert over its sorted rows, which reads the per-expert counts on the host, which a
compiled function cannot do; inside ``mx.compile`` it falls back to the ``gather_mm`` path, ~2x slower per training
step on the CPU backend. So the step here is ``nn.value_and_grad`` uncompiled (small pieces such as the short conv and
RMSNorm are compiled functions of their own), and the loop around it adds what the CLI promises: a progress bar with loss,
tokens/s and memory, mlx-lm's "Iter N: ..." lines, a metrics jsonl, periodic checkpoints and a loss-curve PNG.
Gradient checkpointing recomputes each mixer and FFN in the backward pass (mlx-lm's patches whole decoder layers,
whose K3 form takes the AttnRes snapshot list, which ``mx.checkpoint`` cannot carry).
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, evaluate, iterate_batches

from ..layers.kda import KimiDeltaAttention
from ..layers.mla import KimiMLA
from ..layers.moe import MLP, SparseMoE
from .adapters import adapter_weights
from .plot import plot_loss_curve

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss_curve.png"
CHECKPOINTED = (KimiDeltaAttention, KimiMLA, SparseMoE, MLP)


@contextmanager
def gradient_checkpointing(enabled: bool = True):
    """While active, every KDA / MLA mixer and MLP / MoE block recomputes its activations in the backward pass
    instead of keeping them (``mx.checkpoint`` over the block's trainable parameters and input ``x``)."""
    if not enabled:
        yield
        return
    originals = {cls: cls.__call__ for cls in CHECKPOINTED}

    def make(fn):
        def call(self, x, *args, **kwargs):
            def inner(params, x):
                self.update(params)
                return fn(self, x, *args, **kwargs)

            return mx.checkpoint(inner)(self.trainable_parameters(), x)

        return call

    try:
        for cls, fn in originals.items():
            cls.__call__ = make(fn)
        yield
    finally:
        for cls, fn in originals.items():
            cls.__call__ = fn


class MetricsLog:
    """Appends one JSON record per report to ``path`` and keeps them for the loss curve."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []
        path.write_text("")

    def write(self, record: dict) -> None:
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def make_step(model: nn.Module, optimizer, loss: Callable = default_loss, grad_accumulation_steps: int = 1):
    """``step(batch, lengths, grad, do_update) -> (loss, n_tokens, grad)``: one forward/backward of ``loss``,
    gradients summed into ``grad`` (None at the start of an accumulation window) and, when ``do_update``, averaged
    over the window and applied by ``optimizer`` (then ``grad`` is None again). Nothing is evaluated here."""
    loss_value_and_grad = nn.value_and_grad(model, loss)

    def step(batch, lengths, grad, do_update: bool):
        (lvalue, toks), g = loss_value_and_grad(model, batch, lengths)
        grad = g if grad is None else tree_map(lambda a, b: a + b, grad, g)
        if do_update:
            if grad_accumulation_steps > 1:
                grad = tree_map(lambda a: a / grad_accumulation_steps, grad)
            optimizer.update(model, grad)
            grad = None
        return lvalue, toks, grad

    return step


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="lora", unit="it", file=sys.stderr, disable=not enabled, dynamic_ncols=True)


def train(
    model: nn.Module,
    optimizer,
    train_set: list,
    val_set: Optional[list],
    args: TrainingArgs,
    adapter_dir: Path,
    seed: int = 0,
    loss: Callable = default_loss,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train the model's trainable (adapter) parameters; returns the metrics records.

    ``train_set`` / ``val_set``: lists of ``(token ids, prompt length)``. Writes ``args.adapter_file`` at the end and
    every ``args.steps_per_save`` iterations (plus a numbered copy), ``metrics.jsonl`` as it goes and
    ``loss_curve.png`` at the end, all in ``adapter_dir``. Lines follow mlx-lm's ("Iter N: Train loss ...").
    """
    if args.grad_accumulation_steps < 1:
        raise ValueError("grad_accumulation_steps must be at least 1")
    adapter_dir = Path(adapter_dir)
    metrics = MetricsLog(adapter_dir / METRICS_FILE)
    accum = args.grad_accumulation_steps
    step = make_step(model, optimizer, loss, accum)
    batches = iterate_batches(train_set, args.batch_size, args.max_seq_length, loop=True, seed=seed)

    def validate(it: int) -> None:
        tic = time.perf_counter()
        val_loss = evaluate(model, val_set, args.batch_size, args.val_batches, args.max_seq_length, loss=loss)
        model.train()
        val_time = time.perf_counter() - tic
        log(f"Iter {it}: Val loss {val_loss:.3f}, Val took {val_time:.3f}s")
        metrics.write({"iteration": it, "val_loss": val_loss, "val_time": val_time})

    def save(it: Optional[int]) -> None:
        weights = adapter_weights(model)
        mx.save_safetensors(str(args.adapter_file), weights)
        if it is not None:
            checkpoint = adapter_dir / f"{it:07d}_adapters.safetensors"
            mx.save_safetensors(str(checkpoint), weights)
            log(f"Iter {it}: Saved adapter weights to {args.adapter_file} and {checkpoint}.")

    model.train()
    grad = None
    losses, n_tokens, steps, train_time, trained_tokens = 0.0, 0, 0, 0.0, 0
    mx.reset_peak_memory()
    bar = _progress(args.iters, progress)
    try:
        with gradient_checkpointing(args.grad_checkpoint):
            for it in range(1, args.iters + 1):
                if val_set and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters):
                    validate(it)
                batch = next(batches)
                tic = time.perf_counter()
                lvalue, toks, grad = step(*batch, grad, it % accum == 0 or it == args.iters)
                mx.eval(model.trainable_parameters(), optimizer.state, lvalue, toks, grad)
                dt = time.perf_counter() - tic
                train_time += dt
                losses += lvalue.item()
                n_tokens += toks.item()
                steps += 1
                peak = mx.get_peak_memory() / 1e9
                bar.set_postfix_str(f"loss {lvalue.item():.3f}, {toks.item() / dt:.0f} tok/s, peak mem {peak:.2f} GB")
                bar.update(1)
                if it % args.steps_per_report == 0 or it == args.iters:
                    trained_tokens += n_tokens
                    record = {
                        "iteration": it,
                        "train_loss": losses / steps,
                        "learning_rate": optimizer.learning_rate.item(),
                        "iterations_per_second": steps / train_time,
                        "tokens_per_second": n_tokens / train_time,
                        "trained_tokens": trained_tokens,
                        "peak_memory": peak,
                    }
                    log(
                        f"Iter {it}: Train loss {record['train_loss']:.3f}, Learning Rate "
                        f"{record['learning_rate']:.3e}, It/sec {record['iterations_per_second']:.3f}, Tokens/sec "
                        f"{record['tokens_per_second']:.3f}, Trained Tokens {trained_tokens}, Peak mem {peak:.3f} GB"
                    )
                    metrics.write(record)
                    losses, n_tokens, steps, train_time = 0.0, 0, 0, 0.0
                if it % args.steps_per_save == 0:
                    save(it)
    finally:
        bar.close()
    save(None)
    log(f"Saved final weights to {args.adapter_file}.")
    curve = plot_loss_curve(metrics.records, adapter_dir / CURVE_FILE)
    log(f"Metrics in {metrics.path}; loss curve in {curve}.")
    return metrics.records
