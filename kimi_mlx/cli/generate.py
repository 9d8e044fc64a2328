"""``kimi-mlx generate``: one completion from a prompt, streamed to stdout, stats to stderr (or all of it as JSON).

Also the model-loading and sampling options shared with ``kimi-mlx chat`` (``add_model_args``, ``add_sampling_args``,
``load_from_args``, ``sampling_from_args``).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Optional

import mlx.core as mx

from . import ranks
from ..parallel.comm import broadcast_text

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --adapter-path, --dtype, --quantize, --q-group-size."""
    p.add_argument("--model", required=True,
                   help="model directory, HF repo id, GGUF file, or 'demo' (built-in tiny model)")
    p.add_argument("--adapter-path", default=None, metavar="DIR",
                   help="LoRA/DoRA adapter directory (adapters.safetensors + adapter_config.json) to apply")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast float weights (default: as stored)")
    p.add_argument("--quantize", type=int, default=None, metavar="BITS",
                   help="quantize weights on load (affine; 2, 3, 4, 5, 6 or 8 bits)")
    p.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--parallel", default=None, metavar="{pipeline,tensor}",
                   help="split the model over the ranks of mlx.launch (mlx.launch [--hosts ...] -- kimi-mlx ... "
                        "--parallel MODE): rank 0 reads the input and prints, the others stay silent")
    p.add_argument("--split", default=None, metavar="even|N,N,...",
                   help="--parallel pipeline: 'even', or decoder layers per rank such as '20,7' (default: in "
                        "proportion to each rank's memory)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """--max-tokens, --temp, --top-p, --top-k, --min-p, --repetition-penalty, --seed."""
    p.add_argument("--max-tokens", "-m", type=int, default=max_tokens)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def add_kv_args(p: argparse.ArgumentParser, start: bool = True) -> None:
    """--kv-bits, --kv-group-size (and --quantized-kv-start): the MLA latent cache's quantization."""
    p.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                   help="quantize the MLA latent cache to this many bits (default: float)")
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64,
                   help="quantization group of the latent cache (with --kv-bits)")
    if start:
        p.add_argument("--quantized-kv-start", type=int, default=0, metavar="N",
                       help="keep the cache float until it holds N tokens (with --kv-bits)")


def kv_from_args(args: argparse.Namespace) -> dict:
    """``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start`` keyword arguments of the parsed kv flags."""
    kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size}
    if hasattr(args, "quantized_kv_start"):
        kv["quantized_kv_start"] = args.quantized_kv_start
    return kv


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """--system, --think/--no-think, --effort, --chat-format."""
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="Kimi-K3: reasoning on/off (default: on for K3)")
    p.add_argument("--effort", choices=("low", "high", "max"), default=None, help="Kimi-K3 thinking effort")
    p.add_argument("--chat-format", choices=("kimi_linear", "kimi_k3"), default=None,
                   help="override the chat format detected from the tokenizer")


def sampling_from_args(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``stream_generate`` for the sampling flags; seeds MLX's generator, so call it after
    loading (loading may draw random numbers) for ``--seed S`` to mean ``mx.random.seed(S)`` before generating.

    With ``--parallel`` every rank must call it: without ``--seed`` rank 0 picks the seed for all ranks (``args.seed``
    is set to it), so every rank samples the same tokens."""
    group = ranks.group_from_args(args) if getattr(args, "parallel", None) else None
    if ranks.is_parallel(group):
        args.seed = ranks.shared_seed(args.seed, group)
    if args.seed is not None:
        mx.random.seed(args.seed)
    return {"temp": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty}


def load_from_args(args: argparse.Namespace, progress: bool = True, group: Optional[mx.distributed.Group] = None):
    """``(model, tokenizer)`` for the model flags; ``progress``: a GGUF shows ``load``'s progress bar, anything else
    an elapsed-time indicator (on a terminal's stderr). ``group``: the ranks of ``--parallel`` (from
    ``ranks.group_from_args``; by default derived from ``--parallel``); only rank 0 shows progress.
    On a Mac, the command (every rank of it) then keeps its memory wired until it exits (``ops.memory.keep_wired``):
    the commands that load a model all generate with it."""
    from ..loading import load
    from ..ops.memory import keep_wired

    if group is None and getattr(args, "parallel", None):
        group = ranks.group_from_args(args)
    progress = progress and (group is None or group.rank() == 0)

    quantize = None if args.quantize is None else {"bits": args.quantize, "group_size": args.q_group_size}
    done = threading.Event()
    tic = time.perf_counter()

    def spin():
        frames = "|/-\\"
        i = 0
        while not done.wait(0.2):
            print(f"\rloading {args.model} {frames[i % 4]} {time.perf_counter() - tic:.1f}s", end="",
                  file=sys.stderr, flush=True)
            i += 1

    gguf = str(args.model).endswith(".gguf")
    spinner = threading.Thread(target=spin, daemon=True) if progress and not gguf and sys.stderr.isatty() else None
    if spinner:
        spinner.start()
    loaded = False
    try:
        out = load(args.model, dtype=DTYPES.get(args.dtype), quantize=quantize, adapter_path=args.adapter_path,
                   progress=progress and gguf, parallel=getattr(args, "parallel", None), group=group,
                   split=getattr(args, "split", None))
        loaded = True
        keep_wired()
        return out
    finally:
        done.set()
        if spinner:
            spinner.join()
            status = f"loaded {args.model} in {time.perf_counter() - tic:.1f}s" if loaded else ""
            print(f"\r{status}" + " " * 40, end="\n" if loaded else "\r", file=sys.stderr)


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="generate text from a prompt",
                            description="Generate text with a Kimi Linear / Kimi-K3 model.")
    add_model_args(p)
    p.add_argument("--prompt", "-p", default="Hello", help="prompt text ('-' reads stdin)")
    add_sampling_args(p, max_tokens=100)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat format")
    add_chat_args(p)
    add_kv_args(p)
    p.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="reuse the prompt cache in FILE when the prompt starts with its tokens; if FILE does not "
                        "exist, save the prompt's cache there first")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, reasoning, content, tool_calls, stats) instead of streaming")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    p.set_defaults(run=run)


def _check_chat_flags(args: argparse.Namespace) -> None:
    if not args.chat:
        for flag, value in (("--system", args.system), ("--think/--no-think", args.think), ("--effort", args.effort)):
            if value is not None:
                raise ValueError(f"{flag} needs --chat (it applies to the chat format)")


def _prompt_tokens(args: argparse.Namespace, tokenizer, group: Optional[mx.distributed.Group] = None) -> list[int]:
    prompt = args.prompt
    if prompt == "-":  # under --parallel rank 0 reads stdin and hands the text to the others
        prompt = sys.stdin.read() if ranks.rank(group) == 0 else None
        if ranks.is_parallel(group):
            prompt = broadcast_text(prompt, group)
    _check_chat_flags(args)
    if not args.chat:
        return tokenizer.encode(prompt)
    from ..chat.format import render_chat

    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": prompt}]
    return render_chat(tokenizer, messages, thinking=args.think, thinking_effort=args.effort,
                       add_generation_prompt=True, chat_format=args.chat_format)


def _prompt_cache(args: argparse.Namespace, model, tokens: list[int]):
    """(cache, tokens still to feed): reuses or creates ``--prompt-cache``; None when the flag is not given."""
    from pathlib import Path

    from mlx_lm.generate import maybe_quantize_kv_cache

    from ..prompt_cache import PromptCacheError, load_prompt_cache, save_prompt_cache

    path = Path(args.prompt_cache)
    kv = kv_from_args(args)
    if path.exists():
        loaded = load_prompt_cache(path, model, **kv)
        n = len(loaded.tokens)
        if n >= len(tokens) or tokens[:n] != loaded.tokens:
            raise PromptCacheError(
                f"{path}: its {n} cached tokens are not a strict prefix of this prompt's {len(tokens)} tokens "
                "(give a prompt that extends the cached one, or a new file)"
            )
        return loaded.cache, tokens[n:]
    cache = model.make_cache()
    head = tokens[:-1]
    for start in range(0, len(head), 2048):
        model(mx.array(head[start : start + 2048])[None], cache=cache)
        maybe_quantize_kv_cache(cache, kv["quantized_kv_start"], kv["kv_group_size"], kv["kv_bits"])
        mx.eval([c.state for c in cache])
    save_prompt_cache(path, model, cache, head)
    return cache, tokens[-1:]


def run(args: argparse.Namespace) -> int:
    from ..parallel.health import RankError
    from ..prompt_cache import PromptCacheError

    def check() -> None:
        if args.parallel and args.prompt_cache:
            raise ValueError("--prompt-cache is not supported with --parallel (each rank holds part of the cache)")
        _check_chat_flags(args)

    def body(group) -> int:
        try:
            return _run(args, group)
        except RankError:  # rank 0 printed it; every rank ends with it
            return 2
        except (OSError, ValueError, PromptCacheError) as e:
            return ranks.report_error(e, group)

    return ranks.run_command(args, check, body)


def _run(args: argparse.Namespace, group: Optional[mx.distributed.Group]) -> int:
    from ..generate import stream_generate

    model, tokenizer = load_from_args(args, progress=not (args.quiet or args.json), group=group)
    tokens = _prompt_tokens(args, tokenizer, group)
    cache, feed = _prompt_cache(args, model, tokens) if args.prompt_cache else (model.make_cache(), tokens)
    parser = None
    if args.chat:
        from ..chat.format import detect_chat_format
        from ..chat.parser import ReplyParser

        fmt = args.chat_format or detect_chat_format(tokenizer)
        parser = ReplyParser(fmt, thinking=args.think)
    sampling = sampling_from_args(args)
    tic = time.perf_counter()
    text, last, first_s = "", None, None
    for last in stream_generate(model, tokenizer, feed, args.max_tokens, stop_strings=args.stop, prompt_cache=cache,
                                **sampling, **kv_from_args(args)):
        first_s = first_s or time.perf_counter() - tic
        text += last.text
        if parser is not None:
            parser.feed(last.text)
        if not args.json:
            print(last.text, end="", flush=True)
    stats = {
        "prompt_tokens": len(tokens), "prefill_tokens": len(feed),
        "prompt_tps": len(feed) / first_s if first_s else 0.0,
        "generation_tokens": last.generation_tokens if last else 0,
        "generation_tps": last.generation_tps if last else 0.0,
        "peak_memory_gb": last.peak_memory if last else 0.0, "finish_reason": last.finish_reason if last else None,
        "cache_bytes": cache.nbytes, "kv_bits": (cache.kv_quant or (None,))[0],
        "kv_group_size": (cache.kv_quant or (None, None))[1],
    }
    if args.json:
        reply = None
        if parser is not None:
            parser.finish()
            reply = parser.reply
        out = {"text": text, "reasoning": reply.reasoning if reply else None,
               "content": reply.content if reply else text,
               "tool_calls": [c.to_dict() for c in reply.tool_calls] if reply else [],
               "warnings": reply.warnings if reply else [], "stats": stats}
        print(json.dumps(out, ensure_ascii=False))
        return 0
    print()
    if last is not None and not args.quiet and ranks.rank(group) == 0:
        print(
            f"prompt: {stats['prompt_tokens']} tokens ({stats['prefill_tokens']} prefilled), "
            f"{stats['prompt_tps']:.1f} tok/s | generation: {stats['generation_tokens']} tokens, "
            f"{stats['generation_tps']:.1f} tok/s | peak memory: {stats['peak_memory_gb']:.3f} GB | "
            f"finish: {stats['finish_reason']}",
            file=sys.stderr,
        )
    return 0
