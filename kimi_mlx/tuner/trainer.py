"""The LoRA training loop: mlx-lm's batching, loss, evaluation and ``TrainingArgs``, with our own step.

mlx-lm's ``train`` compiles the whole step with ``mx.compile``. Our MoE runs the routed experts (and their per-expert
LoRA) as one dense matmul per expert over its sorted rows, which reads the per-expert counts on the host, which a
compiled function cannot do; inside ``mx.compile`` it falls back to the slower ``gather_mm`` path. So the step here is
``nn.value_and_grad`` uncompiled (small pieces such as the short conv and RMSNorm are compiled functions of their own)
followed by a compiled optimizer update (``compiled_update``), and the loop around it adds what the CLI promises: a
progress bar with loss, tokens/s and memory, mlx-lm's "Iter N: ..." lines, a metrics jsonl, periodic checkpoints
and a loss-curve PNG.
Gradient checkpointing recomputes each mixer and FFN in the backward pass (mlx-lm's patches whole decoder layers,
whose K3 form takes the AttnRes snapshot list, which ``mx.checkpoint`` cannot carry).

Data parallel (``mlx.launch -n N -- kimi-mlx lora ...``): every rank of an ``mx.distributed`` group takes its part
of each global batch (mlx-lm's ``iterate_batches(comm_group=)``), weights its gradient by its share of the batch's
loss tokens and the gradients are summed over the ranks (one ``all_sum``) before each update, so every rank applies
the gradient of the global batch's mean loss, as one process would, and keeps the same adapter weights. Losses and
token counts are global; rank 0 alone prints and writes files.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, iterate_batches

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
    """Keeps one record per report for the loss curve and appends each as a JSON line to ``path`` (None: memory
    only, as on ranks other than 0)."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self.records: list[dict] = []
        if path is not None:
            path.write_text("")

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def check_batch_size(batch_size: int, group: mx.distributed.Group) -> None:
    """``batch_size`` is the global batch: each rank of ``group`` takes an equal part of it."""
    if batch_size % group.size():
        raise ValueError(
            f"--batch-size {batch_size} is the global batch and must be divisible by the {group.size()} ranks "
            "training (each takes an equal part)"
        )


def all_sum_tree(tree, group: mx.distributed.Group):
    """``tree``'s arrays summed over the ranks of ``group``: one ``all_sum`` of all of them flattened into one
    float32 vector, split back into their shapes and dtypes."""
    flat = tree_flatten(tree)
    summed = mx.distributed.all_sum(
        mx.concatenate([v.astype(mx.float32).reshape(-1) for _, v in flat]), group=group
    )
    parts = mx.split(summed, list(itertools.accumulate(v.size for _, v in flat))[:-1])
    return tree_unflatten([(k, p.reshape(v.shape).astype(v.dtype)) for (k, v), p in zip(flat, parts)])


def share_rank_zero(model: nn.Module, seed: int, group: mx.distributed.Group) -> int:
    """Give every rank rank 0's adapter weights and return rank 0's ``seed`` (for the batch order and dropout)."""
    params = model.trainable_parameters()
    if group.rank() != 0:
        params = tree_map(mx.zeros_like, params)
        seed = 0
    model.update(all_sum_tree(params, group))
    seed = mx.distributed.all_sum(mx.array(seed, dtype=mx.uint32), group=group)
    mx.eval(model.trainable_parameters(), seed)
    return seed.item()


def global_share(lvalue: mx.array, toks: mx.array, grad, group: mx.distributed.Group):
    """This rank's (mean loss, loss tokens, gradient) on its part of a batch -> the batch's global mean loss and
    token count, and this rank's share of the global gradient: its gradient times its fraction of the tokens, so
    the sum over the ranks is the gradient of the global mean loss. (A part without loss tokens, whose mean is
    0/0, adds nothing.)"""
    has_tokens = toks > 0
    local = mx.stack([mx.where(has_tokens, lvalue * toks, 0.0), toks.astype(mx.float32)])
    loss_sum, total = mx.distributed.all_sum(local, group=group)
    weight = toks / total
    grad = tree_map(lambda g: mx.where(has_tokens, g * weight, 0.0).astype(g.dtype), grad)
    return loss_sum / total, total.astype(toks.dtype), grad


def evaluate(
    model: nn.Module,
    dataset: list,
    batch_size: int,
    num_batches: int,
    max_seq_length: int,
    loss: Callable = default_loss,
    group: Optional[mx.distributed.Group] = None,
) -> float:
    """Mean loss per token over ``num_batches`` global batches of ``dataset`` (-1: all), each rank of ``group``
    (default ``mx.distributed.init()``) computing its part of every batch.

    The batches are drawn in an order from numpy's global RNG (mlx-lm's ``iterate_batches``), so with several ranks
    and a ``num_batches`` below the whole set, every rank must have seeded numpy alike (``train`` does)."""
    group = group if group is not None else mx.distributed.init()
    check_batch_size(batch_size, group)
    model.eval()
    loss_sum, n_tokens = mx.array(0.0), mx.array(0)
    count = itertools.count() if num_batches == -1 else range(num_batches)
    for _, (batch, lengths) in zip(count, iterate_batches(dataset, batch_size, max_seq_length, comm_group=group)):
        lvalue, toks = loss(model, batch, lengths)
        loss_sum += mx.where(toks > 0, lvalue * toks, 0.0)
        n_tokens += toks
        mx.eval(loss_sum, n_tokens)
    if group.size() > 1:
        loss_sum, n_tokens = mx.distributed.all_sum(mx.stack([loss_sum, n_tokens.astype(mx.float32)]), group=group)
    return (loss_sum / n_tokens).item()


def compiled_update(model: nn.Module, optimizer) -> Callable:
    """``update(grad)``: the same as ``optimizer.update(model, grad)`` (``grad``: a tree shaped like
    ``model.trainable_parameters()``), run as one compiled graph over the optimizer's state, so that each parameter's
    elementwise update (Adam: moments, bias correction, step) is one fused kernel instead of a dozen. mlx-lm compiles
    its whole step this way; ours compiles the update alone (the forward reads per-expert counts on the host).

    The optimizer's state is initialised here if it is not yet (a resumed state is kept); its tree must stay the same
    object afterwards (the compiled graph reads and writes it in place)."""
    optimizer.init(model.trainable_parameters())
    state = optimizer.state

    @partial(mx.compile, inputs=state, outputs=state)
    def apply(grad, params):
        return optimizer.apply_gradients(grad, params)

    def update(grad) -> None:
        model.update(apply(grad, model.trainable_parameters()))

    return update


def make_step(
    model: nn.Module,
    optimizer,
    loss: Callable = default_loss,
    grad_accumulation_steps: int = 1,
    group: Optional[mx.distributed.Group] = None,
):
    """``step(batch, lengths, grad, do_update) -> (loss, n_tokens, grad)``: one forward/backward of ``loss``,
    gradients summed into ``grad`` (None at the start of an accumulation window) and, when ``do_update``, averaged
    over the window and applied by ``optimizer`` (then ``grad`` is None again). Nothing is evaluated here.

    With a ``group`` of several ranks, ``batch`` is this rank's part of the global batch: the returned loss and
    token count are the global batch's, and the window's gradient is summed over the ranks before the update.
    The update is ``compiled_update``'s (the optimizer's state is initialised when the step is made)."""
    loss_value_and_grad = nn.value_and_grad(model, loss)
    distributed = group is not None and group.size() > 1
    update = compiled_update(model, optimizer)

    def step(batch, lengths, grad, do_update: bool):
        (lvalue, toks), g = loss_value_and_grad(model, batch, lengths)
        if distributed:
            lvalue, toks, g = global_share(lvalue, toks, g, group)
        grad = g if grad is None else tree_map(lambda a, b: a + b, grad, g)
        if do_update:
            if distributed:
                grad = all_sum_tree(grad, group)
            if grad_accumulation_steps > 1:
                grad = tree_map(lambda a: a / grad_accumulation_steps, grad)
            update(grad)
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
    group: Optional[mx.distributed.Group] = None,
) -> list[dict]:
    """Train the model's trainable (adapter) parameters; returns the metrics records.

    ``train_set`` / ``val_set``: lists of ``(token ids, prompt length)``. Writes ``args.adapter_file`` at the end and
    every ``args.steps_per_save`` iterations (plus a numbered copy), ``metrics.jsonl`` as it goes and
    ``loss_curve.png`` at the end, all in ``adapter_dir``. Lines follow mlx-lm's ("Iter N: Train loss ...").

    ``group`` (default ``mx.distributed.init()``; a group of 1 is the single-process loop): data-parallel training
    over its ranks. ``args.batch_size`` is the global batch (divisible by the group size); every rank starts from
    rank 0's adapter weights and seed; losses and token counts are global; only rank 0 logs, shows progress and
    writes files (every rank returns the same records).
    """
    if args.grad_accumulation_steps < 1:
        raise ValueError("grad_accumulation_steps must be at least 1")
    group = group if group is not None else mx.distributed.init()
    check_batch_size(args.batch_size, group)
    lead = group.rank() == 0
    if group.size() > 1:
        seed = share_rank_zero(model, seed, group)
        mx.random.seed(seed)  # dropout
        np.random.seed(seed)  # the batches of the first validation (iterate_batches seeds numpy at its first batch)
    if not lead:
        progress, log = False, lambda line: None
    adapter_dir = Path(adapter_dir)
    metrics = MetricsLog(adapter_dir / METRICS_FILE if lead else None)
    accum = args.grad_accumulation_steps
    step = make_step(model, optimizer, loss, accum, group)
    batches = iterate_batches(train_set, args.batch_size, args.max_seq_length, loop=True, seed=seed, comm_group=group)

    def validate(it: int) -> None:
        tic = time.perf_counter()
        val_loss = evaluate(
            model, val_set, args.batch_size, args.val_batches, args.max_seq_length, loss=loss, group=group
        )
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
                if it % args.steps_per_save == 0 and lead:
                    save(it)
    finally:
        bar.close()
    if lead:
        save(None)
        log(f"Saved final weights to {args.adapter_file}.")
        curve = plot_loss_curve(metrics.records, adapter_dir / CURVE_FILE)
        log(f"Metrics in {metrics.path}; loss curve in {curve}.")
    return metrics.records
