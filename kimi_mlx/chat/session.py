"""A multi-turn chat with one model cache: turns, cache reuse, regenerate/undo via checkpoints, save/load, stats.

No terminal code here (``kimi_mlx.cli.chat`` is the REPL). The session keeps the conversation as OpenAI-style
messages (``kimi_mlx.chat.format``) and the exact token history the cache has seen (``session.tokens``; invariant:
``session.cache.offset == len(session.tokens)``). A new turn renders the whole conversation and prefills only what the
cache has not seen:

- the cache's tokens are a prefix of the rendering (the usual case): prefill just the new tokens;
- otherwise (``/regenerate``, ``/undo``, an edited system prompt, a reply the renderer writes differently from how it
  was generated): restore the latest cache checkpoint that is a prefix of the rendering and prefill from there,
  falling back to a full prefill when no checkpoint fits (checkpoints are bounded, see ``HybridCache``).

Checkpoints are taken before the last prompt token of every turn (so a regenerate reuses the whole prompt) and after
every reply. ``send`` / ``regenerate`` / ``tool_results`` are generators of ``ChatEvent`` (reasoning / content text
deltas, tool calls); stopping one early (Ctrl-C, ``close()``) keeps the partial reply and a consistent cache.

Images (Kimi-K3 with a vision tower): ``send(text, images=[...])`` puts the images before the text in the user
message (as ``PromptImage`` parts, prepared once by the model's ``ImageEncoder``). A prefill places the features of
the images it overlaps on their placeholders (``ImagePrefill`` over the whole prompt from the first token fed), so
the images of earlier turns, already in the cache, are neither passed again nor re-encoded. The cache's history is
compared as a cache key (``session.keys``: ``session.tokens`` with each placeholder replaced by its image's
``key_id``), so a prompt whose image differs from the cached one only in pixels is never served from the cache.
``save`` stores each image's original file (base64) and ``load`` prepares it again: the same pixels, digests and
tokens.

    session = ChatSession(model, tokenizer, system="Be brief.", max_tokens=256, sampling={"temp": 0.7})
    for event in session.send("Hello!"):
        print(event.text, end="")
    session.last.stats            # TurnStats: prompt/prefill/reused tokens, tok/s, peak memory, finish reason
    session.save("chat.safetensors"); ChatSession.load("chat.safetensors", model, tokenizer)

Speculative decoding (``draft="lookup"`` or a draft model; ``kimi_mlx.speculative``): every reply is decoded with
drafts verified in one pass; the drafter sees the whole conversation (``InContext``: the tokens in the cache, then the
turn's), and a draft model's own cache follows it. The replies are those of plain decoding (greedy: the same tokens;
sampled: the same distribution), and so are the session's cache and checkpoints after every turn (the verify passes'
checkpoints are transient: none of the session's is released by them); ``TurnStats`` counts the drafted and
accepted tokens.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import mlx.core as mx

from .format import detect_chat_format, render_chat
from .images import image_file, prepare_image, prepare_images
from .parser import ReplyEvent, ReplyParser
from .saved_images import dump_messages, key_runs, keys_from_runs, load_messages
from .tool_ids import answer_order, tool_call_ids
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache

from ..generate import check_kv_settings, check_prompt, stream_generate
from ..image_prompt import ImagePrefill, ImageRows, PromptImage
from ..ops.memory import wired_during
from ..prompt_cache import PromptCacheError, load_prompt_cache, save_prompt_cache
from ..sampling import SamplingParams
from ..speculative import InContext, check_speculative_sampling, make_drafter

SESSION_KEY = "chat_session"  # prompt-cache file metadata key holding the session as JSON
STOP_MARKERS = {"kimi_linear": "<|im_end|>", "kimi_k3": "<|end_of_msg|>"}
THINKING_EFFORTS = ("low", "high", "max")


class ContextFullError(RuntimeError):
    """The conversation no longer fits the session's ``max_kv_size``."""


@dataclass
class ChatEvent:
    """One piece of a streamed reply: ``kind`` is "reasoning" or "content" (``text`` is the delta), "tool_call"
    (``tool_call`` is ``{"id", "type", "function": {"name", "arguments"}}``) or "warning" (malformed output kept as
    content; ``text`` says what)."""

    kind: str
    text: str = ""
    tool_call: Optional[dict] = None


@dataclass
class TurnStats:
    """prompt_tokens: the whole rendered prompt; prefill_tokens: the part actually prefilled this turn (the rest,
    reused_tokens, came from the cache); prompt_tps = prefill_tokens / prefill_s (prefill_s runs until the first
    reply token); finish_reason: "stop", "length", "context" (max_kv_size reached) or "interrupted".
    drafted_tokens / accepted_tokens: speculative decoding's drafts proposed to a verify pass this turn and those
    accepted (0 without a drafter); ``acceptance`` is their ratio (None when nothing was drafted)."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    prefill_s: float = 0.0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory_gb: float = 0.0
    finish_reason: str = ""
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance(self) -> Optional[float]:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None


@dataclass
class Turn:
    """The last reply: the assistant message added to the conversation, the turn's stats, the reply's token ids
    (``tokens``, including a stop token) and its tool calls (OpenAI-style dicts)."""

    message: dict
    stats: TurnStats
    tokens: list[int]
    tool_calls: list = field(default_factory=list)


@contextmanager
def _interrupts_deferred():
    """Hold back Ctrl-C (SIGINT) while the cache is being put back in order; re-raise it afterwards."""
    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or old is None:
        yield
        return
    hits = []
    signal.signal(signal.SIGINT, lambda *_: hits.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if hits:
        raise KeyboardInterrupt


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """One conversation with ``model``; see the module doc.

    system: system prompt (None: the format's default). tools: OpenAI-style tool declarations. thinking /
    thinking_effort: Kimi-K3 only (None: the format's defaults). chat_format: None detects it from the tokenizer.
    max_tokens: reply limit. max_kv_size: limit on the tokens in the cache (None: unlimited). sampling: a
    ``SamplingParams`` or a dict of its options (default greedy; a ``seed`` seeds every reply's draws, otherwise they
    come from MLX's generator); ``session.sampling`` may be set between turns the same ways. kv_bits (8 or 4; None:
    float) / kv_group_size / quantized_kv_start: the MLA latent cache is quantized once it holds
    ``quantized_kv_start`` tokens (see ``stream_generate``); saved files keep it quantized and ``load`` refuses a file
    of another setting. draft: None, "lookup" (prompt lookup over the conversation), a draft model (a Kimi model
    sharing the tokenizer: ``loading.load_draft``) or a ``Drafter``; num_draft_tokens: the most drafts per verify
    pass (the length adapts below it). See the module doc.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system: Optional[str] = None,
        tools: Optional[list] = None,
        thinking: Optional[bool] = None,
        thinking_effort: Optional[str] = None,
        chat_format: Optional[str] = None,
        max_tokens: int = 512,
        max_kv_size: Optional[int] = None,
        max_checkpoints: int = 8,
        sampling: Union[SamplingParams, Mapping[str, Any], None] = None,
        prefill_step_size: int = 2048,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = 0,
        draft=None,
        num_draft_tokens: int = 8,
    ):
        check_kv_settings(None, kv_bits, kv_group_size, quantized_kv_start)
        self.kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "quantized_kv_start": quantized_kv_start}
        if draft is not None and num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.drafter = make_drafter(draft, num_draft_tokens, **self.kv)  # a draft model's cache quantized as ours
        self.num_draft_tokens = num_draft_tokens
        self.model, self.tokenizer = model, tokenizer
        self.chat_format = chat_format or detect_chat_format(tokenizer)
        if self.chat_format not in STOP_MARKERS:
            raise ValueError(f"chat_format={self.chat_format!r}: expected one of {', '.join(STOP_MARKERS)}")
        self.system, self.tools = system, tools
        self.thinking, self.thinking_effort = None, None
        self.set_thinking(thinking)
        self.set_effort(thinking_effort)
        if max_kv_size is not None and max_kv_size < 2:
            raise ValueError(f"max_kv_size must be >= 2, got {max_kv_size}")
        self.max_tokens, self.max_kv_size = max_tokens, max_kv_size
        self.sampling = sampling
        self.prefill_step_size = prefill_step_size
        self.messages: list[dict] = []
        self.tokens: list[int] = []
        self.keys: list[int] = []  # self.tokens as a cache key: image placeholders -> their image's key_id
        self.image_encoder = getattr(model, "image_encoder", None)
        self.image_files: dict[str, bytes] = {}  # digest -> original file of each image sent (for save)
        self.cache = model.make_cache(max_checkpoints=max_checkpoints)
        self.last: Optional[Turn] = None
        self.turns = 0
        marker = tokenizer.special_tokens.get(STOP_MARKERS[self.chat_format]) if hasattr(
            tokenizer, "special_tokens") else None
        self.stop_tokens = [marker] if marker is not None else []

    # ----- settings
    @property
    def sampling(self) -> SamplingParams:
        """The replies' sampling options."""
        return self._sampling

    @sampling.setter
    def sampling(self, value: Union[SamplingParams, Mapping[str, Any], None]) -> None:
        params = value if isinstance(value, SamplingParams) else SamplingParams().updated(**(value or {}))
        if self.drafter is not None:
            check_speculative_sampling(params)
        self._sampling = params

    def set_thinking(self, on: Optional[bool]) -> None:
        """Turn K3 thinking on/off (None: the format's default); Kimi Linear has no thinking section."""
        if on and self.chat_format != "kimi_k3":
            raise ValueError("thinking: this model's chat format (Kimi Linear) has no thinking section")
        self.thinking = on

    def set_effort(self, effort: Optional[str]) -> None:
        """Set the K3 thinking effort (low/high/max; None: the format's default)."""
        if effort is not None:
            if self.chat_format != "kimi_k3":
                raise ValueError("thinking effort: this model's chat format (Kimi Linear) has no thinking effort")
            if effort not in THINKING_EFFORTS:
                raise ValueError(f"thinking effort {effort!r}: expected one of {', '.join(THINKING_EFFORTS)}")
        self.thinking_effort = effort

    # ----- conversation
    def conversation(self) -> list[dict]:
        """The messages as rendered: the system prompt (when set) followed by the turns."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + self.messages

    def render(self, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the whole conversation in the model's chat format."""
        return self._render(add_generation_prompt)[0]

    def _render(self, add_generation_prompt: bool = True) -> tuple[list[int], Optional[ImageRows]]:
        """(ids, the conversation's images lined up with their placeholders; None without images)."""
        messages, images = prepare_images(self.conversation(), self.image_encoder)
        ids = render_chat(
            self.tokenizer, messages, tools=self.tools, thinking=self.thinking,
            thinking_effort=self.thinking_effort, add_generation_prompt=add_generation_prompt,
            chat_format=self.chat_format,
        )
        return ids, (ImageRows(ids, images, self.image_encoder.placeholder_id) if images else None)

    def attach(self, image: Any, where: str = "image") -> PromptImage:
        """Prepare ``image`` (path, bytes, PIL image, uint8 array) for a message with the model's ``ImageEncoder``
        and keep its file for ``save``. ``ValueError`` starting with ``where``: unreadable, several frames, or a
        model without a vision tower."""
        if self.image_encoder is None:
            raise ValueError(f"{where}: {getattr(self.model, 'no_images_reason', 'this model has no vision tower')}")
        prepared = prepare_image(image, self.image_encoder, where)
        data = image_file(image)
        if data is not None:
            self.image_files[prepared.digest] = data
        return prepared

    def send(self, text: str, max_tokens: Optional[int] = None, *, images: Sequence[Any] = ()) -> Iterator[ChatEvent]:
        """Add a user message and stream the reply. ``images`` (K3 with a vision tower): this turn's images (paths,
        bytes, PIL images, uint8 arrays or ``attach``'s results), placed before ``text``."""
        content: Any = text
        if images:
            parts = [{"type": "image", "image": self.attach(im, f"image {j}")} for j, im in enumerate(images)]
            content = [*parts, {"type": "text", "text": text}]
        return self._turn([{"role": "user", "content": content}], max_tokens)

    def tool_results(self, results: Sequence[tuple[dict, str]], max_tokens: Optional[int] = None) -> Iterator[ChatEvent]:
        """Add ``(call, result text)`` for the last reply's tool calls (``Turn.tool_calls`` entries; in any order,
        they are written in call order, as the chat templates pair results with calls by position) and stream the
        model's next reply. ``ValueError`` for a call the last reply did not make or one answered twice."""
        messages = [
            {"role": "tool", "tool_call_id": call.get("id"), "name": call["function"]["name"], "content": content}
            for call, content in results
        ]
        last = max((i for i, m in enumerate(self.messages) if m["role"] == "assistant"), default=None)
        calls = [c for c in tool_call_ids(self.messages) if c.message == last]
        messages = [messages[k] for k in answer_order(calls, messages, complete=False)]
        return self._turn(messages, max_tokens)

    def regenerate(self, max_tokens: Optional[int] = None) -> Iterator[ChatEvent]:
        """Drop the last assistant reply and stream a new one (the prompt is restored from a checkpoint)."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ValueError("nothing to regenerate: the conversation does not end with a reply")
        self.messages.pop()
        return self._turn([], max_tokens)

    def undo(self) -> int:
        """Remove the last exchange (the last user message and everything after it); returns how many messages went.
        The cache rolls back at the next turn (to a checkpoint when one fits)."""
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        if not users:
            raise ValueError("nothing to undo: no user message yet")
        removed = len(self.messages) - users[-1]
        del self.messages[users[-1]:]
        self.last = None
        return removed

    def reset(self) -> None:
        """Forget the conversation (settings stay) and empty the cache."""
        self.messages, self.tokens, self.keys, self.last, self.image_files = [], [], [], None, {}
        self.cache.reset()

    # ----- the turn
    @staticmethod
    def _keys(ids: Sequence[int], rows: Optional[ImageRows]) -> list[int]:
        return rows.key(ids) if rows is not None else list(ids)

    def _prefill(self, ids: Sequence[int], keys: Sequence[int], rows: Optional[ImageRows], end: int) -> None:
        """Feed ``ids[len(self.tokens):end]`` (``keys`` its cache key), the features of ``rows``'s images on their
        placeholders, in chunks."""
        start = len(self.tokens)
        model = self.model
        if rows is not None and start < rows.end:
            model = ImagePrefill(self.model, rows, start, self.image_encoder.features)
        for a in range(start, end, self.prefill_step_size):
            b = min(a + self.prefill_step_size, end)
            model(mx.array(ids[a:b])[None], cache=self.cache)
            maybe_quantize_kv_cache(self.cache, self.kv["quantized_kv_start"], self.kv["kv_group_size"],
                                    self.kv["kv_bits"])
            mx.eval([c.state for c in self.cache])
            self.tokens.extend(ids[a:b])
            self.keys.extend(keys[a:b])

    def _roll_back(self, limit: int) -> None:
        """Restore the latest kept checkpoint at or before ``limit`` tokens (or empty the cache when none fits)."""
        fits = [cp for cp in self.cache.checkpoints if cp.offset <= limit]
        if fits:
            cp = max(fits, key=lambda c: c.offset)
            self.cache.restore(cp)
            del self.tokens[cp.offset :], self.keys[cp.offset :]
        else:
            self.cache.reset()
            self.tokens, self.keys = [], []

    def _rewind(self, target: Sequence[int], keep: int = 1) -> int:
        """Roll the cache back to the longest state whose key is a prefix of ``target`` (a cache key) with at least
        ``keep`` tokens of it left to feed; returns the number of tokens reused."""
        limit = min(_common_prefix(self.keys, target), len(target) - keep)
        if len(self.tokens) > limit:
            self._roll_back(limit)
        return len(self.tokens)

    def _settle(self, target: Optional[Sequence[int]] = None, rows: Optional[ImageRows] = None) -> None:
        """After a turn (maybe interrupted mid-step): make the cache consistent with ``self.tokens`` again, rolling
        back to a checkpoint (or empty) when a model call was cut short; then, given ``target`` (a continuation of
        the tokens seen; ``rows`` its prompt's images), make the cache hold exactly ``target``."""
        offsets = {c.offset for c in self.cache}
        if target is not None and offsets == {len(target)}:
            # the generator fed every yielded token: nothing to redo
            self.tokens, self.keys = list(target), self._keys(target, rows)
            return
        if target is not None and offsets == {len(target) - 1} and len(target) > len(self.tokens) + 1:
            # every yielded token but the last (speculative decoding feeds a pass's last token with the next pass)
            keys = self._keys(target, rows)
            self.tokens, self.keys = list(target[:-1]), keys[:-1]
            self._prefill(target, keys, rows, len(target))
            return
        if offsets != {len(self.tokens)}:
            self._roll_back(len(self.tokens))
        if target is not None:
            keys = self._keys(target, rows)
            self._rewind(keys, keep=0)
            self._prefill(target, keys, rows, len(target))

    def _turn(self, new_messages: list[dict], max_tokens: Optional[int]) -> Iterator[ChatEvent]:
        self.messages.extend(new_messages)
        try:
            prompt, rows = self._render()
            check_prompt(self.model, mx.array(prompt, dtype=mx.int32))
        except (ValueError, TypeError):
            del self.messages[len(self.messages) - len(new_messages) :]
            raise
        budget = self.max_tokens if max_tokens is None else max_tokens
        if self.max_kv_size is not None:
            room = self.max_kv_size - len(prompt)
            if room < 1:
                del self.messages[len(self.messages) - len(new_messages) :]
                raise ContextFullError(
                    f"context full: the conversation is {len(prompt)} tokens and the limit (max_kv_size) is "
                    f"{self.max_kv_size}; /undo, /reset, or start with a larger --max-kv-size"
                )
            budget = min(budget, room)
        return self._generate(prompt, rows, budget, len(new_messages), budget < (max_tokens or self.max_tokens))

    @wired_during(generation_stream)  # on a Mac the model's memory stays wired through the prefill and the reply
    def _generate(self, prompt: list[int], rows: Optional[ImageRows], budget: int, n_new: int, capped: bool
                  ) -> Iterator[ChatEvent]:
        stats = TurnStats(prompt_tokens=len(prompt))
        tic = time.perf_counter()
        reply: list[int] = []
        parser = ReplyParser(self.chat_format, thinking=self.thinking)
        last = None
        try:
            stats.reused_tokens = self._rewind(self._keys(prompt, rows))
            stats.prefill_tokens = len(prompt) - stats.reused_tokens
            self._prefill(prompt, self._keys(prompt, rows), rows, len(prompt) - 1)
            self.cache.checkpoint()
            mx.reset_peak_memory()
            for last in stream_generate(
                self.model, self.tokenizer, prompt[-1:], budget, stop_tokens=self.stop_tokens,
                prompt_cache=self.cache, sampling=self.sampling, **self.kv, **self._draft(),
            ):
                if not reply:
                    stats.prefill_s = time.perf_counter() - tic
                reply.append(last.token)
                yield from _events(parser.feed(last.text))
            yield from _events(parser.finish())
            stats.finish_reason = last.finish_reason if last is not None else "stop"
            if capped and stats.finish_reason == "length":
                stats.finish_reason = "context"
        finally:
            with _interrupts_deferred():
                if not stats.finish_reason:
                    stats.finish_reason = "interrupted"
                if not reply:  # nothing generated (interrupted in the prefill): the turn did not happen
                    del self.messages[len(self.messages) - n_new :]
                    self._settle()
                else:
                    self._settle(prompt + reply, rows)
                    self.cache.checkpoint()
                    self._finish(parser, stats, last, reply)
        if stats.finish_reason == "context":
            raise ContextFullError(
                f"context full: the reply stopped at the limit (max_kv_size {self.max_kv_size} tokens); "
                "/undo, /reset, or start with a larger --max-kv-size"
            )

    def _draft(self) -> dict[str, Any]:
        """``stream_generate``'s speculation keywords for this turn: the drafter seeing the cache's tokens first."""
        if self.drafter is None:
            return {}
        return {"draft": InContext(self.drafter, self.tokens), "num_draft_tokens": self.num_draft_tokens}

    def _finish(self, parser: ReplyParser, stats: TurnStats, last, reply: list[int]) -> None:
        parser.finish()  # a no-op unless the stream was cut short
        message = parser.reply.to_message()
        self.messages.append(message)
        stats.generation_tokens = len(reply)
        if last is not None:
            stats.generation_tps = last.generation_tps
            stats.peak_memory_gb = last.peak_memory
            stats.drafted_tokens = getattr(last, "drafted_tokens", 0)
            stats.accepted_tokens = getattr(last, "accepted_tokens", 0)
        if stats.prefill_s:
            stats.prompt_tps = stats.prefill_tokens / stats.prefill_s
        self.last = Turn(message, stats, list(reply), list(message.get("tool_calls") or []))
        self.turns += 1

    # ----- persistence and stats
    def state(self) -> dict[str, Any]:
        """The conversation and settings as plain JSON data (what ``save`` stores beside the cache)."""
        return {
            "messages": dump_messages(self.messages, self.image_files), "system": self.system, "tools": self.tools,
            "thinking": self.thinking, "thinking_effort": self.thinking_effort, "chat_format": self.chat_format,
            "cache_images": key_runs(self.tokens, self.keys),
        }

    def save(self, path: Union[str, Path]) -> None:
        """Write the cache, its token history and the conversation to one prompt-cache file."""
        save_prompt_cache(path, self.model, self.cache, self.tokens, {SESSION_KEY: json.dumps(self.state())})

    def load(self, path: Union[str, Path]) -> None:
        """Replace this session's conversation, settings and cache with those saved in ``path``."""
        self.restore(self.read_saved(path))

    def read_saved(self, path: Union[str, Path]) -> tuple[Any, dict]:
        """(cache file, session state) saved in ``path``, checked against this session; nothing is changed yet."""
        loaded = load_prompt_cache(path, self.model, max_checkpoints=self.cache.max_checkpoints, **self.kv)
        if SESSION_KEY not in loaded.metadata:
            raise PromptCacheError(f"{path}: a prompt-cache file without a chat session (not written by /save)")
        try:
            state = json.loads(loaded.metadata[SESSION_KEY])
            messages, fmt = list(state["messages"]), state["chat_format"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise PromptCacheError(f"{path}: the saved chat session is malformed ({e})") from None
        if fmt != self.chat_format:
            raise PromptCacheError(f"{path}: saved with chat format {fmt!r}, this session uses {self.chat_format!r}")
        pid = self.image_encoder.placeholder_id if self.image_encoder is not None else None
        try:
            messages, files = load_messages(messages, self.image_encoder, str(path))
            keys = keys_from_runs(loaded.tokens, state.get("cache_images"), pid, str(path))
        except ValueError as e:
            raise PromptCacheError(str(e)) from None
        return loaded, {**state, "messages": messages, "image_files": files, "keys": keys}

    def restore(self, saved: tuple[Any, dict]) -> None:
        """Take the conversation, settings and cache of ``read_saved``'s result."""
        loaded, state = saved
        self.messages, self.system, self.tools = state["messages"], state.get("system"), state.get("tools")
        self.thinking, self.thinking_effort = state.get("thinking"), state.get("thinking_effort")
        self.cache, self.tokens, self.keys, self.last = loaded.cache, loaded.tokens, state["keys"], None
        self.image_files = state["image_files"]
        self.cache.checkpoint()

    def stats(self) -> dict[str, Any]:
        """Session totals: turns, messages, tokens in the cache, cache + checkpoint bytes, the last turn's stats."""
        return {
            "turns": self.turns, "messages": len(self.messages), "context_tokens": len(self.tokens),
            "max_kv_size": self.max_kv_size, "checkpoints": len(self.cache.checkpoints),
            "cache_mb": self.cache.nbytes / 1e6, "last": asdict(self.last.stats) if self.last else None,
        }


def _events(events: list[ReplyEvent]) -> Iterator[ChatEvent]:
    """``ChatEvent``s of the parser's events (tool calls as OpenAI-style dicts)."""
    for e in events:
        yield ChatEvent(e.kind, e.text, e.tool_call.to_dict() if e.tool_call is not None else None)
