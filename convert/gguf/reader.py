"""Memory-mapped, validated access to one GGUF file or a split set (``-00001-of-0000N.gguf``).

gguf-py's ``GGUFReader`` does the parsing (memory-mapped); this module checks the structure before any weight
is materialised and turns every failure into ``GGUFFormatError`` naming the file, the key or tensor, what was
found and what was expected.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")


class GGUFFormatError(ValueError):
    """A GGUF file we cannot load: names the file, the key or tensor, what was found and what was expected."""


@dataclass
class TensorInfo:
    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple  # numpy order (reversed ggml ne)
    file: str
    _tensor: Any  # gguf ReaderTensor (memory-mapped)

    @property
    def type_name(self) -> str:
        return self.qtype.name

    def raw(self) -> np.ndarray:
        """The tensor's bytes as a flat uint8 array (a view into the memory map)."""
        return np.asarray(self._tensor.data).reshape(-1).view(np.uint8)


def split_files(path: Union[str, Path]) -> list[Path]:
    """All shards of a split set given any shard (or just [path] for a single file)."""
    path = Path(path)
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    n = int(m.group("n"))
    files = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise GGUFFormatError(f"{path}: split GGUF set of {n} files; missing shard(s) {missing}")
    return files


def _field_value(field) -> Any:
    from gguf import GGUFValueType

    t = field.types[0] if field.types else None
    if t == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if t == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="surrogateescape")
    return field.parts[field.data[0]].tolist()[0]


class GGUFFile:
    """Metadata (``fields``: key -> (GGUFValueType list, value)) and tensor infos of one GGUF or a split set."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self.files = split_files(self.path)
        self.source = str(self.path)
        self.types: dict[str, list] = {}
        self.values: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._readers = []
        for i, f in enumerate(self.files):
            self._open(f, first=(i == 0))
        if len(self.files) > 1:
            n = self.values.get("split.count")
            if n is not None and n != len(self.files):
                raise GGUFFormatError(f"{self.source}: metadata 'split.count' is {n}; expected {len(self.files)} shards")

    def _open(self, file: Path, first: bool) -> None:
        from gguf import GGUFReader

        if not file.exists():
            raise GGUFFormatError(f"{file}: no such GGUF file")
        try:
            reader = GGUFReader(str(file), "r")
        except GGUFFormatError:
            raise
        except Exception as e:  # bad magic, truncated header/tensor info, unknown type, ...
            size = file.stat().st_size
            raise GGUFFormatError(
                f"{file}: not a readable GGUF file ({size} bytes; bad magic, truncated or corrupt: "
                f"{type(e).__name__}: {e}); expected a GGUF v2/v3 file written by llama.cpp / gguf-py"
            ) from None
        self._readers.append(reader)
        if first:
            for key, field in reader.fields.items():
                try:
                    self.values[key] = _field_value(field)
                except Exception as e:
                    raise GGUFFormatError(f"{file}: metadata key '{key}' cannot be decoded ({e})") from None
                self.types[key] = list(field.types)
        size = os.path.getsize(file)
        for t in reader.tensors:
            if t.name in self.tensors:
                raise GGUFFormatError(
                    f"{file}: tensor '{t.name}' appears twice (also in {self.tensors[t.name].file}); expected unique names"
                )
            ne = [int(x) for x in t.shape]
            if any(x < 1 for x in ne):
                raise GGUFFormatError(f"{file}: tensor '{t.name}' has ne {ne}; expected every dimension >= 1")
            end = int(t.data_offset) + int(t.n_bytes)
            if int(t.data_offset) < 0 or end > size:
                raise GGUFFormatError(
                    f"{file}: tensor '{t.name}' data [{t.data_offset}, {end}) lies outside the file ({size} bytes); "
                    f"expected it inside (truncated file?)"
                )
            if np.asarray(t.data).nbytes != int(t.n_bytes):
                raise GGUFFormatError(
                    f"{file}: tensor '{t.name}' has {np.asarray(t.data).nbytes} data bytes; expected {t.n_bytes}"
                )
            self.tensors[t.name] = TensorInfo(t.name, t.tensor_type, tuple(reversed(ne)), str(file), t)

    # ------------------------------------------------------------------ typed metadata access

    def has(self, key: str) -> bool:
        return key in self.values

    def _fail(self, key: str, found: Any, expected: str):
        raise GGUFFormatError(f"{self.source}: metadata key '{key}' is {found!r}; expected {expected}")

    def get_int(self, key: str, default: Optional[int] = None, *, required: bool = True, minimum: Optional[int] = None):
        from gguf import GGUFValueType

        if key not in self.values:
            if required and default is None:
                self._fail(key, None, "an integer (missing)")
            return default
        t = self.types[key][0]
        ints = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
        if t not in ints:
            self._fail(key, f"{self.values[key]!r} of type {t.name}", "an integer type")
        v = int(self.values[key])
        if minimum is not None and v < minimum:
            self._fail(key, v, f"an integer >= {minimum}")
        return v

    def get_float(self, key: str, default: Optional[float] = None, *, required: bool = True):
        from gguf import GGUFValueType

        if key not in self.values:
            if required and default is None:
                self._fail(key, None, "a float (missing)")
            return default
        t = self.types[key][0]
        if t not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            self._fail(key, f"{self.values[key]!r} of type {t.name}", "FLOAT32")
        v = float(self.values[key])
        if not np.isfinite(v):
            self._fail(key, v, "a finite float")
        return v

    def get_bool(self, key: str, default: bool) -> bool:
        from gguf import GGUFValueType

        if key not in self.values:
            return default
        if self.types[key][0] != GGUFValueType.BOOL:
            self._fail(key, f"{self.values[key]!r} of type {self.types[key][0].name}", "BOOL")
        return bool(self.values[key])

    def get_str(self, key: str, default: Optional[str] = None, *, required: bool = True) -> Optional[str]:
        from gguf import GGUFValueType

        if key not in self.values:
            if required and default is None:
                self._fail(key, None, "a string (missing)")
            return default
        if self.types[key][0] != GGUFValueType.STRING:
            self._fail(key, f"value of type {self.types[key][0].name}", "STRING")
        return self.values[key]

    def get_array(self, key: str, elem: str, *, length: Optional[int] = None, required: bool = True):
        """``elem``: "int" / "str"."""
        from gguf import GGUFValueType

        if key not in self.values:
            if required:
                self._fail(key, None, f"an array of {elem} (missing)")
            return None
        types = self.types[key]
        if types[0] != GGUFValueType.ARRAY:
            self._fail(key, f"{self.values[key]!r} of type {types[0].name}", f"an ARRAY of {elem}")
        sub = types[-1]
        if elem == "str" and sub != GGUFValueType.STRING:
            self._fail(key, f"an array of {sub.name}", "an ARRAY of STRING")
        if elem == "int" and sub in (GGUFValueType.STRING, GGUFValueType.FLOAT32, GGUFValueType.FLOAT64,
                                     GGUFValueType.BOOL, GGUFValueType.ARRAY):
            self._fail(key, f"an array of {sub.name}", "an ARRAY of integers")
        v = list(self.values[key])
        if length is not None and len(v) != length:
            self._fail(key, f"an array of length {len(v)}", f"length {length}")
        return v
