"""``kimi-mlx serve``: an OpenAI- and Anthropic-compatible HTTP server (``kimi_mlx.server``) on uvicorn.

The socket is bound at once and the model loads in the background (``/health`` says 503 until it is ready); then
one startup line gives the URL, the model and the memory, and every request logs one line (prompt / cached /
generated tokens, tok/s) on stderr. The sampling flags are the defaults for requests that do not set them.

With ``--parallel`` (under ``mlx.launch``) every rank loads its share of the model; rank 0 serves HTTP and its
engine tells the other ranks, each turn, which requests join or leave, so all ranks step together.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import re
import signal
import sys
from typing import TYPE_CHECKING, NamedTuple

from . import ranks
from .flags import (NUM_DRAFT_TOKENS, add_chat_args, add_draft_args, add_kv_args, add_model_args, add_sampling_args,
                    check_draft_args, draft_from_args, kv_from_args, load_from_args, sampling_from_args)

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from ..models.kimi_k3 import K3Model
    from ..models.kimi_linear import Model
    from ..sampling import SamplingParams
    from ..server.scheduler import Scheduler

log = logging.getLogger("kimi_mlx.server")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """``"2G"``, ``"512MiB"``, ``"1.5g"`` or a plain number of bytes -> bytes (powers of 1024)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes, optionally with K, M, G or T (e.g. 8G)")
    scale = 1024 ** " kmgt".index((m.group(2) or " ")[0].lower())
    return int(float(m.group(1)) * scale)


def add_parser(commands) -> None:
    p = commands.add_parser("serve", description="Serve a Kimi Linear / Kimi-K3 model over the OpenAI "
                            "(/v1/chat/completions, /v1/completions, /v1/responses, /v1/models) and Anthropic "
                            "(/v1/messages) APIs.")
    add_model_args(p)
    add_sampling_args(p, max_tokens=2048)
    add_chat_args(p)
    add_kv_args(p, start=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key (Authorization: Bearer KEY, or x-api-key) on every /v1 request")
    p.add_argument("--no-ui", action="store_true", help="do not serve the chat page at / (the API is unchanged)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients use (default: the --model argument)")
    p.add_argument("--max-batch", type=int, default=16, metavar="N", help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting beyond --max-batch before new ones get 429")
    p.add_argument("--prompt-cache-bytes", type=byte_size, default=None, metavar="B",
                   help="memory for the cross-request prefix cache, e.g. 8G (0 disables it; default: a quarter "
                        "of what the device can hold beyond the memory in use after loading)")
    p.add_argument("--cache-limit", type=byte_size, default=None, metavar="B",
                   help="most memory MLX keeps in freed buffers for reuse (mx.set_cache_limit), e.g. 2G; 0 keeps "
                        "none (default: an eighth of the GPU's working set, at most 2 GiB)")
    p.add_argument("--checkpoint-interval", type=int, default=4096, metavar="N",
                   help="also snapshot a long prompt every N tokens (0: only at message boundaries)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="prompt tokens prefilled per engine step (running streams keep flowing in between)")
    p.add_argument("--max-kv-size", type=int, default=1 << 20, metavar="N",
                   help="most tokens one request may hold, prompt + reply (default: 1048576, Kimi's context)")
    p.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB", help="largest request body")
    p.add_argument("--responses-store-mb", type=float, default=64.0, metavar="MB",
                   help="memory for stored /v1/responses responses (previous_response_id; least recently used go "
                        "first; 0 keeps none)")
    _add_image_args(p)
    _add_draft_args(p)
    p.set_defaults(run=run)


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (the engine speculates while the batch is small; see ``kimi_mlx.server.scheduler``):
    the shared --draft / --num-draft-tokens (requests may turn it off with ``"speculative": false``; without
    --draft only requests with a prediction speculate), and --draft-max-batch."""
    add_draft_args(p)
    p.add_argument("--draft-max-batch", type=int, default=1, metavar="N",
                   help="speculate while at most N requests are decoding (only 1 is supported: with more rows the "
                        "batch already shares the weight reads)")


def _add_image_args(p: argparse.ArgumentParser) -> None:
    """The limits on images in requests (models with a vision tower)."""
    p.add_argument("--max-image-pixels", type=int, default=1 << 25, metavar="N",
                   help="largest image (width x height, read from its header before decoding; default 33554432)")
    p.add_argument("--max-images-per-request", type=int, default=16, metavar="N", help="most images in one request")
    p.add_argument("--max-image-mb", type=float, default=20.0, metavar="MB",
                   help="largest image file (inline or fetched)")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs (default: only inline data: URLs / base64 images are taken)")
    p.add_argument("--image-url-timeout", type=float, default=10.0, metavar="S",
                   help="seconds allowed for fetching one image URL (with --allow-image-urls)")


def _check(args: argparse.Namespace) -> None:
    for flag, value, low in (("--port", args.port, 0), ("--max-batch", args.max_batch, 1),
                             ("--max-queue", args.max_queue, 0), ("--checkpoint-interval", args.checkpoint_interval, 0),
                             ("--prefill-chunk", args.prefill_chunk, 1), ("--max-kv-size", args.max_kv_size, 2),
                             ("--max-image-pixels", args.max_image_pixels, 1),
                             ("--max-images-per-request", args.max_images_per_request, 0)):
        if value < low:
            raise ValueError(f"{flag} {value}: must be >= {low}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")
    for flag, value in (("--max-body-mb", args.max_body_mb), ("--max-image-mb", args.max_image_mb),
                        ("--image-url-timeout", args.image_url_timeout)):
        if not 0 < value:
            raise ValueError(f"{flag} {value}: must be > 0")
    if args.draft is not None or args.num_draft_tokens is None:
        check_draft_args(args)
    elif args.num_draft_tokens < 1:  # without --draft, K still bounds the drafts of requests with a prediction
        raise ValueError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    if args.draft_max_batch != 1:
        raise ValueError(f"--draft-max-batch {args.draft_max_batch}: only 1 is supported (a verify pass over several "
                         "requests needs a per-request rollback of the batch cache, which is not built)")
    if args.responses_store_mb < 0:
        raise ValueError(f"--responses-store-mb {args.responses_store_mb}: must be >= 0")
    if args.parallel and args.adapter_path:
        raise ValueError("--adapter-path with --parallel is not supported; merge the adapter first (kimi-mlx fuse)")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class BackendParts(NamedTuple):
    """What every rank builds before serving: the loaded model and tokenizer, the chat format's name, the (not yet
    started) scheduler, the requests' default sampling and the prefix cache's budget in bytes."""

    model: Model | K3Model
    tokenizer: TokenizerWrapper
    chat_format: str
    scheduler: Scheduler
    sampling: SamplingParams
    prompt_cache_bytes: int


def _backend_parts(args: argparse.Namespace, group) -> BackendParts:
    """Load the model and make its scheduler (every rank, in the same order: loading and the shared seed are
    collectives)."""
    import mlx.core as mx

    from ..chat.format import detect_chat_format
    from ..ops.memory import default_cache_limit, usable_memory
    from ..server.scheduler import Scheduler

    seed = args.seed
    model, tokenizer = load_from_args(args, progress=False, group=group)  # wires the model's memory on a Mac
    mx.set_cache_limit(default_cache_limit() if args.cache_limit is None else args.cache_limit)
    sampling = sampling_from_args(args)
    if seed is not None:
        sampling = sampling.updated(seed=seed)
    chat_format = args.chat_format or detect_chat_format(tokenizer)
    if chat_format == "kimi_linear" and (args.think or args.effort):
        raise ValueError("--think / --effort: this model's chat format (Kimi Linear) has no thinking mode")
    budget = args.prompt_cache_bytes
    if budget is None:
        budget = max(0, usable_memory() - mx.get_active_memory()) // 4
    draft = draft_from_args(args, tokenizer, group)  # every rank loads a draft model: they agree on who speculates
    k = NUM_DRAFT_TOKENS if args.num_draft_tokens is None else args.num_draft_tokens
    scheduler = Scheduler(model, max_batch=args.max_batch, max_queue=args.max_queue, prompt_cache_bytes=budget,
                          prefill_chunk=args.prefill_chunk, checkpoint_interval=args.checkpoint_interval, group=group,
                          draft=draft, num_draft_tokens=k, draft_max_batch=args.draft_max_batch,
                          **kv_from_args(args))
    return BackendParts(model, tokenizer, chat_format, scheduler, sampling, budget)


def run(args: argparse.Namespace) -> int:
    return ranks.run_command(args, lambda: _check(args), lambda group: _run(args, group))


def _run(args: argparse.Namespace, group) -> int:
    import mlx.core as mx

    from ..parallel.health import RankError

    if ranks.rank(group) != 0:  # the other ranks follow rank 0's engine until it stops serving
        try:
            scheduler = _backend_parts(args, group).scheduler
        except RankError:
            return 2
        except (OSError, ValueError) as e:
            return ranks.report_error(e, group)
        scheduler.serve()
        mx.synchronize()
        mx.clear_streams()  # as _serve's exit path
        return 0
    return _serve(args, group)


def _serve(args: argparse.Namespace, group) -> int:
    import mlx.core as mx
    import uvicorn
    from mlx.utils import tree_flatten

    from ..server.app import create_app
    from ..server.backend import Backend, Defaults, describe_model
    from ..server.images import ImageLimits

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

    model_id = args.served_model_name or args.model
    url = f"http://{args.host if ':' not in args.host else f'[{args.host}]'}:{args.port}/v1"
    failed: list[BaseException] = []

    def load() -> Backend:
        parts = _backend_parts(args, group)
        defaults = Defaults(max_tokens=args.max_tokens, sampling=parts.sampling, thinking=args.think,
                            thinking_effort=args.effort, system=args.system)
        vocab = min(len(parts.tokenizer), parts.model.args.vocab_size)
        limits = ImageLimits(args.max_image_pixels, args.max_images_per_request, int(args.max_image_mb * 2**20),
                             args.allow_image_urls, args.image_url_timeout)
        encoder = getattr(parts.model, "image_encoder", None)
        backend = Backend(parts.scheduler.start(), parts.tokenizer, parts.chat_format, vocab, args.max_kv_size,
                          defaults, encoder, getattr(parts.model, "no_images_reason", "no vision tower"), limits,
                          describe_model(parts.model, args.model), group.size() if group is not None else 1)
        weights = (sum(v.nbytes for _, v in tree_flatten(parts.model.parameters()))
                   + (encoder.nbytes if encoder is not None else 0)) / 1e9  # the vision tower's too
        log.info(f"kimi-mlx serve: {url} | model {model_id} ({parts.chat_format} format) | weights {weights:.3g} GB, "
                 f"memory in use {mx.get_active_memory() / 1e9:.2f} GB, prompt cache up to "
                 f"{parts.prompt_cache_bytes / 1e9:.2f} GB "
                 f"| max batch {args.max_batch}"
                 + (f" | draft {args.draft} (up to {args.num_draft_tokens} tokens)" if args.draft else "")
                 + (" | API key required" if args.api_key else "")
                 + (" | images" + (" and image URLs" if args.allow_image_urls else "") if encoder else ""))
        return backend

    def load_failed(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    app = create_app(load, model_id=model_id, api_key=args.api_key, max_body_mb=args.max_body_mb,
                     responses_store_mb=args.responses_store_mb, page=not args.no_ui, on_load_error=load_failed)
    if not _loopback(args.host) and args.api_key is None:
        log.warning(f"kimi-mlx serve: listening on {args.host} without --api-key: anyone who can reach it may use it")
    log.info(f"kimi-mlx serve: loading {args.model}; {url} answers /health with 503 until it is ready"
             + ("" if args.no_ui else f"; chat page at {url[:-3]}/"))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5))
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it to the handler it found: with the default one the
    # process would die there, before the exit path below
    signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "should_exit", True))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    # MLX's streams belong to the thread that made them and must be released before the interpreter exits, or their
    # teardown can abort the process ("terminate called without an active exception"): the load and engine threads
    # release theirs as they end, the main thread here.
    mx.synchronize()
    mx.clear_streams()
    log.info("kimi-mlx serve: stopped")
    if failed:
        print(f"kimi-mlx: error: {failed[0]}", file=sys.stderr)
        return 2
    return 0 if server.started else 1
