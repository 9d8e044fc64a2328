"""Fine-tuning data: jsonl files in mlx-lm's three forms, tokenized with the model's own chat format.

A data directory holds ``train.jsonl`` / ``valid.jsonl`` / ``test.jsonl`` (mlx-lm's layout), or ``--data`` names a
single ``.jsonl`` that is split by ratio. Each line is one of (the form is taken from the first record; every
record must have its keys):

- ``{"text": ...}``: plain text, plus EOS;
- ``{"prompt": ..., "completion": ...}``: rendered as a user turn and an assistant turn;
- ``{"messages": [...], "tools": [...]?}``: a chat, rendered by ``kimi_mlx.chat.format.render_chat`` in the
  model's format (Kimi Linear's, or K3's XTML with reasoning and tool calls).

Items are ``(token ids, prompt length)`` like mlx-lm's datasets, so mlx-lm's ``iterate_batches`` (length-sorted
batches, truncation to ``max_seq_length`` with a warning) and ``default_loss`` (which masks the first ``prompt
length`` targets) run on them unchanged. The prompt length is the number of leading tokens
shared with the conversation rendered up to the last assistant turn plus the generation prompt: with
``mask_prompt`` the loss covers only the final response.

mlx-lm's dataset classes are not reused because they render through ``tokenizer.apply_chat_template`` (Jinja);
ours render with ``render_chat`` (segment-aware: control ids only for the markers the renderer writes) and
report malformed records by file and line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional, Union

from ..chat.format import render_chat

SPLITS = ("train", "valid", "test")


class DataError(ValueError):
    """Unusable fine-tuning data; the message names the file and line."""


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """``(line number, record)`` for every non-blank line; a line that is not a JSON object is a ``DataError``."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            records.append((lineno, record))
    return records


def record_form(record: dict) -> str:
    """``"completions"``, ``"chat"`` or ``"text"`` (mlx-lm's precedence), else ``""``."""
    if "prompt" in record and "completion" in record:
        return "completions"
    if "messages" in record:
        return "chat"
    if "text" in record:
        return "text"
    return ""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class JsonlDataset:
    """Records of one split, tokenized lazily: ``dataset[i] -> (tokens, prompt_length)``.

    Follows mlx-lm's dataset protocol (``__getitem__`` returns the raw record, ``process`` tokenizes it) so mlx-lm's
    ``CacheDataset`` and ``iterate_batches`` work on it.
    """

    def __init__(self, records: list[tuple[int, dict]], source: Path, tokenizer, mask_prompt: bool = False):
        if not records:
            raise DataError(f"{source}: no records (empty split)")
        self.source, self.tokenizer, self.mask_prompt = source, tokenizer, mask_prompt
        self.form = record_form(records[0][1])
        if not self.form:
            raise DataError(
                f"{source}:{records[0][0]}: record has none of the keys 'text', 'prompt'+'completion', "
                f"'messages' (found {sorted(records[0][1])})"
            )
        for lineno, record in records:
            self._check(lineno, record)
        if self.form == "text" and mask_prompt:
            raise DataError(f"{source}: --mask-prompt needs 'prompt'/'completion' or 'messages' records, not 'text'")
        self._records = records

    def _check(self, lineno: int, record: dict) -> None:
        where = f"{self.source}:{lineno}"
        if record_form(record) != self.form:
            raise DataError(f"{where}: record is not in the file's '{self.form}' form (keys {sorted(record)})")
        if self.form == "text" and not isinstance(record["text"], str):
            raise DataError(f"{where}: 'text' must be a string")
        if self.form == "completions" and not all(isinstance(record[k], str) for k in ("prompt", "completion")):
            raise DataError(f"{where}: 'prompt' and 'completion' must be strings")
        if self.form == "chat":
            msgs = record["messages"]
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
                raise DataError(f"{where}: 'messages' must be a non-empty list of objects with a 'role'")

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, idx: int) -> tuple[int, dict]:
        return self._records[idx]

    def _render(self, messages: list[dict], tools, add_generation_prompt: bool) -> list[int]:
        return render_chat(self.tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def process(self, item: tuple[int, dict]) -> tuple[list[int], int]:
        """``(token ids, prompt length)``; the prompt length is 0 unless ``mask_prompt``."""
        lineno, record = item
        if self.form == "text":
            ids = list(self.tokenizer.encode(record["text"]))
            if not ids or ids[-1] != self.tokenizer.eos_token_id:
                ids.append(self.tokenizer.eos_token_id)
            return ids, 0
        if self.form == "completions":
            messages = [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]},
            ]
        else:
            messages = record["messages"]
        tools = record.get("tools")
        try:
            ids = self._render(messages, tools, add_generation_prompt=False)
            if not self.mask_prompt:
                return ids, 0
            if messages[-1].get("role") != "assistant":
                raise DataError(
                    f"{self.source}:{lineno}: --mask-prompt needs the last message to be the "
                    f"assistant's (the response the loss is computed on)"
                )
            prompt = self._render(messages[:-1], tools, add_generation_prompt=True)
        except (TypeError, ValueError, KeyError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{self.source}:{lineno}: cannot render this conversation ({e})") from None
        return ids, _common_prefix(prompt, ids)

    def tokenized(self) -> list[tuple[list[int], int]]:
        """Every record processed: the list mlx-lm's ``iterate_batches`` sorts by token length and batches."""
        return [self.process(item) for item in self._records]


def _split_records(records: list[tuple[int, dict]], ratios: tuple[float, float, float], seed: int) -> list[list]:
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n = len(records)
    n_valid, n_test = round(ratios[1] * n), round(ratios[2] * n)
    bounds = [0, n - n_valid - n_test, n - n_test, n]
    return [[records[i] for i in sorted(order[bounds[k] : bounds[k + 1]])] for k in range(3)]


def parse_split(spec: Union[str, tuple, None]) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` (train, valid, test fractions summing to 1) -> a tuple; None -> (0.9, 0.1, 0.0)."""
    if spec is None:
        return 0.9, 0.1, 0.0
    try:
        parts = tuple(float(x) for x in (spec.split(",") if isinstance(spec, str) else spec))
    except ValueError:
        raise ValueError(f"split {spec!r}: expected three comma-separated fractions, e.g. 0.8,0.1,0.1") from None
    if len(parts) != 3 or any(p < 0 for p in parts) or abs(sum(parts) - 1.0) > 1e-6 or parts[0] == 0:
        raise ValueError(f"split {spec!r}: expected three non-negative fractions (train > 0) summing to 1")
    return parts


def load_datasets(
    data: Union[str, Path],
    tokenizer,
    mask_prompt: bool = False,
    split: Optional[str] = None,
    seed: int = 0,
) -> dict[str, Optional[JsonlDataset]]:
    """``{"train", "valid", "test"} -> JsonlDataset or None`` from a directory of split files or one jsonl file.

    A directory's missing split file gives None; a present but empty one is a ``DataError``. A single file is
    shuffled with ``seed`` and split by ``split`` ("train,valid,test" fractions; default 0.9,0.1,0).
    """
    path = Path(data).expanduser()
    if path.is_dir():
        if split is not None:
            raise ValueError(f"--split applies to a single .jsonl file; {path} is a directory of split files")
        out: dict[str, Any] = {}
        for name in SPLITS:
            file = path / f"{name}.jsonl"
            out[name] = JsonlDataset(read_jsonl(file), file, tokenizer, mask_prompt) if file.exists() else None
        if not any(out.values()):
            raise DataError(f"{path}: no train.jsonl / valid.jsonl / test.jsonl")
        return out
    if not path.is_file():
        raise DataError(f"{path}: no such data directory or .jsonl file")
    parts = _split_records(read_jsonl(path), parse_split(split), seed)
    return {
        name: JsonlDataset(recs, path, tokenizer, mask_prompt) if (recs or name == "train") else None
        for name, recs in zip(SPLITS, parts)
    }
