"""A chat reply as it streams: ``ReplyStream`` feeds a ``TextStream`` (detokenizer, stop tokens, stop strings with
hold-back) into a ``ReplyParser``, so each token gives the parser's events (reasoning / content deltas, tool calls,
warnings). The server's chat routes use it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from ..text_stream import TextStream
from .parser import ReplyEvent, ReplyParser


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
