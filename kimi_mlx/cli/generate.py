"""``kimi-mlx generate``: one completion from a prompt, streamed to stdout, stats to stderr (or all of it as JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..parallel.comm import broadcast_text
from . import ranks
from .flags import (add_chat_args, add_draft_args, add_kv_args, add_model_args, add_sampling_args, check_draft_args,
                    draft_from_args, draft_stats, draft_text, kv_from_args, load_from_args, sampling_from_args)


def add_parser(commands) -> None:
    p = commands.add_parser("generate", description="Generate text with a Kimi Linear / Kimi-K3 model.")
    add_model_args(p)
    p.add_argument("--prompt", "-p", default="Hello", help="prompt text ('-' reads stdin)")
    add_sampling_args(p, max_tokens=100)
    add_draft_args(p)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat format")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image file for the prompt (repeatable; Kimi-K3 with a vision tower). The images, then "
                        "the prompt, go in one user message in the chat format, as mlx-vlm's CLI does: --image "
                        "implies --chat")
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
    if args.image:
        args.chat = True  # images go in a chat message
    if not args.chat:
        for flag, value in (("--system", args.system), ("--think/--no-think", args.think), ("--effort", args.effort)):
            if value is not None:
                raise ValueError(f"{flag} needs --chat (it applies to the chat format)")
    for path in args.image:
        if not Path(path).is_file():
            raise ValueError(f"--image {path}: no such file")


def _images(args: argparse.Namespace, model) -> list:
    """The ``--image`` files prepared by the model's image encoder (``PromptImage``s); a clear error for a model
    without a vision tower or an unreadable image."""
    from ..chat.images import prepare_image

    encoder = getattr(model, "image_encoder", None)
    if args.image and encoder is None:
        raise ValueError(f"--image: {getattr(model, 'no_images_reason', 'this model has no vision tower')}")
    return [prepare_image(path, encoder, f"--image {path}") for path in args.image]


def _prompt_tokens(args: argparse.Namespace, tokenizer, images: list = (),
                   group: Optional[mx.distributed.Group] = None) -> list[int]:
    """The prompt's ids: its text, or (``--chat`` / ``--image``) a user message of ``images`` (``PromptImage``s)
    and the text, after the ``--system`` message, in the chat format with the generation prompt."""
    prompt = args.prompt
    if prompt == "-":  # under --parallel rank 0 reads stdin and hands the text to the others
        prompt = sys.stdin.read() if ranks.rank(group) == 0 else None
        if ranks.is_parallel(group):
            prompt = broadcast_text(prompt, group)
    _check_chat_flags(args)
    if not args.chat:
        return tokenizer.encode(prompt)
    from ..chat.format import render_chat

    content = [*({"type": "image", "image": im} for im in images), {"type": "text", "text": prompt}] if images \
        else prompt
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": content}]
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
        if args.image and args.prompt_cache:
            raise ValueError("--prompt-cache is not supported with --image (the cache file keys prompts by token "
                             "ids, which do not tell images apart)")
        _check_chat_flags(args)
        check_draft_args(args)
        if args.draft is not None and args.image:
            raise ValueError(f"--draft {args.draft} is not supported with --image (speculative decoding runs text "
                             "prompts; drop --draft for an image prompt)")

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
    draft = draft_from_args(args, tokenizer, group)
    images = _images(args, model)
    tokens = _prompt_tokens(args, tokenizer, images, group)
    cache, feed = _prompt_cache(args, model, tokens) if args.prompt_cache else (model.make_cache(), tokens)
    speculation = {}
    if draft is not None:
        from ..speculative import InContext, make_drafter

        drafter = make_drafter(draft, args.num_draft_tokens, **kv_from_args(args))
        if len(feed) < len(tokens):  # the drafter sees the tokens of --prompt-cache too
            drafter = InContext(drafter, tokens[: len(tokens) - len(feed)])
        speculation = {"draft": drafter, "num_draft_tokens": args.num_draft_tokens}
    parser = None
    if args.chat:
        from ..chat.format import detect_chat_format
        from ..chat.parser import ReplyParser

        fmt = args.chat_format or detect_chat_format(tokenizer)
        parser = ReplyParser(fmt, thinking=args.think)
    sampling = sampling_from_args(args)
    tic = time.perf_counter()
    text, last, first_s = "", None, None
    for last in stream_generate(model, tokenizer, feed, args.max_tokens, sampling=sampling, stop_strings=args.stop,
                                prompt_cache=cache, images=images, **kv_from_args(args), **speculation):
        first_s = first_s or time.perf_counter() - tic
        text += last.text
        if parser is not None:
            parser.feed(last.text)
        if not args.json:
            print(last.text, end="", flush=True)
    stats = {
        "prompt_tokens": len(tokens), "prefill_tokens": len(feed), "image_tokens": sum(im.num_tokens for im in images),
        "prompt_tps": len(feed) / first_s if first_s else 0.0,
        "generation_tokens": last.generation_tokens if last else 0,
        "generation_tps": last.generation_tps if last else 0.0,
        "peak_memory_gb": last.peak_memory if last else 0.0, "finish_reason": last.finish_reason if last else None,
        "cache_bytes": cache.nbytes, "kv_bits": (cache.kv_quant or (None,))[0],
        "kv_group_size": (cache.kv_quant or (None, None))[1],
        **draft_stats(getattr(last, "drafted_tokens", 0), getattr(last, "accepted_tokens", 0)),
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
            f"finish: {stats['finish_reason']}"
            + (f" | {draft_text(stats['drafted_tokens'], stats['accepted_tokens'])}" if draft is not None else ""),
            file=sys.stderr,
        )
    return 0
