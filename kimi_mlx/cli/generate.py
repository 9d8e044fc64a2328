"""``kimi-mlx generate``: one completion from a prompt, streamed to stdout, stats to stderr."""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="generate text from a prompt",
                            description="Generate text with a Kimi Linear model.")
    p.add_argument("--model", required=True, help="model directory, HF repo id, or 'demo' (built-in tiny model)")
    p.add_argument("--prompt", "-p", default="Hello", help="prompt text ('-' reads stdin)")
    p.add_argument("--max-tokens", "-m", type=int, default=100)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast float weights (default: as stored)")
    p.add_argument("--quantize", type=int, default=None, metavar="BITS",
                   help="quantize weights on load (affine; 2, 3, 4, 5, 6 or 8 bits)")
    p.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..generate import stream_generate
    from ..loading import load

    if args.seed is not None:
        mx.random.seed(args.seed)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    quantize = None if args.quantize is None else {"bits": args.quantize, "group_size": args.q_group_size}
    try:
        model, tokenizer = load(args.model, dtype=DTYPES.get(args.dtype), quantize=quantize)
    except (OSError, ValueError) as e:
        print(f"kimi-mlx: error: {e}", file=sys.stderr)
        return 2
    last = None
    for last in stream_generate(
        model, tokenizer, prompt, args.max_tokens, temp=args.temp, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop_strings=args.stop,
    ):
        print(last.text, end="", flush=True)
    print()
    if last is not None and not args.quiet:
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s | "
            f"peak memory: {last.peak_memory:.3f} GB | finish: {last.finish_reason}",
            file=sys.stderr,
        )
    return 0
