"""One submitted request's reply for the HTTP routes: ``Generation`` turns the scheduler's token events into text
pieces through the request's ``TextStream`` (completions) or ``ReplyStream`` (chat; ``chat/reply_stream.py``), cancels
the generation when a stop string ends the reply or the client goes, and logs one line per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Optional

from ..chat.reply_stream import ReplyStream
from ..text_stream import TextStream
from .scheduler import FinishEvent, RequestStream, TokenEvent

log = logging.getLogger("kimi_mlx.server")


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
        self._end: Optional[float] = None

    @property
    def cached_tokens(self) -> int:
        return self.stream.cached_tokens

    @property
    def drafts(self) -> tuple[int, int]:
        """``(drafted, accepted)``: draft tokens verified for this reply and those of them in it (0, 0 without
        speculation or before the end)."""
        return (self.finish.drafted, self.finish.accepted) if self.finish is not None else (0, 0)

    @property
    def stop_string(self) -> Optional[str]:
        return self.reply.stop_string

    @property
    def reason(self) -> str:
        """"stop" (a stop token or string), "length", or "error"/"cancelled" as the scheduler said."""
        if self.stop_string is not None:
            return "stop"
        return self.finish.reason if self.finish is not None else "cancelled"

    @property
    def timings(self) -> tuple[float, float]:
        """``(prefill_s, decode_s)``: seconds from submission to the first generated token (the prompt's prefill,
        queueing included) and from it to the end (or to now, while it runs)."""
        end = self._end or time.perf_counter()
        first = self._first or end
        return first - self._tic, end - first

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
            self._end = time.perf_counter()
            self._log()

    def _log(self) -> None:
        now = time.perf_counter()
        first = self._first or now
        decode_s = now - first
        rate = (self.completion_tokens - 1) / decode_s if self.completion_tokens > 1 and decode_s > 0 else 0.0
        reason = self.reason if self.finish is not None or self.stop_string else "client disconnected"
        error = f" ({self.finish.error})" if self.finish is not None and self.finish.error else ""
        drafted, accepted = self.drafts
        spec = f" | drafts {accepted}/{drafted} accepted ({accepted / drafted:.0%})" if drafted else ""
        log.info(f"{self.route} | prompt {self.prompt_tokens} tok, {self.cached_tokens} cached, first token "
                 f"{first - self._tic:.2f} s | generated {self.completion_tokens} tok, {rate:.1f} tok/s{spec} | "
                 f"{reason}{error}")
