"""What the OpenAI, Anthropic and Ollama routes share: the loaded model (``Backend``, what it is: ``ModelInfo``), the
server's defaults, turning a conversation or a prompt into a validated ``GenerationRequest`` and submitting it,
streaming the reply (SSE, NDJSON), and the app's state (``ServerState``: model id, API key, body limit, loading).

Errors are ``kimi_mlx.server.errors.ApiError``s (status, message, the request field at fault).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from fastapi.responses import StreamingResponse

from ..chat.format import encode_segments, render_chat_with_starts
from ..chat.format_k3 import XTML_MARKERS, close_tag, open_tag
from ..chat.tool_ids import in_call_order
from ..sampling import SamplingParams
from .errors import ApiError
from .images import ImageLimits
from .scheduler import EngineStoppedError, GenerationRequest, QueueFullError, ReasoningBudget, RequestStream

THINKING_EFFORTS = ("low", "high", "max")
# the efforts clients name (OpenAI's reasoning_effort, Ollama's think levels) -> K3's, which knows low, high and max
EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


@dataclass
class Defaults:
    """What a request that does not say gets (the CLI's sampling and chat flags). ``sampling``: the default
    ``SamplingParams`` (the CLI sets temp/top_p/top_k/min_p/repetition_penalty/seed); ``thinking``/``thinking_effort``:
    Kimi-K3 (None: the chat format's defaults); ``system``: system prompt for conversations that have none."""

    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    thinking: Optional[bool] = None
    thinking_effort: Optional[str] = None
    system: Optional[str] = None


@dataclass
class ModelInfo:
    """What the served model is, for listings (Ollama's ``/api/tags``, ``/api/show``): ``family`` (the config's
    model type), the weights' ``format`` (``safetensors`` or ``gguf``), ``parameter_count`` (packed quantized
    weights counted as the values they hold), ``size`` (bytes of the weights in memory), ``quantization``
    (``F32``/``BF16``/``F16`` for float weights, ``Q{bits}`` for MLX affine, the GGML type for GGML blocks),
    ``source`` (the ``--model`` argument) and ``modified_at`` (the source's modification time, seconds since
    the epoch; the load time when it is not a local path)."""

    family: str = "kimi"
    format: str = "safetensors"
    parameter_count: int = 0
    size: int = 0
    quantization: str = "F32"
    source: str = ""
    modified_at: float = 0.0


def describe_model(model: Any, source: str) -> ModelInfo:
    """``ModelInfo`` of a loaded model (its local weights: a rank's share when the model is split) loaded from
    ``source``."""
    from mlx.utils import tree_flatten

    bits = {getattr(m, "bits", None) for _, m in model.named_modules()} - {None}
    ggml = sorted({str(getattr(m, "ggml_type")) for _, m in model.named_modules() if hasattr(m, "ggml_type")})
    count = size = 0
    floats: dict[str, int] = {}
    for name, v in tree_flatten(model.parameters()):
        size += v.nbytes
        if name.endswith((".scales", ".biases")) and bits:
            continue
        if _is_float(v.dtype):
            count += v.size
            floats[str(v.dtype).split(".")[-1]] = floats.get(str(v.dtype).split(".")[-1], 0) + v.nbytes
        else:  # packed quantized values
            count += v.nbytes * 8 // min(bits) if bits else v.size
    bulk = max(floats, key=floats.get, default="float32")
    quant = ggml[0] if ggml else f"Q{min(bits)}" if bits else {"float32": "F32", "bfloat16": "BF16"}.get(bulk, "F16")
    path = Path(source)
    return ModelInfo(family=getattr(getattr(model, "args", None), "model_type", "kimi"),
                     format="gguf" if path.suffix == ".gguf" else "safetensors", parameter_count=count, size=size,
                     quantization=quant, source=source,
                     modified_at=path.stat().st_mtime if path.exists() else time.time())


def _is_float(dtype) -> bool:
    import mlx.core as mx

    return mx.issubdtype(dtype, mx.floating)


@dataclass
class Backend:
    """The loaded model behind the routes: its scheduler (running), tokenizer (mlx-lm ``TokenizerWrapper``), chat
    format, the token ids a request may use (``0 <= id < vocab_size``), the most tokens a request may hold (prompt +
    reply, ``max_context``), the defaults, and images: the model's ``image_encoder`` (None: it takes no images,
    ``no_images`` says why) and the server's ``image_limits``; what the model is (``info``: listings and
    ``/v1/status``) and the number of ranks serving it (``ranks``)."""

    scheduler: Any
    tokenizer: Any
    chat_format: str
    vocab_size: int
    max_context: int
    defaults: Defaults = field(default_factory=Defaults)
    image_encoder: Any = None
    no_images: str = "this model has no vision tower"
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    info: ModelInfo = field(default_factory=ModelInfo)
    ranks: int = 1


@dataclass
class Prompt:
    """A rendered prompt: ``tokens``, message ends (``boundaries``) and the end of the system part
    (``system_end``, 0: none), ``thinking`` as rendered (for the reply parser; None for plain completions) and the
    ``images`` (``PromptImage``s) whose placeholders ``tokens`` holds, in order."""

    tokens: list[int]
    boundaries: tuple[int, ...] = ()
    system_end: int = 0
    thinking: Optional[bool] = None
    images: tuple = ()


def resolve_thinking(backend: Backend, thinking: Optional[bool], effort: Optional[str], param: str
                     ) -> tuple[Optional[bool], Optional[str]]:
    """``(thinking, effort)`` for the renderer: the request's, else the server's defaults; Kimi Linear accepts no
    thinking (ApiError naming ``param``)."""
    thinking = backend.defaults.thinking if thinking is None else thinking
    effort = backend.defaults.thinking_effort if effort is None else effort
    if backend.chat_format == "kimi_linear":
        if thinking:
            raise ApiError(400, f"{param}: this model (Kimi Linear chat format) has no thinking mode", param)
        return thinking, None
    if effort is not None and effort not in THINKING_EFFORTS:
        raise ApiError(400, f"{param}: thinking effort {effort!r} is not one of {', '.join(THINKING_EFFORTS)}", param)
    return thinking, effort if thinking is not False else None


def render_prompt(backend: Backend, messages: list[dict], *, tools: Optional[list] = None,
                  thinking: Optional[bool] = None, thinking_effort: Optional[str] = None,
                  tool_choice: Optional[str] = None, response_format: Any = None, images: Sequence = ()) -> Prompt:
    """Render a conversation (OpenAI-style message dicts, see ``kimi_mlx.chat.format``) with the generation prompt.
    ``images``: the prepared images of the messages' ``{"type": "image", "image": PromptImage}`` parts, in message
    order (they render as K3's media sequences).

    Boundaries are the token positions where each message begins after the first (= where the one before it
    ends) and where the last one ends; ``system_end`` is where the first non-system message begins (the tool
    declarations and system prompt before it are shared by conversations). Tool results are put in the order of the
    calls they answer (``kimi_mlx.chat.tool_ids``). A message the renderer refuses (or nests too deeply to render) is
    an ApiError naming ``messages``.
    """
    if backend.defaults.system is not None and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": backend.defaults.system}, *messages]
    try:
        messages = in_call_order(messages)
        tokens, starts = render_chat_with_starts(
            backend.tokenizer, messages, chat_format=backend.chat_format, tools=tools or None, thinking=thinking,
            thinking_effort=thinking_effort, tool_choice=tool_choice, response_format=response_format,
        )
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"messages: {e}", "messages") from None
    except RecursionError:
        raise ApiError(400, "messages: a value nests too deeply to render", "messages") from None
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    system_end = starts[first] or 0
    boundaries = tuple(sorted({s for s in starts[1:] if s}))
    return Prompt(tokens, boundaries, system_end, thinking, tuple(images))


def check_response_format(backend: Backend, response_format: Any, param: str) -> None:
    """A structured-output request (the renderer's ``response_format``; None: plain text) the chat format can
    render: Kimi Linear's has no JSON mode (ApiError naming ``param``)."""
    if backend.chat_format == "kimi_linear" and response_format is not None:
        raise ApiError(400, f"{param}: the Kimi Linear chat format has no JSON mode (only text)", param)


def check_tokens(backend: Backend, tokens: Sequence[int], param: str) -> None:
    """A non-empty prompt of ids inside the vocabulary, without image placeholders (a prompt without images;
    ApiError naming ``param``)."""
    if not tokens:
        raise ApiError(400, f"{param}: the prompt is empty", param)
    bad = next((t for t in tokens if not 0 <= t < backend.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary (0..{backend.vocab_size - 1})", param)
    pad = backend.image_encoder.placeholder_id if backend.image_encoder is not None else None
    if pad is not None and pad in tokens:
        raise ApiError(400, f"{param}: token id {pad} is the image placeholder; images go in chat messages "
                            "(/v1/chat/completions, /v1/messages)", param)


def reply_budget(backend: Backend, prompt_tokens: int, max_tokens: Optional[int], param: str,
                 prompt_param: str) -> int:
    """The reply's token limit: the request's (it must fit the context with the prompt; ApiError naming ``param``)
    or the server default, shortened to what fits. A prompt that leaves no room is an ApiError naming
    ``prompt_param``."""
    room = backend.max_context - prompt_tokens
    if room < 1:
        raise ApiError(400, f"{prompt_param}: the prompt is {prompt_tokens} tokens; this server's context limit is "
                            f"{backend.max_context} tokens (prompt + reply)", prompt_param, "context_length_exceeded")
    if max_tokens is None:
        return min(backend.defaults.max_tokens, room)
    if max_tokens > room:
        raise ApiError(400, f"{param}: {max_tokens} reply tokens do not fit: the prompt is {prompt_tokens} tokens "
                            f"and the context limit is {backend.max_context}; at most {room}", param,
                       "context_length_exceeded")
    return max_tokens


def sampling_params(backend: Backend, fields: Mapping[str, Any]) -> SamplingParams:
    """The server's default sampling with the request's given (non-None) fields on top. ``logit_bias`` keys must
    be token ids written in decimal ASCII digits, inside the vocabulary; a ``top_k`` at or above the vocabulary
    size keeps every token (as 0 does)."""
    given = {k: v for k, v in fields.items() if v is not None}
    bias = given.pop("logit_bias", None)
    if bias:
        out = {}
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < backend.vocab_size):
                raise ApiError(400, f"logit_bias: key {key[:40]!r} is not a token id in 0..{backend.vocab_size - 1}",
                               "logit_bias")
            out[int(key)] = float(value)
        given["logit_bias"] = out
    params = backend.defaults.sampling.updated(**given)
    if params.top_k >= backend.vocab_size:
        params = params.updated(top_k=0)
    return params


def reasoning_budget(backend: Backend, prompt: Prompt, tokens: Optional[int]) -> Optional[ReasoningBudget]:
    """The scheduler's limit for a reply's reasoning section: ``tokens`` reasoning tokens, then Kimi-K3's
    ``<|close|>think<|sep|><|open|>response<|sep|>`` (the section ends earlier at the model's own first XTML marker
    or stop token). None without a limit or a reasoning section: the prompt turned thinking off, or the format has
    none (Kimi Linear; ``resolve_thinking`` refuses to turn it on there)."""
    if tokens is None or prompt.thinking is False or backend.chat_format != "kimi_k3":
        return None
    markers = {backend.tokenizer.special_tokens[m] for m in XTML_MARKERS}
    close = encode_segments(close_tag("think") + open_tag("response"), backend.tokenizer)
    return ReasoningBudget(tokens, tuple(close), frozenset(markers) | stop_ids(backend))


def stop_ids(backend: Backend) -> frozenset:
    """The tokens that end a reply: the tokenizer's eos ids, which include the chat format's turn end."""
    return frozenset(backend.tokenizer.eos_token_ids)


def submit(backend: Backend, prompt: Prompt, max_tokens: int, sampling: SamplingParams,
           top_logprobs: Optional[int], reasoning: Optional[ReasoningBudget] = None, prediction: Optional[str] = None,
           speculative: Optional[bool] = None) -> RequestStream:
    """Queue the generation (stopping on ``stop_ids``); a full queue is a 429 with ``Retry-After``.
    ``prediction``: text the reply is expected to repeat (drafts are looked up there too); ``speculative`` False:
    no speculative decoding for this request."""
    request = GenerationRequest(
        tokens=list(prompt.tokens), max_tokens=max_tokens, sampling=sampling,
        stop_token_ids=stop_ids(backend), top_logprobs=top_logprobs,
        boundaries=prompt.boundaries, system_end=prompt.system_end, reasoning=reasoning, images=prompt.images,
        prediction=tuple(backend.tokenizer.encode(prediction, add_special_tokens=False)) if prediction else (),
        speculative=speculative is not False,
    )
    try:
        return backend.scheduler.submit(request)
    except ValueError as e:  # images the model cannot take; the routes check them first
        raise ApiError(400, str(e)) from None
    except QueueFullError as e:
        raise ApiError(429, str(e), code="rate_limit_exceeded",
                       headers={"Retry-After": str(max(1, round(e.retry_after)))}) from None
    except EngineStoppedError as e:
        raise ApiError(503, str(e)) from None


class ServerState:
    """The app's state: the served model id, the API key, the body limit, how often a stream that has nothing
    to send yet sends a keep-alive (``keepalive_s``), and the backend once it has loaded (``load_error`` if
    loading failed)."""

    def __init__(self, model_id: str, api_key: Optional[str], max_body_bytes: int, keepalive_s: float = 10.0):
        self.model_id, self.api_key, self.max_body_bytes = model_id, api_key, max_body_bytes
        self.keepalive_s = keepalive_s
        self.backend: Optional[Backend] = None
        self.load_error: Optional[str] = None
        self.created = int(time.time())

    def ready(self) -> Backend:
        """The backend; 503 while the model loads (or after it failed to)."""
        if self.backend is None:
            why = f"the model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise ApiError(503, why, headers={"Retry-After": "5"})
        return self.backend

    def check_model(self, name: Optional[str]) -> None:
        """404 unless ``name`` is the served model id (None: the request did not say, so it is this one)."""
        if name is not None and name != self.model_id:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_id!r}", "model",
                           "model_not_found")

    async def body(self, request) -> bytes:
        """The request body, refused with 413 beyond ``max_body_bytes`` (by its Content-Length or while reading)."""
        limit = self.max_body_bytes
        too_big = ApiError(413, f"the request body is over this server's limit of {limit / 2**20:g} MiB "
                                f"(--max-body-mb)")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)


def choose_tools(backend: Backend, tools: Optional[list], choice: Optional[str], name: Optional[str], param: str
                 ) -> tuple[Optional[list], Optional[str]]:
    """``(tools to declare, tool_choice for the renderer)`` for a request's tools (OpenAI-style declarations) and
    its choice: None/"auto", "none", "required", or "function" with ``name`` (declares only that tool and requires
    a call). Kimi Linear's format cannot require a call (ApiError naming ``param``); its "none" declares no tools."""
    if choice == "function":
        chosen = [t for t in tools or [] if t["function"]["name"] == name]
        if not chosen:
            raise ApiError(400, f"{param}: the tool {name!r} is not among the request's tools", param)
        tools, choice = chosen, "required"
    if backend.chat_format == "kimi_linear":
        if choice == "required":
            raise ApiError(400, f"{param}: the Kimi Linear chat format cannot require a tool call "
                                f"(use auto or none)", param)
        return (None if choice == "none" else tools), None
    return tools, (None if choice == "auto" else choice)


class _EventStream(StreamingResponse):
    """A streamed response that calls ``on_close`` when it ends, however it ends (done, failed, or the client
    gone before the first event), and then closes its chunks' generator: a client gone mid-stream leaves it
    suspended at a ``yield``, and its ``finally`` blocks (the request's log line) would otherwise wait for the
    garbage collector."""

    def __init__(self, chunks, on_close: Callable[[], None], media_type: str = "text/event-stream"):
        super().__init__(chunks, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def sse_response(chunks, stream: RequestStream) -> StreamingResponse:
    """Server-sent events from an async iterator of ready-made ``event:``/``data:`` text; ``stream`` (the
    generation behind them) is cancelled when the response ends, so a client that leaves stops it."""
    return _EventStream(chunks, stream.cancel)


def ndjson_response(lines, stream: RequestStream) -> StreamingResponse:
    """Newline-delimited JSON (``application/x-ndjson``) from an async iterator of ready-made lines; ``stream``
    is cancelled when the response ends, as in ``sse_response``."""
    return _EventStream(lines, stream.cancel, "application/x-ndjson")


def sse_data(obj: Any, event: Optional[str] = None) -> str:
    """One SSE message: ``data: JSON`` (after ``event: NAME`` when given)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def with_keepalive(pieces, every: float):
    """``pieces`` (an async iterator), with ``None`` yielded whenever ``every`` seconds pass without one (a long
    prefill), so the caller can send a keep-alive and the client's read timeout does not expire. Closing this
    generator closes ``pieces``."""
    it = pieces.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=every)
            if not done:
                yield None
                continue
            try:
                piece = nxt.result()
            except StopAsyncIteration:
                return
            yield piece
            nxt = asyncio.ensure_future(it.__anext__())
    finally:
        nxt.cancel()
        close = getattr(it, "aclose", None)
        if close is not None and nxt.done():
            await close()


async def collect(request, gen) -> list:
    """Every piece of ``gen`` (a ``Generation``, for a reply sent whole), cancelling it if the client disconnects
    meanwhile."""
    watcher = asyncio.ensure_future(watch_disconnect(request, gen.stream))
    try:
        return [piece async for piece in gen]
    finally:
        watcher.cancel()


async def watch_disconnect(request, stream) -> None:
    """Cancel ``stream`` when the client goes away (for replies sent whole; streamed ones are cancelled when the
    response stops). Run as a task next to the generation, cancelled when it is done."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.cancel()
