"""One request's reply as text: token ids -> text (a fresh streaming detokenizer per request), stop strings, and
for chat replies the split into reasoning / content / tool calls (``kimi_mlx.chat.parser.ReplyParser``);
``Generation`` drives it from the scheduler's events and logs one line per request.

Text that could still turn into a stop string is held back; when a stop string appears the text ends just before
it (``stop_string`` says which) and the caller cancels the generation. Stop tokens (eos, the chat format's turn end)
end the reply without adding text.

    text = TextStream(tokenizer, stop_strings=["\\n\\n"], stop_ids=frozenset(tokenizer.eos_token_ids))
    for token in tokens:
        print(text.add(token), end="")
        if text.stop_string is not None:
            break                      # cancel the generation
    print(text.finish())
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ..chat.parser import ReplyEvent, ReplyParser
from ..generate import held_back
from .scheduler import FinishEvent, RequestStream, TokenEvent

log = logging.getLogger("kimi_mlx.server")


class TextStream:
    """Incremental text of one reply; see the module docstring.

    ``add(token)`` and ``finish()`` return the text that became safe to show; ``text`` is everything shown so far.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), stop_ids: frozenset = frozenset()):
        self._detok = tokenizer.detokenizer  # a fresh copy per call (mlx-lm's TokenizerWrapper)
        self._decoded = ""
        self._stops = [s for s in stop_strings if s]
        self._stop_ids = stop_ids
        self.text = ""
        self.stop_string: Optional[str] = None

    def add(self, token: int) -> str:
        if self.stop_string is not None or token in self._stop_ids:
            return ""
        self._detok.add_token(token)
        self._decoded += self._detok.last_segment
        return self._release(final=False)

    def finish(self) -> str:
        """The held-back tail (unless a stop string ended the reply)."""
        if self.stop_string is not None:
            return ""
        self._detok.finalize()
        self._decoded += self._detok.last_segment
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        start = len(self.text)  # no stop string starts before here: its prefix would have been held back
        hits = [(i, s) for s in self._stops if (i := self._decoded.find(s, start)) >= 0]
        if hits:
            end, self.stop_string = min(hits)
        else:
            end = len(self._decoded) - (0 if final else held_back(self._decoded, self._stops))
        out = self._decoded[start:end] if end > start else ""
        self.text += out
        return out


class ReplyStream:
    """A chat reply: ``TextStream`` feeding a ``ReplyParser`` (``chat_format``, ``thinking`` as rendered);
    ``add``/``finish`` return the parser's events (reasoning / content deltas, tool calls, warnings)."""

    def __init__(self, tokenizer, chat_format: str, thinking: Optional[bool], stop_strings: Sequence[str] = (),
                 stop_ids: frozenset = frozenset()):
        self.text = TextStream(tokenizer, stop_strings, stop_ids)
        self.parser = ReplyParser(chat_format, thinking=thinking)

    @property
    def stop_string(self) -> Optional[str]:
        return self.text.stop_string

    def add(self, token: int) -> list[ReplyEvent]:
        delta = self.text.add(token)
        return self.parser.feed(delta) if delta else []

    def finish(self) -> list[ReplyEvent]:
        return self.parser.feed(self.text.finish()) + self.parser.finish()


@dataclass
class Piece:
    """What one generated token adds: ``token`` (its ``TokenEvent``; None for the final flush), ``text`` (the new
    text) and, for a chat reply, ``events`` (the parser's)."""

    token: Optional[TokenEvent]
    text: str = ""
    events: list = field(default_factory=list)


def _piece(token: Optional[TokenEvent], out: str | list) -> Piece:
    """A piece from what ``TextStream`` (text) or ``ReplyStream`` (parser events) returned."""
    return Piece(token, out) if isinstance(out, str) else Piece(token, events=out)


class Generation:
    """One submitted request's events turned into ``Piece``s (``async for piece in gen``), with its finish and
    usage, and one log line when it ends.

    ``reply``: a ``TextStream`` (completions) or ``ReplyStream`` (chat). A stop string cancels the generation; the
    tokens after it are dropped. If the consumer stops early (client gone), the generation is cancelled.
    """

    def __init__(self, stream: RequestStream, reply: TextStream | ReplyStream, route: str, prompt_tokens: int):
        self.stream, self.reply, self.route = stream, reply, route
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish: Optional[FinishEvent] = None
        self._tic = time.perf_counter()
        self._first: Optional[float] = None

    @property
    def cached_tokens(self) -> int:
        return self.stream.cached_tokens

    @property
    def stop_string(self) -> Optional[str]:
        return self.reply.stop_string

    @property
    def reason(self) -> str:
        """"stop" (a stop token or string), "length", or "error"/"cancelled" as the scheduler said."""
        if self.stop_string is not None:
            return "stop"
        return self.finish.reason if self.finish is not None else "cancelled"

    async def __aiter__(self) -> AsyncIterator[Piece]:
        try:
            async for event in self.stream:
                if isinstance(event, FinishEvent):
                    self.finish = event
                elif self.stop_string is None:
                    if self._first is None:
                        self._first = time.perf_counter()
                    self.completion_tokens += 1
                    yield _piece(event, self.reply.add(event.token))
                    if self.stop_string is not None:
                        self.stream.cancel()
            if self.finish.reason != "error":
                yield _piece(None, self.reply.finish())
        finally:
            self.stream.cancel()
            self._log()

    def _log(self) -> None:
        now = time.perf_counter()
        first = self._first or now
        decode_s = now - first
        rate = (self.completion_tokens - 1) / decode_s if self.completion_tokens > 1 and decode_s > 0 else 0.0
        reason = self.reason if self.finish is not None or self.stop_string else "client disconnected"
        error = f" ({self.finish.error})" if self.finish is not None and self.finish.error else ""
        log.info(f"{self.route} | prompt {self.prompt_tokens} tok, {self.cached_tokens} cached, first token "
                 f"{first - self._tic:.2f} s | generated {self.completion_tokens} tok, {rate:.1f} tok/s | "
                 f"{reason}{error}")
