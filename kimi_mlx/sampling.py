"""The sampling options of every generation path (``stream_generate``, ``ChatSession``, the server, the CLI) as one
typed, validated ``SamplingParams``, and ``make_sampling``: mlx-lm's sampler and logits processors for it.

The options, in the order they act on a step's logits ``[1, vocab]``:
- ``logits_processors`` (callables ``(tokens [n], logits [1, vocab]) -> logits``), then ``logit_bias`` ({token id:
  added logit}), ``repetition_penalty`` (logit / r, or * r when negative; 1 or None: off), ``presence_penalty`` and
  ``frequency_penalty`` (minus the penalty once, or per occurrence): the penalties count the last 20 tokens of the
  history (the prompt as given, then the reply);
- then a token is drawn: ``temp`` 0 is greedy; otherwise ``top_p`` (nucleus; 0 or 1: off), ``min_p`` (keep p >=
  min_p * max p; 0: off) and ``top_k`` (0: off) restrict the candidates by the model's probabilities, and a token is
  drawn from softmax(logits / temp) over them. A given ``sampler`` (log-probabilities ``[1, vocab]`` -> token id
  ``[1]``) replaces temp/top_p/top_k/min_p.
- ``seed``: the draws start from ``mx.random.seed(seed % 2**64)`` (so any integer works: -1 is 2**64 - 1); None
  draws from MLX's generator as it stands (the server picks a random seed per request).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from numbers import Integral, Real
from typing import Any, Callable, Optional


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _fail(name: str, value: Any, expected: str) -> None:
    raise ValueError(f"sampling: {name} is {value!r}; expected {expected}")


@dataclass(frozen=True)
class SamplingParams:
    """The sampling options (see the module docstring); checked when made, each error names its option."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Mapping[int, float]] = None
    seed: Optional[int] = None
    sampler: Optional[Callable] = None
    logits_processors: Optional[Sequence[Callable]] = None

    def __post_init__(self) -> None:
        for name, low, high in (("temp", 0, math.inf), ("top_p", 0, 1), ("min_p", 0, 1)):
            value = getattr(self, name)
            if not _is_real(value) or not low <= value <= high:
                _fail(name, value, "a number >= 0" if high == math.inf else f"a number in [{low}, {high}]")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", self.top_k, "an integer >= 0 (0: off)")
        if self.repetition_penalty is not None and not (_is_real(self.repetition_penalty)
                                                        and self.repetition_penalty >= 0):
            _fail("repetition_penalty", self.repetition_penalty, "a number >= 0 or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not _is_real(value):
                _fail(name, value, "a number or None")
        bias = self.logit_bias
        if bias is not None and not (isinstance(bias, Mapping)
                                     and all(_is_int(t) and t >= 0 and _is_real(b) for t, b in bias.items())):
            _fail("logit_bias", bias, "a mapping of token ids to added logits, or None")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "an integer or None")
        if self.sampler is not None and not callable(self.sampler):
            _fail("sampler", self.sampler, "a callable (log-probabilities -> token id) or None")
        procs = self.logits_processors
        if procs is not None and not (isinstance(procs, Sequence) and all(callable(p) for p in procs)):
            _fail("logits_processors", procs, "a list of callables (tokens, logits) -> logits, or None")

    def updated(self, **options: Any) -> "SamplingParams":
        """A copy with ``options`` (option name -> value) changed; an unknown name is a ValueError listing the
        options."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"sampling: unknown option(s) {', '.join(unknown)}; expected {', '.join(OPTIONS)}")
        return replace(self, **options)

    def to_json(self) -> dict:
        """The options as JSON data (``logit_bias`` as [id, bias] pairs); the callables cannot travel, so a params
        with a ``sampler`` or ``logits_processors`` is refused."""
        if self.sampler is not None or self.logits_processors:
            raise ValueError("sampling: a sampler or logits_processors cannot be sent to other processes")
        data = {name: getattr(self, name) for name in OPTIONS if name not in ("sampler", "logits_processors")}
        if self.logit_bias:
            data["logit_bias"] = [[int(t), float(b)] for t, b in self.logit_bias.items()]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "SamplingParams":
        """The params ``to_json`` wrote."""
        data = dict(data)
        if data.get("logit_bias"):
            data["logit_bias"] = {int(t): b for t, b in data["logit_bias"]}
        return cls(**data)


OPTIONS = tuple(f.name for f in fields(SamplingParams))


def make_sampling(params: SamplingParams) -> tuple[Callable, list[Callable]]:
    """(sampler, logits processors) for ``params``, from mlx-lm's ``make_sampler`` and ``make_logits_processors``:
    the sampler maps log-probabilities ``[B, vocab]`` to token ids ``[B]``; each processor maps (tokens so far
    ``[n]``, logits ``[B, vocab]``) to logits. ``params.logits_processors`` run first. ``seed`` is the caller's."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler  # mlx-lm's package imports transformers

    p = params
    sampler = p.sampler
    if sampler is None:
        sampler = make_sampler(temp=p.temp, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p)
    processors = list(p.logits_processors or []) + make_logits_processors(
        logit_bias=p.logit_bias, repetition_penalty=None if p.repetition_penalty == 1.0 else p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
    )
    return sampler, processors
