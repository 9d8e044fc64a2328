"""Malformed-GGUF corpus, generated here from the F32 fixtures of both architectures.

Byte-level corruptions (magic, version, counts, string/array lengths, value and ggml type ids, tensor infos, data
offsets, truncation at many byte offsets) patch a copy of the file directly, at positions found by parsing the
header with ``struct`` (GGUF v3: magic, u32 version, u64 n_tensors, u64 n_kv, KVs, tensor infos, padding, data).
Semantic corruptions (metadata, tensor sets, shapes, values) are rewritten through gguf-py's writer
(``_rewrite`` from test_gguf_load). Every case must raise ``GGUFFormatError`` naming the file and the words that
name its cause, within a few seconds (``signal.alarm``) and without allocating in proportion to absurd counts.
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import pytest
from conftest import K3_FIXTURE, KL_FIXTURE

gguf = pytest.importorskip("gguf")

from kimi_mlx.convert.gguf.reader import GGUFFormatError  # noqa: E402
from test_gguf_load import _rewrite  # noqa: E402

V = gguf.GGUFValueType
SRC = {"kl": KL_FIXTURE / "kimi-linear-tiny-F32.gguf", "k3": K3_FIXTURE / "kimi-k3-tiny-F32.gguf"}
PREFIX = {"kl": "kimi-linear.", "k3": "kimi-k3."}
TIMEOUT_S = 10

# ------------------------------------------------------------------------------------------ own header parser

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class KV(NamedTuple):
    start: int  # key length field
    type_at: int  # value type field
    value_at: int  # value (for arrays: element type field; length at value_at + 4)
    end: int
    vtype: int


class TI(NamedTuple):
    start: int  # name length field
    ndims_at: int
    dims_at: int
    type_at: int
    off_at: int
    end: int
    ne: tuple
    ttype: int
    offset: int


class Layout(NamedTuple):
    kvs: dict
    tensors: dict
    info_start: int
    info_end: int
    data_start: int


def _skip(data: bytes, vt: int, pos: int) -> int:
    if vt in _SCALAR:
        return pos + _SCALAR[vt]
    if vt == 8:
        (n,) = struct.unpack_from("<Q", data, pos)
        return pos + 8 + n
    assert vt == 9
    it, n = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if it in _SCALAR:
        return pos + n * _SCALAR[it]
    for _ in range(n):
        pos = _skip(data, it, pos)
    return pos


def _parse(data: bytes) -> Layout:
    assert data[:4] == b"GGUF"
    _, n_t, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos, kvs, tensors = 24, {}, {}
    for _ in range(n_kv):
        start = pos
        (kl,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8:pos + 8 + kl].decode()
        pos += 8 + kl
        (vt,) = struct.unpack_from("<I", data, pos)
        end = _skip(data, vt, pos + 4)
        kvs[key] = KV(start, pos, pos + 4, end, vt)
        pos = end
    info_start = pos
    for _ in range(n_t):
        start = pos
        (nl,) = struct.unpack_from("<Q", data, pos)
        name = data[pos + 8:pos + 8 + nl].decode()
        pos += 8 + nl
        (nd,) = struct.unpack_from("<I", data, pos)
        ne = struct.unpack_from(f"<{nd}Q", data, pos + 4)
        type_at = pos + 4 + 8 * nd
        ttype, off = struct.unpack_from("<IQ", data, type_at)
        tensors[name] = TI(start, pos, pos + 4, type_at, type_at + 4, type_at + 12, ne, ttype, off)
        pos = type_at + 12
    return Layout(kvs, tensors, info_start, pos, pos + (-pos) % 32)


_CACHE: dict = {}


def _src(arch: str) -> tuple[bytes, Layout]:
    if arch not in _CACHE:
        data = SRC[arch].read_bytes()
        _CACHE[arch] = (data, _parse(data))
    return _CACHE[arch]


def _put(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into("<" + fmt, b, at, value)
    return bytes(b)


def _shift(data: bytes, lay: Layout, name: str, by: int) -> bytes:
    """Move one tensor's data offset by ``by`` bytes."""
    return _put(data, lay.tensors[name].off_at, "Q", lay.tensors[name].offset + by)


def _splice(data: bytes, at: int, new: bytes) -> bytes:
    """Overwrite bytes in place (same length)."""
    return data[:at] + new + data[at + len(new):]


def _last_tensor(lay: Layout) -> TI:
    return max(lay.tensors.values(), key=lambda t: t.offset)


def _same_len_pair(names) -> tuple[str, str]:
    by_len: dict = {}
    for n in names:
        by_len.setdefault(len(n), []).append(n)
    pair = next(v for v in by_len.values() if len(v) > 1)
    return pair[0], pair[1]


# ------------------------------------------------------------------------------------------ the corpus


class Case(NamedTuple):
    id: str
    doc: str
    arch: str
    make: Callable  # (bytes, Layout, tmp_path) -> bytes (patched copy) or Path (rewritten file)
    expect: tuple  # all of these (case-insensitive) must be in the message: the words that name the cause


CASES: list[Case] = []


def add(id, arch, doc, make, *expect):
    CASES.append(Case(f"{arch}-{id}", doc, arch, make, expect))


# --- magic / version
for a in ("kl", "k3"):
    add("magic-ggml", a, "magic 'GGML' instead of 'GGUF'", lambda d, lay, t: b"GGML" + d[4:], "magic")
add("magic-zero", "kl", "magic bytes zeroed", lambda d, lay, t: b"\0\0\0\0" + d[4:], "magic")
add("magic-only", "kl", "file is only the 4 magic bytes", lambda d, lay, t: d[:4], "truncated")
add("empty-file", "k3", "empty file", lambda d, lay, t: b"", "truncated")
for a, v in (("kl", 1), ("kl", 4), ("k3", 0xFFFFFFFF), ("k3", 0)):
    add(f"version-{v}", a, f"unsupported GGUF version {v}", lambda d, lay, t, v=v: _put(d, 4, "I", v), "version")
add("version-big-endian", "kl", "version 3 written big-endian (a byte-swapped file)",
    lambda d, lay, t: _put(d, 4, "I", 0x03000000), "big-endian")

# --- absurd counts
for a in ("kl", "k3"):
    add("n_tensors-2^60", a, "tensor count 2**60 (must neither allocate nor loop)",
        lambda d, lay, t: _put(d, 8, "Q", 2**60), "n_tensors")
    add("n_kv-2^60", a, "KV count 2**60 (must neither allocate nor loop)", lambda d, lay, t: _put(d, 16, "Q", 2**60),
        "n_kv")
add("n_tensors-max", "kl", "tensor count 2**64-1", lambda d, lay, t: _put(d, 8, "Q", 2**64 - 1), "n_tensors")
add("n_kv-plus-1", "kl", "one KV more than present: the first tensor info is read as a KV",
    lambda d, lay, t: _put(d, 16, "Q", len(lay.kvs) + 1), "name of tensor info #0", "string length")
add("n_tensors-plus-1", "k3", "one tensor info more than present: tensor data is read as a tensor info",
    lambda d, lay, t: _put(d, 8, "Q", len(lay.tensors) + 1), "tensor info #", "is n_tensors larger")
add("n_tensors-minus-1", "kl", "one tensor info fewer: the data section moves and a tensor goes missing",
    lambda d, lay, t: _put(d, 8, "Q", len(lay.tensors) - 1), "missing tensors", "model.norm.weight")

# --- absurd string / array lengths, bad value types
add("key-len-2^62", "kl", "first metadata key claims 2**62 bytes",
    lambda d, lay, t: _put(d, 24, "Q", 2**62), "string length")
add("key-len-file+1", "k3", "first metadata key length one past the end of the file",
    lambda d, lay, t: _put(d, 24, "Q", len(d)), "string length")
add("str-value-len-2^60", "kl", "string value of general.architecture claims 2**60 bytes",
    lambda d, lay, t: _put(d, lay.kvs["general.architecture"].value_at, "Q", 2**60), "string length")
add("tokens-array-len-2^60", "kl", "tokenizer.ggml.tokens (array of STRING) claims 2**60 elements",
    lambda d, lay, t: _put(d, lay.kvs["tokenizer.ggml.tokens"].value_at + 4, "Q", 2**60), "array")
add("int-array-len-2^40", "k3", "head_count_kv (array of INT32) claims 2**40 elements",
    lambda d, lay, t: _put(d, lay.kvs["kimi-k3.attention.head_count_kv"].value_at + 4, "Q", 2**40), "array")
add("token-string-len-2^50", "k3", "a string inside tokenizer.ggml.tokens claims 2**50 bytes",
    lambda d, lay, t: _put(d, lay.kvs["tokenizer.ggml.tokens"].value_at + 12, "Q", 2**50), "string length")
add("kv-type-99", "kl", "value type id 99 for kimi-linear.block_count",
    lambda d, lay, t: _put(d, lay.kvs["kimi-linear.block_count"].type_at, "I", 99), "value type")
add("array-elem-type-77", "k3", "array element type id 77 for tokenizer.ggml.token_type",
    lambda d, lay, t: _put(d, lay.kvs["tokenizer.ggml.token_type"].value_at, "I", 77), "element type")
add("key-not-utf8", "kl", "a metadata key with invalid UTF-8",
    lambda d, lay, t: _put(d, lay.kvs["general.name"].start + 8, "B", 0xFF), "UTF-8")


def _dup_key(d, lay, t):
    a, b = _same_len_pair(lay.kvs)
    return d[:lay.kvs[b].start + 8] + a.encode() + d[lay.kvs[b].start + 8 + len(a):]


add("duplicate-key", "k3", "two metadata KVs with the same key", _dup_key, "appears twice")

# --- tensor infos
add("tensor-name-len-2^61", "kl", "first tensor name claims 2**61 bytes",
    lambda d, lay, t: _put(d, lay.info_start, "Q", 2**61), "string length")
add("n_dims-0", "k3", "output_norm.weight with n_dims 0",
    lambda d, lay, t: _put(d, lay.tensors["output_norm.weight"].ndims_at, "I", 0), "n_dims")
add("n_dims-9", "kl", "token_embd.weight with n_dims 9",
    lambda d, lay, t: _put(d, lay.tensors["token_embd.weight"].ndims_at, "I", 9), "n_dims")
add("dim-zero", "kl", "a dimension of 0 in blk.0.attn_norm.weight",
    lambda d, lay, t: _put(d, lay.tensors["blk.0.attn_norm.weight"].dims_at, "Q", 0), "dimension")
add("dim-2^61", "k3", "a dimension of 2**61 (data far beyond the file)",
    lambda d, lay, t: _put(d, lay.tensors["token_embd.weight"].dims_at + 8, "Q", 2**61), "token_embd.weight",
    "outside the file")
add("ggml-type-200", "kl", "unknown ggml type id 200",
    lambda d, lay, t: _put(d, lay.tensors["blk.1.ffn_up_exps.weight"].type_at, "I", 200), "ggml type")
add("ggml-type-4-removed", "k3", "ggml type id 4 (removed Q4_2)",
    lambda d, lay, t: _put(d, lay.tensors["output.weight"].type_at, "I", 4), "ggml type")
add("norm-as-I32", "kl", "a norm stored as I32 (same byte size, not a float type)",
    lambda d, lay, t: _put(d, lay.tensors["output_norm.weight"].type_at, "I", int(gguf.GGMLQuantizationType.I32)),
    "output_norm.weight")
add("norm-as-Q8_0", "k3", "a norm stored as Q8_0 (norms must be float)",
    lambda d, lay, t: _put(d, lay.tensors["blk.0.attn_norm.weight"].type_at, "I", int(gguf.GGMLQuantizationType.Q8_0)),
    "blk.0.attn_norm.weight")
add("weight-as-F64", "kl", "a matrix stored as F64 (unsupported type; ne[0] halved, so the same bytes)",
    lambda d, lay, t: _put(_put(d, lay.tensors["blk.0.ffn_down.weight"].type_at, "I",
                                int(gguf.GGMLQuantizationType.F64)),
                           lay.tensors["blk.0.ffn_down.weight"].dims_at, "Q",
                           lay.tensors["blk.0.ffn_down.weight"].ne[0] // 2),
    "blk.0.ffn_down.weight", "ggml type F64, which cannot be loaded")
add("q8-bad-block", "kl", "Q8_0 tensor whose ne[0] (2) is not a multiple of the block size 32",
    lambda d, lay, t: _put(d, lay.tensors["blk.0.ssm_a"].type_at, "I", int(gguf.GGMLQuantizationType.Q8_0))
    if lay.tensors["blk.0.ssm_a"].ne[0] % 32 else None, "block size")


def _dup_tensor(d, lay, t):
    a, b = _same_len_pair(lay.tensors)
    at = lay.tensors[b].start + 8
    return d[:at] + a.encode() + d[at + len(a):]


add("duplicate-tensor", "kl", "two tensor infos with the same name", _dup_tensor, "appears twice")

# --- data offsets
add("offset-2^40", "kl", "a data offset far outside the file",
    lambda d, lay, t: _put(d, lay.tensors["blk.2.attn_k_b.weight"].off_at, "Q", 2**40), "outside")
add("offset-max", "k3", "a data offset of 2**64-32 (overflow bait)",
    lambda d, lay, t: _put(d, lay.tensors["output.weight"].off_at, "Q", 2**64 - 32), "outside")
add("offset-past-end", "k3", "last tensor moved one alignment step past the end",
    lambda d, lay, t: _put(d, _last_tensor(lay).off_at, "Q", _last_tensor(lay).offset + 32), "outside")
add("offset-misaligned", "kl", "a data offset 4 bytes off the 32-byte alignment",
    lambda d, lay, t: _shift(d, lay, "blk.0.ffn_gate.weight", 4),
    "alignment")
add("offset-overlap", "k3", "two tensors sharing the same data",
    lambda d, lay, t: _put(d, lay.tensors["blk.0.attn_q.weight"].off_at, "Q",
                           lay.tensors["blk.0.attn_k.weight"].offset),
    "overlaps")
add("offset-overlap-partial", "kl", "a tensor's data starting inside the previous tensor's data",
    lambda d, lay, t: _shift(d, lay, "blk.0.ffn_down.weight", 32),
    "blk.0.ffn_down.weight", "overlaps")


# --- truncation at many byte offsets
def _cuts(arch: str) -> list[tuple[str, Callable[[bytes, Layout], int]]]:
    p = PREFIX[arch]
    return [
        ("in-version", lambda d, lay: 6),
        ("in-counts", lambda d, lay: 17),
        ("after-counts", lambda d, lay: 24),
        ("in-first-key", lambda d, lay: 40),
        ("in-kv-value", lambda d, lay: lay.kvs[p + "block_count"].value_at + 2),
        ("in-array", lambda d, lay: lay.kvs[p + "attention.head_count_kv"].value_at + 14),
        ("in-tokens", lambda d, lay: sum(lay.kvs["tokenizer.ggml.tokens"][2:4]) // 2),  # mid token list
        ("kv-end", lambda d, lay: lay.info_start),
        ("in-tensor-name", lambda d, lay: lay.info_start + 12),
        ("in-tensor-dims", lambda d, lay: lay.tensors["token_embd.weight"].dims_at + 3),
        ("in-tensor-offset", lambda d, lay: lay.tensors["output_norm.weight"].off_at + 5),
        ("info-end", lambda d, lay: lay.info_end),
        ("data-start", lambda d, lay: lay.data_start + 1),
        ("mid-data", lambda d, lay: (lay.data_start + len(d)) // 2),
        ("last-byte", lambda d, lay: len(d) - 1),
    ]


for a in ("kl", "k3"):
    for name, where in _cuts(a):
        add(f"truncated-{name}", a, f"file cut at the byte offset '{name}'",
            lambda d, lay, t, where=where: d[:where(d, lay)], "truncated")


# --- semantic corruptions (rewritten through gguf-py's writer)
def _meta(key, value, vtype, sub=None):
    def make(d, lay, t, a):
        full = key if key.startswith(("general.", "tokenizer.")) else PREFIX[a] + key
        return _rewrite(SRC[a], t / "meta.gguf", meta={full: (value, vtype, sub)})

    return make


def addm(id, arch, doc, key, value, vtype, sub, *expect):
    mk = _meta(key, value, vtype, sub)
    add(id, arch, doc, lambda d, lay, t, a=arch, mk=mk: mk(d, lay, t, a), *expect)


addm("top-k-gt-experts", "k3", "expert_used_count 9 > expert_count 4", "expert_used_count", 9, V.UINT32, None,
     "expert_used_count")
addm("head-count-kv-2", "k3", "head_count_kv holds 2 (only 0 = KDA, 1 = MLA)", "attention.head_count_kv",
     [0, 2, 1, 0], V.ARRAY, V.INT32, "head_count_kv")
addm("head-count-kv-short", "k3", "per-layer head_count_kv of length 3 for 4 blocks", "attention.head_count_kv",
     [0, 0, 1], V.ARRAY, V.INT32, "head_count_kv")
addm("head-count-kv-float", "kl", "head_count_kv as an array of FLOAT32", "attention.head_count_kv",
     [0.0, 0.0, 1.0, 0.0], V.ARRAY, V.FLOAT32, "head_count_kv")
addm("kda-head-dim-32", "kl", "kda.head_dim 32 does not match the KDA tensor shapes (64)", "kda.head_dim", 32,
     V.UINT32, None, "kda.head_dim")
addm("kda-head-dim-128", "k3", "kda.head_dim 128 does not match the KDA tensor shapes (64)", "kda.head_dim", 128,
     V.UINT32, None, "kda.head_dim")
addm("attn-res-block-gt-layers", "k3", "attn_res.block_size 5 > block_count 4", "attn_res.block_size", 5,
     V.UINT32, None, "attn_res.block_size")
addm("eps-negative", "kl", "negative layer_norm_rms_epsilon", "attention.layer_norm_rms_epsilon", -1e-5,
     V.FLOAT32, None, "layer_norm_rms_epsilon")
addm("eps-zero", "k3", "zero layer_norm_rms_epsilon", "attention.layer_norm_rms_epsilon", 0.0, V.FLOAT32, None,
     "layer_norm_rms_epsilon")
addm("eps-nan", "kl", "NaN layer_norm_rms_epsilon", "attention.layer_norm_rms_epsilon", float("nan"),
     V.FLOAT32, None, "layer_norm_rms_epsilon")
addm("gate-lower-bound-zero", "k3", "kda.gate_lower_bound 0 (must be < 0)", "kda.gate_lower_bound", 0.0,
     V.FLOAT32, None, "gate_lower_bound")
addm("gate-lower-bound-positive", "k3", "kda.gate_lower_bound +5", "kda.gate_lower_bound", 5.0, V.FLOAT32, None,
     "gate_lower_bound")
addm("block-count-string", "kl", "block_count stored as a STRING", "block_count", "4", V.STRING, None,
     "block_count")
addm("block-count-huge", "k3", "block_count 2**31 (per-layer arrays and tensors are for 4)", "block_count", 2**31,
     V.UINT32, None, "head_count_kv", "expected length 2147483648")
addm("embedding-length-mismatch", "kl", "embedding_length 128 while token_embd is 256 wide", "embedding_length",
     128, V.UINT32, None, "embedding_length")
addm("experts-norm-not-bool", "k3", "expert_weights_norm stored as UINT32", "expert_weights_norm", 1, V.UINT32,
     None, "expert_weights_norm")
addm("situ-beta-string", "k3", "activation.situ_beta stored as a STRING", "activation.situ_beta", "1.5",
     V.STRING, None, "situ_beta")
addm("situ-beta-negative", "k3", "activation.situ_beta -1", "activation.situ_beta", -1.0, V.FLOAT32, None,
     "situ_beta")
addm("dense-gt-layers", "kl", "leading_dense_block_count 7 > block_count 4", "leading_dense_block_count", 7,
     V.UINT32, None, "leading_dense_block_count")
addm("expert-count-missing", "k3", "expert_count removed while expert tensors are present", "expert_count", None,
     None, None, "unknown tensors", "ffn_gate_exps")


def _add_kv(d: bytes, lay: Layout, key: str, vtype: int, payload: bytes) -> bytes:
    """Append one KV to the metadata (n_kv + 1), re-padding the header so tensor data offsets stay valid."""
    kv = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload
    head = d[:lay.info_start] + kv + d[lay.info_start:lay.info_end]
    head += b"\0" * ((-len(head)) % 32)
    return _put(head + d[lay.data_start:], 16, "Q", len(lay.kvs) + 1)


add("alignment-not-pow2", "kl", "general.alignment 48 (not a power of two)",
    lambda d, lay, t: _add_kv(d, lay, "general.alignment", 4, struct.pack("<I", 48)), "alignment")
add("alignment-zero", "k3", "general.alignment 0",
    lambda d, lay, t: _add_kv(d, lay, "general.alignment", 4, struct.pack("<I", 0)), "alignment")
add("alignment-64", "k3", "general.alignment 64 while the tensor data offsets are only 32-aligned",
    lambda d, lay, t: _add_kv(d, lay, "general.alignment", 4, struct.pack("<I", 64)), "alignment")
add("alignment-string", "kl", "general.alignment stored as a STRING",
    lambda d, lay, t: _add_kv(d, lay, "general.alignment", 8, struct.pack("<Q", 2) + b"32"), "alignment")
add("arch-unknown", "kl", "general.architecture 'xxxx-linear' (unknown architecture)",
    lambda d, lay, t: _splice(d, lay.kvs["general.architecture"].value_at + 8, b"xxxx"),
    "architecture")


def _rw(**kw):
    return lambda d, lay, t, a: _rewrite(SRC[a], t / "rw.gguf", **kw)


def addr(id, arch, doc, make, *expect):
    add(id, arch, doc, lambda d, lay, t, a=arch, mk=make: mk(d, lay, t, a), *expect)


addr("missing-ssm-a", "k3", "blk.3.ssm_a removed", _rw(drop={"blk.3.ssm_a"}), "missing tensors", "layers.3.self_attn.A_log")
addr("missing-embeddings", "kl", "token_embd.weight removed", _rw(drop={"token_embd.weight"}), "missing tensors",
     "embed_tokens")
addr("extra-layer-tensor", "kl", "a tensor for a layer beyond block_count",
     _rw(extra={"blk.9.attn_norm.weight": np.ones(256)}), "unknown tensors")
addr("extra-top-level", "k3", "an unknown top-level tensor", _rw(extra={"rope_freqs.weight": np.ones(16)}),
     "unknown tensors")
addr("wrong-shape-norm", "k3", "output_norm.weight of 128 instead of 256",
     _rw(replace={"output_norm.weight": np.ones(128, np.float32)}), "output_norm.weight")
addr("wrong-shape-conv", "kl", "ssm_conv1d_q of the wrong width",
     _rw(replace={"blk.0.ssm_conv1d_q.weight": np.ones((1, 64, 1, 4), np.float32)}), "ssm_conv1d_q")
addr("ssm-a-positive", "kl", "ssm_a = -exp(A_log) must be negative; file holds positive values",
     _rw(replace={"blk.0.ssm_a": np.ones((1, 1, 2, 1), np.float32)}), "ssm_a")
addr("missing-conv-v", "k3", "ssm_conv1d_v removed (q, k present)", _rw(drop={"blk.1.ssm_conv1d_v.weight"}),
     "ssm_conv1d", "expected all of q, k, v")
addr("kl-tensor-in-k3", "k3", "a KL-only gate tensor in a K3 file",
     _rw(extra={"blk.0.ssm_g_a.weight": np.zeros((64, 256))}), "ssm_g_a")
addr("expert-stack-short", "kl", "ffn_up_exps with 3 experts for expert_count 4",
     _rw(replace={"blk.1.ffn_up_exps.weight": np.zeros((3, 32, 256), np.float32)}), "ffn_up_exps")


# ------------------------------------------------------------------------------------------ running the cases


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"no answer within {TIMEOUT_S} s")


def _build(c: Case, tmp_path: Path) -> Path:
    d, lay = _src(c.arch)
    out = c.make(d, lay, tmp_path)
    assert out is not None, f"case {c.id} built nothing from the {c.arch} fixture"
    if isinstance(out, (bytes, bytearray)):
        p = tmp_path / f"{c.id}.gguf"
        p.write_bytes(bytes(out))
        return p
    return Path(out)


def _load(path: Path):
    from kimi_mlx.convert.gguf.reader import GGUFFile
    from kimi_mlx.chat.tokenizer import load_gguf_tokenizer

    from kimi_mlx.loading import load_gguf_model

    g = GGUFFile(path)
    load_gguf_model(g)
    load_gguf_tokenizer(g)


def test_corpus_size():
    """The corpus has at least 40 cases, over both architectures."""
    assert len(CASES) >= 40 and {c.arch for c in CASES} == {"kl", "k3"}
    assert len({c.id for c in CASES}) == len(CASES)


def test_fixtures_load_cleanly():
    """The unmodified F32 fixtures pass the same path (so every failure below is due to its corruption)."""
    for a in ("kl", "k3"):
        _load(SRC[a])


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_malformed(c: Case, tmp_path):
    """Each corrupted file raises GGUFFormatError (not another exception, a crash or a hang) naming the file and
    the words that name its cause."""
    p = _build(c, tmp_path)
    guard = threading.current_thread() is threading.main_thread()  # signals only work in the main thread
    old = signal.signal(signal.SIGALRM, _alarm) if guard else None
    if guard:
        signal.alarm(TIMEOUT_S)
    try:
        with pytest.raises(GGUFFormatError) as e:
            _load(p)
    finally:
        if guard:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    msg = str(e.value)
    assert str(p) in msg, f"{c.doc}: message does not name the file: {msg}"
    what = msg.replace(str(p), "<file>").lower()  # key words must come from the message, not the file's name
    assert all(k.lower() in what for k in c.expect), f"{c.doc}: expected all of {c.expect} in: {msg}"


ABSURD = [c for c in CASES if any(s in c.id for s in ("2^", "-max"))]


def test_absurd_sizes_neither_allocate_nor_hang(tmp_path):
    """Files claiming 2**60 tensors / KVs / array elements, 2**60-byte strings, ... are rejected in a child process
    within seconds, its peak RSS growing by < 256 MiB while opening them all."""
    paths = [str(_build(c, tmp_path / c.id) if (tmp_path / c.id).mkdir() is None else None) for c in ABSURD]
    assert len(paths) >= 8
    code = textwrap.dedent(
        """
        import json, resource, sys
        from kimi_mlx.convert.gguf.reader import GGUFFile, GGUFFormatError
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        bad = []
        for p in json.loads(sys.argv[1]):
            try:
                GGUFFile(p)
                bad.append((p, "accepted"))
            except GGUFFormatError:
                pass
            except BaseException as e:
                bad.append((p, repr(e)))
        unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * unit
        print(json.dumps({"bad": bad, "grew_bytes": grew}))
        """
    )
    r = subprocess.run([sys.executable, "-c", code, json.dumps(paths)], capture_output=True, text=True, timeout=60,
                       check=False, cwd=tmp_path)  # the installed package, not the source tree
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bad"] == []
    assert out["grew_bytes"] < 256 * 2**20
