"""The flags every command shares and what they turn into: the model flags (``add_model_args``, ``load_from_args``,
``DTYPES``), the sampling flags (``add_sampling_args`` -> ``sampling_from_args``: a ``SamplingParams``), the latent
cache's quantization (``add_kv_args`` -> ``kv_from_args``), the chat-format flags (``add_chat_args``) and speculative
decoding (``add_draft_args`` -> ``check_draft_args``, ``draft_from_args``, ``draft_stats``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..sampling import SamplingParams
from . import ranks

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --mmproj, --adapter-path, --dtype, --quantize, --q-group-size, --parallel, --split."""
    p.add_argument("--model", required=True,
                   help="model directory, HF repo id, GGUF file, or 'demo' (built-in tiny model)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="Kimi-K3: llama.cpp's mmproj GGUF (vision tower + projector) for images, with any --model; "
                        "replaces a checkpoint's own tower (default: the checkpoint's tower, or the mmproj*.gguf "
                        "beside a --model GGUF)")
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


NUM_DRAFT_TOKENS = 8  # --num-draft-tokens when not given


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """--draft, --num-draft-tokens: speculative decoding."""
    p.add_argument("--draft", default=None, metavar="lookup|PATH",
                   help="speculative decoding: 'lookup' (drafts copied from the prompt and the reply: n-gram "
                        "lookup, no model) or a draft model sharing the model's tokenizer (a model directory, GGUF "
                        "file, HF repo id or 'demo'; loaded with --dtype / --quantize, whole on every rank under "
                        "--parallel). Same greedy output, same sampled distribution")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help=f"with --draft: the most tokens drafted per verify pass (the length adapts below it; "
                        f"default {NUM_DRAFT_TOKENS})")


def check_draft_args(args: argparse.Namespace) -> None:
    """Refuse bad ``--draft`` / ``--num-draft-tokens`` values before anything is loaded (ValueError naming the flag);
    sets ``args.num_draft_tokens`` to its default when not given."""
    draft, k = args.draft, args.num_draft_tokens
    if k is not None and draft is None:
        raise ValueError(f"--num-draft-tokens {k} needs --draft (lookup or a draft model)")
    if k is not None and k < 1:
        raise ValueError(f"--num-draft-tokens must be >= 1, got {k}")
    args.num_draft_tokens = NUM_DRAFT_TOKENS if k is None else k
    if draft is None or draft in ("lookup", "demo") or Path(draft).expanduser().exists():
        return
    if draft.endswith(".gguf") or draft.count("/") != 1 or draft.startswith((".", "/", "~")):
        raise ValueError(f"--draft {draft}: expected 'lookup' or a draft model (a model directory, GGUF file, HF "
                         "repo id of the form 'org/name', or 'demo'); no such file or directory")


def draft_from_args(args: argparse.Namespace, tokenizer, group: Optional[mx.distributed.Group] = None):
    """``stream_generate``'s ``draft``: None, "lookup", or the ``--draft`` model loaded by ``loading.load_draft``
    (whole, with ``--dtype`` / ``--quantize``; refused when its vocabulary is not ``tokenizer``'s). ``group``: the
    ranks of ``--parallel``: every rank loads it, and all succeed or fail together. ValueError naming ``--draft``."""
    if args.draft in (None, "lookup"):
        return args.draft
    from ..loading import load_draft

    quantize = None if args.quantize is None else {"bits": args.quantize, "group_size": args.q_group_size}
    with ranks.together(group, "loading the draft model"):
        try:
            return load_draft(args.draft, tokenizer, dtype=DTYPES.get(args.dtype), quantize=quantize)
        except (OSError, ValueError) as e:
            raise ValueError(f"--draft {args.draft}: {str(e).removeprefix(f'{args.draft}: ')}") from None


def draft_stats(drafted: int, accepted: int) -> dict:
    """The speculation counts of a generation: ``drafted_tokens``, ``accepted_tokens``, ``acceptance_rate``
    (accepted / drafted; None when nothing was drafted)."""
    return {"drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


def draft_text(drafted: int, accepted: int) -> str:
    """``drafted N, accepted M (R%)`` for a stats line."""
    rate = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
    return f"drafted {drafted}, accepted {accepted} ({rate})"


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The ``SamplingParams`` of the sampling flags (without a seed); seeds MLX's generator instead, so call it after
    loading (loading may draw random numbers) for ``--seed S`` to mean ``mx.random.seed(S)`` before generating (once
    per command: a chat's replies go on drawing from it).

    With ``--parallel`` every rank must call it: without ``--seed`` rank 0 picks the seed for all ranks (``args.seed``
    is set to it), so every rank samples the same tokens."""
    group = ranks.group_from_args(args) if getattr(args, "parallel", None) else None
    if ranks.is_parallel(group):
        args.seed = ranks.shared_seed(args.seed, group)
    if args.seed is not None:
        mx.random.seed(args.seed)
    return SamplingParams(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty)


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
                   split=getattr(args, "split", None), mmproj=getattr(args, "mmproj", None))
        loaded = True
        keep_wired()
        return out
    finally:
        done.set()
        if spinner:
            spinner.join()
            status = f"loaded {args.model} in {time.perf_counter() - tic:.1f}s" if loaded else ""
            print(f"\r{status}" + " " * 40, end="\n" if loaded else "\r", file=sys.stderr)
