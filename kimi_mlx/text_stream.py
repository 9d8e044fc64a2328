"""One reply as text, token by token: a streaming detokenizer, stop tokens and stop strings (``TextStream``). Used by
``stream_generate``, the server and ``chat.reply_stream.ReplyStream`` (the same text split into reasoning / content /
tool calls).

Text that could still turn into a stop string is held back; when a stop string appears the text ends just before it
(``stop_string`` says which) and the caller stops generating. A stop token (eos, the chat format's turn end) ends
the reply without adding text (``stop_token`` says which). Empty stop strings are ignored.

    text = TextStream(tokenizer, stop_strings=["\\n\\n"], stop_ids=frozenset(tokenizer.eos_token_ids))
    for token in tokens:
        print(text.add(token), end="")
        if text.stopped:
            break                      # stop generating
    print(text.finish())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional


def held_back(text: str, stop_strings: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could still be the start of a stop string."""
    hold = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


class TextStream:
    """Incremental text of one reply; see the module docstring.

    ``add(token)`` and ``finish()`` return the text that became safe to show; ``text`` is everything shown so far.
    tokenizer: mlx-lm's ``TokenizerWrapper`` (``detokenizer`` gives a fresh streaming detokenizer).
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), stop_ids: frozenset = frozenset()):
        self._detok = tokenizer.detokenizer
        self._decoded = ""
        self._stops = [s for s in stop_strings if s]
        self._stop_ids = stop_ids
        self.text = ""
        self.stop_string: Optional[str] = None
        self.stop_token: Optional[int] = None

    @property
    def stopped(self) -> bool:
        """A stop token or a stop string ended the reply: later tokens add nothing."""
        return self.stop_string is not None or self.stop_token is not None

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        if token in self._stop_ids:
            self.stop_token = token
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
