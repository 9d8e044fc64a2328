"""Memory-mapped, validated access to one GGUF file or a split set (``-00001-of-0000N.gguf``).

``prescan`` first walks the header with bounds-checked ``struct`` reads (magic, version, counts, every string /
array length, value and ggml type ids, duplicate keys / tensors, ranks, alignment, data offsets inside the file and
not overlapping), so absurd counts or lengths can neither hang gguf-py nor make it allocate; then gguf-py's
``GGUFReader`` does the parsing (memory-mapped); this module checks the structure before any weight
is materialised and turns every failure into ``GGUFFormatError`` naming the file, the key or tensor, what was
found and what was expected.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
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
    _map: Optional[mmap.mmap] = None  # the file's memory map (for ``release``)

    @property
    def type_name(self) -> str:
        return self.qtype.name

    def raw(self) -> np.ndarray:
        """The tensor's bytes as a flat uint8 array (a view into the memory map)."""
        return np.asarray(self._tensor.data).reshape(-1).view(np.uint8)

    def release(self) -> None:
        """Drop this tensor's file pages from the process's resident set (the OS page cache keeps them).

        Called once a tensor has been copied into MLX, so loading never holds the mapped file and the model's
        arrays resident at once (peak RSS ~ model size, not model + file). Reading the tensor again faults the
        pages back in from the file.
        """
        if self._map is None:
            return
        start = int(self._tensor.data_offset)
        aligned = start - start % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, aligned, start + int(self._tensor.n_bytes) - aligned)


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


# ------------------------------------------------------------------------------------------ structural pre-scan

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # llama.cpp: tensor names are shorter than this, in bytes
MAX_ARRAY_DEPTH = 8
# GGUF value type id -> (name, byte size; None: variable)
_VTYPES = {0: ("UINT8", 1), 1: ("INT8", 1), 2: ("UINT16", 2), 3: ("INT16", 2), 4: ("UINT32", 4), 5: ("INT32", 4),
           6: ("FLOAT32", 4), 7: ("BOOL", 1), 8: ("STRING", None), 9: ("ARRAY", None), 10: ("UINT64", 8),
           11: ("INT64", 8), 12: ("FLOAT64", 8)}
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class _Scan:
    """Bounds-checked little-endian cursor over a memory-mapped GGUF header (allocates nothing per claimed count)."""

    def __init__(self, file: Path, buf, size: int):
        self.file, self.buf, self.size, self.pos = file, buf, size, 0

    def fail(self, msg: str):
        raise GGUFFormatError(f"{self.file}: {msg}")

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            self.fail(f"truncated {what} at byte offset {self.pos}: needs {n} bytes, only {self.left()} left "
                      f"(file is {self.size} bytes); expected a complete GGUF header")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str, decode: bool) -> Optional[str]:
        at = self.pos
        n = self.unpack("Q", f"{what} length")
        if n > self.left():
            self.fail(f"{what} at byte offset {at} claims a string length of {n} bytes but only {self.left()} bytes "
                      f"remain in the file ({self.size} bytes); expected a length within the file (truncated "
                      f"file or corrupt length)")
        raw = bytes(self.buf[self.pos:self.pos + n]) if decode else None
        self.pos += n
        if not decode:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"{what} at byte offset {at} is not valid UTF-8 ({e}); expected a UTF-8 string")

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        at = self.pos
        if vtype not in _VTYPES:
            self.fail(f"metadata key '{key}' has value type id {vtype} (byte offset {at}); expected a GGUF value "
                      f"type 0..12")
        name, width = _VTYPES[vtype]
        if width is not None:
            self.need(width, f"value of metadata key '{key}'")
            v = struct.unpack_from("<" + _FORMATS[vtype], self.buf, self.pos)[0]
            self.pos += width
            return v
        if name == "STRING":
            self.string(f"string value of metadata key '{key}'", decode=False)
            return None
        # ARRAY
        if depth >= MAX_ARRAY_DEPTH:
            self.fail(f"metadata key '{key}' nests arrays deeper than {MAX_ARRAY_DEPTH} levels; expected a flat array")
        itype = self.unpack("I", f"array element type of metadata key '{key}'")
        if itype not in _VTYPES:
            self.fail(f"metadata key '{key}' is an array of element type id {itype} (byte offset {at}); "
                      f"expected a GGUF value type 0..12")
        n_at = self.pos
        n = self.unpack("Q", f"array length of metadata key '{key}'")
        iname, iwidth = _VTYPES[itype]
        min_item = iwidth if iwidth is not None else (8 if iname == "STRING" else 12)
        if n * min_item > self.left():
            self.fail(f"metadata key '{key}' (byte offset {n_at}) claims an array of {n} {iname} elements (at least "
                      f"{n * min_item} bytes) but only {self.left()} bytes remain in the file ({self.size} bytes); "
                      f"expected an array length within the file (truncated file or corrupt length)")
        if iwidth is not None:
            self.pos += n * iwidth
        elif iname == "STRING":  # inline loop: token / merge lists hold 10^5 strings
            buf, size, pos = self.buf, self.size, self.pos
            for j in range(n):
                if pos + 8 > size:
                    self.pos = pos
                    self.need(8, f"length of string #{j} in array '{key}'")
                slen = struct.unpack_from("<Q", buf, pos)[0]
                if slen > size - pos - 8:
                    self.pos = pos
                    self.fail(f"string #{j} of metadata key '{key}' at byte offset {pos} claims a string length of "
                              f"{slen} bytes but only {size - pos - 8} bytes remain in the file ({size} bytes); "
                              f"expected a length within the file (truncated file or corrupt length)")
                pos += 8 + slen
            self.pos = pos
        else:
            for _ in range(n):
                self.value(itype, key, depth + 1)
        return None


def _ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, block size, bytes per block), from gguf-py."""
    from gguf import GGML_QUANT_SIZES

    return {int(t): (t.name, b, s) for t, (b, s) in GGML_QUANT_SIZES.items()}


def prescan(file: Union[str, Path]) -> dict:
    """Check a GGUF file's structure with bounds-checked reads before gguf-py parses it.

    Checks the magic, version, KV / tensor counts, every string and array length, value type ids, duplicate keys
    and tensor names, tensor ranks, dims, ggml type ids, alignment, and that every tensor's data lies inside the
    file, aligned, without overlapping another. Nothing is allocated in proportion to a count or length claimed
    by the file. Returns ``{"version", "n_tensors", "n_kv", "alignment", "data_offset"}``; raises
    ``GGUFFormatError`` naming the file, the key/tensor/byte offset, what was found and what was expected.
    """
    file = Path(file)
    size = file.stat().st_size
    if size < 24:
        raise GGUFFormatError(f"{file}: truncated header: the file is {size} bytes; expected at least 24 "
                              f"(magic, version, tensor count, KV count)")
    with open(file, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _prescan(_Scan(file, buf, size))
    finally:
        buf.close()


def _prescan(s: _Scan) -> dict:
    magic = bytes(s.buf[0:4])
    if magic != GGUF_MAGIC:
        s.fail(f"not a readable GGUF file: bad magic {magic!r} at byte offset 0; expected {GGUF_MAGIC!r}")
    s.pos = 4
    version = s.unpack("I", "version")
    if version not in SUPPORTED_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in SUPPORTED_VERSIONS:
            s.fail(f"version field at byte offset 4 reads {version} (a big-endian GGUF v{swapped}); expected a "
                   f"little-endian GGUF version {SUPPORTED_VERSIONS}")
        s.fail(f"unsupported GGUF version {version} at byte offset 4; expected one of {SUPPORTED_VERSIONS}")
    n_tensors = s.unpack("Q", "tensor count")
    n_kv = s.unpack("Q", "KV count")
    if n_kv * _MIN_KV_BYTES > s.left():
        s.fail(f"KV count (n_kv) at byte offset 16 is {n_kv}: needs at least {n_kv * _MIN_KV_BYTES} bytes but only "
               f"{s.left()} remain (file is {s.size} bytes); expected a count that fits in the file (truncated file or "
               f"corrupt count)")
    if n_tensors * _MIN_TENSOR_INFO_BYTES > s.left():
        s.fail(f"tensor count (n_tensors) at byte offset 8 is {n_tensors}: needs at least "
               f"{n_tensors * _MIN_TENSOR_INFO_BYTES} bytes of tensor infos but only {s.left()} remain (file is "
               f"{s.size} bytes); expected a count that fits in the file (truncated file or corrupt count)")
    alignment = 32
    keys: set[str] = set()
    for i in range(n_kv):
        at = s.pos
        key = s.string(f"key of metadata KV #{i}", decode=True)
        if key in keys:
            s.fail(f"metadata key '{key}' appears twice (second at byte offset {at}); expected unique keys")
        keys.add(key)
        vtype = s.unpack("I", f"value type of metadata key '{key}'")
        v = s.value(vtype, key)
        if key == "general.alignment":
            if vtype != 4:
                s.fail(f"metadata key 'general.alignment' has value type {_VTYPES.get(vtype, (vtype,))[0]}; "
                       f"expected UINT32")
            if v == 0 or v & (v - 1):
                s.fail(f"metadata key 'general.alignment' is {v}; expected a non-zero power of two")
            alignment = v
    types = _ggml_types()
    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        at = s.pos
        name = s.string(f"name of tensor info #{i}", decode=True)
        if not 0 < len(name.encode()) < GGML_MAX_NAME:
            s.fail(f"tensor info #{i} of n_tensors {n_tensors} (byte offset {at}) has the name {name[:80]!r}; expected "
                   f"1..{GGML_MAX_NAME - 1} bytes (is n_tensors larger than the number of tensor infos?)")
        if name in names:
            s.fail(f"tensor '{name}' appears twice (second tensor info at byte offset {at}); expected unique names")
        names.add(name)
        nd_at = s.pos
        n_dims = s.unpack("I", f"n_dims of tensor '{name}'")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            s.fail(f"tensor '{name}' has n_dims {n_dims} (byte offset {nd_at}); expected 1..{GGML_MAX_DIMS}")
        ne = [s.unpack("Q", f"dims of tensor '{name}'") for _ in range(n_dims)]
        if any(x < 1 or x >= 2**62 for x in ne):
            s.fail(f"tensor '{name}' has ne {ne}; expected every dimension in 1..2**62")
        t_at = s.pos
        ttype = s.unpack("I", f"ggml type of tensor '{name}'")
        if ttype not in types:
            s.fail(f"tensor '{name}' has unknown ggml type id {ttype} (byte offset {t_at}); expected one of "
                   f"{sorted(types)}")
        tname, block, tsize = types[ttype]
        if ne[0] % block:
            s.fail(f"tensor '{name}' of type {tname} has ne[0] = {ne[0]}; expected a multiple of its block size "
                   f"{block}")
        n_el = 1
        for x in ne:
            n_el *= x
        n_bytes = n_el // block * tsize
        o_at = s.pos
        off = s.unpack("Q", f"data offset of tensor '{name}'")
        if off % alignment:
            s.fail(f"tensor '{name}' has data offset {off} (field at byte offset {o_at}), not a multiple of the "
                   f"alignment {alignment}; expected an aligned offset")
        infos.append((off, n_bytes, name))
    data_offset = s.pos + (-s.pos) % alignment
    if data_offset > s.size and n_tensors:
        s.fail(f"truncated file: the tensor data section would start at byte offset {data_offset} but the file is "
               f"{s.size} bytes; expected the tensor data after the header")
    data_size = s.size - data_offset
    prev = None
    for off, n_bytes, name in sorted(infos):
        if off + n_bytes > data_size:
            s.fail(f"tensor '{name}' data [{data_offset + off}, {data_offset + off + n_bytes}) lies outside the file "
                   f"({s.size} bytes; data offset {off}, {n_bytes} bytes); expected it inside (truncated file?)")
        if prev is not None and off < prev[0] + prev[1]:
            s.fail(f"tensor '{name}' data at offset {off} ({n_bytes} bytes) overlaps tensor '{prev[2]}' data at "
                   f"offset {prev[0]} ({prev[1]} bytes); expected disjoint tensor data")
        prev = (off, n_bytes, name)
    return {"version": version, "n_tensors": n_tensors, "n_kv": n_kv, "alignment": alignment,
            "data_offset": data_offset}


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
        prescan(file)  # bounds-checked structure check: gguf-py would loop/allocate on absurd counts and lengths
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
            self.tensors[t.name] = TensorInfo(
                t.name, t.tensor_type, tuple(reversed(ne)), str(file), t, getattr(reader.data, "_mmap", None)
            )

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
        """``elem``: "int" / "str" / "float" (integers accepted; values as Python floats)."""
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
        if elem == "float" and sub not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.INT32,
                                           GGUFValueType.UINT32):
            self._fail(key, f"an array of {sub.name}", "an ARRAY of FLOAT32")
        v = list(self.values[key])
        if elem == "float":
            v = [float(x) for x in v]
            if not all(np.isfinite(v)):
                self._fail(key, v, "finite floats")
        if length is not None and len(v) != length:
            self._fail(key, f"an array of length {len(v)}", f"length {length}")
        return v
