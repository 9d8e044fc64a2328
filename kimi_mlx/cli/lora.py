"""``kimi-mlx lora``: fine-tune LoRA / DoRA adapters on a local jsonl dataset (flags and lines as ``mlx_lm.lora``).

    kimi-mlx lora --model demo --train --data DIR --iters 100 --adapter-path adapters
    kimi-mlx lora --model DIR --quantize 4 --train --data chats.jsonl --split 0.9,0.1,0 --mask-prompt
    kimi-mlx lora --model DIR --test --data DIR --adapter-path adapters

Writes ``adapters.safetensors`` + ``adapter_config.json`` (mlx-lm's format), ``metrics.jsonl`` and
``loss_curve.png`` into ``--adapter-path``.

Under ``mlx.launch`` (``mlx.launch -n 2 -- kimi-mlx lora ...``, or ``--hosts mac1,mac2``) it trains data-parallel
over the launched ranks: ``--batch-size`` is the global batch, split evenly over them; rank 0 prints and writes the
files, the other ranks are silent except for errors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from .flags import DTYPES
from .ranks import on_ranks, wait_for_ranks

OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor")
SCHEDULES = ("cosine_decay", "linear_schedule", "exponential_decay", "step_decay")


def add_parser(commands) -> None:
    p = commands.add_parser(
        "lora",
        description="Fine-tune LoRA or DoRA adapters for a Kimi Linear / Kimi-K3 model on local jsonl data. "
        "Flags follow mlx_lm.lora.",
    )
    p.add_argument("--model", required=True, help="model directory, HF repo id, or 'demo'")
    p.add_argument("--train", action="store_true", help="train adapters")
    p.add_argument(
        "--test", action="store_true", help="report the test-set loss (after training, or of --adapter-path)"
    )
    p.add_argument(
        "--data",
        required=True,
        help="directory with train/valid/test.jsonl, one .jsonl file split by --split, or 'demo' (the shipped demo set)",
    )
    p.add_argument(
        "--split",
        default=None,
        metavar="TRAIN,VALID,TEST",
        help="fractions for a single .jsonl file (default 0.9,0.1,0)",
    )
    p.add_argument("--mask-prompt", action="store_true", help="loss on the completion / last assistant turn only")
    p.add_argument("--fine-tune-type", choices=("lora", "dora"), default="lora")
    p.add_argument("--num-layers", type=int, default=-1, help="adapt the last N decoder layers (-1: all)")
    p.add_argument(
        "--projections",
        default="all",
        help="comma-separated groups: kda, kda_gates, mla, mlp, shared_experts, experts, router, "
        "attn_res (default: all)",
    )
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--scale", type=float, default=None, help="LoRA scale (mlx-lm's; default 20)")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha: scale = alpha / rank")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default=None,
        help="decay the learning rate over --iters (mlx.optimizers schedule)",
    )
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps before the schedule")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--val-batches", type=int, default=25, help="validation batches (-1: the whole set)")
    p.add_argument("--test-batches", type=int, default=500, help="test batches (-1: the whole set)")
    p.add_argument("--steps-per-report", type=int, default=10)
    p.add_argument("--steps-per-eval", type=int, default=200)
    p.add_argument("--save-every", type=int, default=100, help="checkpoint the adapters every N iterations")
    p.add_argument("--max-seq-length", type=int, default=2048, help="longer sequences are truncated (warned)")
    p.add_argument("--grad-accumulation-steps", type=int, default=1)
    p.add_argument("--grad-checkpoint", action="store_true", help="recompute activations in the backward pass")
    p.add_argument("--adapter-path", default="adapters", help="where adapters, metrics and the loss curve go")
    p.add_argument("--resume-adapter-file", default=None, help="start from these adapter weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the base's float weights")
    p.add_argument(
        "--quantize",
        type=int,
        default=None,
        metavar="BITS",
        help="quantize the frozen base on load (QLoRA; affine 2-8 bits); adapters stay float",
    )
    p.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def lora_scale(args: argparse.Namespace) -> float:
    if args.scale is not None and args.alpha is not None:
        raise ValueError("give --scale or --alpha, not both")
    if args.alpha is not None:
        return args.alpha / args.rank
    return 20.0 if args.scale is None else args.scale


def learning_rate(args: argparse.Namespace):
    """A float, or mlx-lm's ``build_schedule`` of ``--lr-schedule`` decaying over ``--iters`` after ``--warmup``."""
    from mlx_lm.tuner.utils import build_schedule

    if args.lr_schedule is None:
        if args.warmup:
            raise ValueError("--warmup needs --lr-schedule")
        return args.learning_rate
    steps = max(1, args.iters - args.warmup)
    arguments = {
        "cosine_decay": [args.learning_rate, steps],
        "linear_schedule": [args.learning_rate, 0.0, steps],
        "exponential_decay": [args.learning_rate, 0.01 ** (1 / steps)],
        "step_decay": [args.learning_rate, 0.5, max(1, steps // 4)],
    }[args.lr_schedule]
    return build_schedule({"name": args.lr_schedule, "arguments": arguments, "warmup": args.warmup})


def make_optimizer(name: str, lr):
    import mlx.optimizers as optim

    return {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD, "adafactor": optim.Adafactor}[name](
        learning_rate=lr
    )


def check_args(args: argparse.Namespace) -> None:
    if not (args.train or args.test):
        raise ValueError("nothing to do: pass --train and/or --test")
    for name in (
        "iters",
        "batch_size",
        "steps_per_report",
        "steps_per_eval",
        "save_every",
        "max_seq_length",
        "grad_accumulation_steps",
        "rank",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError("--dropout must be in [0, 1)")


def train_adapters(args: argparse.Namespace, model, sets, group: mx.distributed.Group) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import TrainingArgs

    from ..tuner.adapters import (
        ADAPTER_FILE,
        CONFIG_FILE,
        adapter_config,
        apply_adapters,
        load_adapter_weights,
        parse_projections,
        select_modules,
    )
    from ..tuner.trainer import train

    for split in ("train", "valid"):
        if sets.get(split) is not None and len(sets[split]) < args.batch_size:
            raise ValueError(
                f"{sets[split].source}: {len(sets[split])} records, fewer than --batch-size {args.batch_size}"
            )
    projections = parse_projections(args.projections)
    scale = lora_scale(args)
    paths = list(select_modules(model, projections, args.num_layers))
    if not paths:
        raise ValueError(f"--projections {args.projections} --num-layers {args.num_layers}: selects no projection")
    apply_adapters(model, paths, args.fine_tune_type, args.rank, scale, args.dropout)
    if args.resume_adapter_file:
        load_adapter_weights(model, Path(args.resume_adapter_file))
        print(f"Loaded adapter weights from {args.resume_adapter_file}")
    adapter_dir = Path(args.adapter_path)
    config = adapter_config(
        model,
        paths,
        args.fine_tune_type,
        args.rank,
        scale,
        args.dropout,
        args.num_layers,
        projections,
        base_model=str(args.model),
        quantize=args.quantize,
        mask_prompt=args.mask_prompt,
        max_seq_length=args.max_seq_length,
        seed=args.seed,
    )
    if group.rank() == 0:
        adapter_dir.mkdir(parents=True, exist_ok=True)
        (adapter_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(
        f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M) "
        f"in {len(paths)} {args.fine_tune_type} adapters (rank {args.rank}, scale {scale:g})"
    )
    if group.size() > 1:
        print(
            f"Data-parallel training on {group.size()} ranks: global batch {args.batch_size}, "
            f"{args.batch_size // group.size()} per rank, gradients averaged across ranks (weighted by loss tokens)"
        )
    train_args = TrainingArgs(
        batch_size=args.batch_size,
        iters=args.iters,
        val_batches=args.val_batches,
        steps_per_report=args.steps_per_report,
        steps_per_eval=args.steps_per_eval,
        steps_per_save=args.save_every,
        max_seq_length=args.max_seq_length,
        adapter_file=str(adapter_dir / ADAPTER_FILE),
        grad_checkpoint=args.grad_checkpoint,
        grad_accumulation_steps=args.grad_accumulation_steps,
    )
    train(
        model,
        make_optimizer(args.optimizer, learning_rate(args)),
        sets["train"].tokenized(),
        sets["valid"].tokenized() if sets.get("valid") else None,
        train_args,
        adapter_dir,
        seed=args.seed,
        progress=not args.quiet,
        group=group,
    )


def run(args: argparse.Namespace) -> int:
    from ..tuner.trainer import check_batch_size

    group = mx.distributed.init()
    try:
        check_args(args)
        check_batch_size(args.batch_size, group)
        with on_ranks(group):
            train_and_test(args, group)
        wait_for_ranks(group)
    except (OSError, ValueError) as e:
        print(f"kimi-mlx: error: {e}", file=sys.stderr)
        return 2
    return 0


def train_and_test(args: argparse.Namespace, group: mx.distributed.Group) -> None:
    """Load the model and data, then train and / or test; every rank of ``group`` runs this."""
    from ..data import DEMO_DATA
    from ..loading import load
    from ..ops.memory import keep_wired
    from ..tuner.adapters import load_adapters
    from ..tuner.datasets import load_datasets
    from ..tuner.trainer import evaluate

    mx.random.seed(args.seed)
    np.random.seed(args.seed)  # the batches drawn for validation and --test (the same on every rank)
    quantize = None if args.quantize is None else {"bits": args.quantize, "group_size": args.q_group_size}
    print("Loading pretrained model")
    model, tokenizer = load(args.model, dtype=DTYPES.get(args.dtype), quantize=quantize)
    keep_wired()  # on a Mac, the weights, adapters and optimizer state stay resident while training (as mlx-lm's)
    print("Loading datasets")
    data = DEMO_DATA if args.data == "demo" else args.data
    sets = load_datasets(data, tokenizer, mask_prompt=args.mask_prompt, split=args.split, seed=args.seed)
    if args.train:
        if sets.get("train") is None:
            raise ValueError(f"--data {args.data}: no train.jsonl (needed for --train)")
        if sets.get("valid") is None and group.rank() == 0:
            print("Warning: no validation set; training without validation.", file=sys.stderr)
        print("Training")
        train_adapters(args, model, sets, group)
    elif args.adapter_path:
        load_adapters(model, args.adapter_path)
    if args.test:
        if sets.get("test") is None:
            raise ValueError(f"--data {args.data}: no test split (needed for --test)")
        if len(sets["test"]) < args.batch_size:
            raise ValueError(f"{sets['test'].source}: fewer records than --batch-size {args.batch_size}")
        print("Testing")
        test_loss = evaluate(
            model, sets["test"].tokenized(), args.batch_size, args.test_batches, args.max_seq_length, group=group
        )
        print(f"Test loss {test_loss:.3f}, Test ppl {math.exp(test_loss):.3f}.")
