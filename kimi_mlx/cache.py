"""Generation caches for the hybrid model: one entry per decoder layer.

- ``MLALatentCache`` (MLA layers): the compressed latent ``kv_latent: [B, 1, S, kv_lora_rank]`` and the shared
  un-rotated key part ``k_pe: [B, 1, S, qk_rope_head_dim]`` (NoPE: nothing else is needed for any position).
- ``KDACache`` (KDA layers): ``conv_state: [B, K-1, 3*H*D]`` (last K-1 pre-conv q|k|v projections, activation dtype)
  and ``recurrent_state: [B, H, Dv, Dk]`` float32.

Both carry ``offset`` (tokens seen) and an optional ``left_padding: [B]`` (ragged batches are left-padded; padded
positions are masked out everywhere). They follow the parts of mlx-lm's cache protocol that ``mlx_lm.generate`` uses
(``state``, ``is_trimmable``, ``trim``, ``nbytes``), so our model also runs under mlx-lm's generator.

``HybridCache`` (what ``model.make_cache()`` returns) is the list of per-layer caches plus **checkpoints**: KDA state
cannot be trimmed, so ``cache.checkpoint()`` snapshots every KDA layer's conv + recurrent state and the offsets, and
``cache.restore(cp)`` rolls the whole cache back to it (MLA layers by trimming their latent cache)::

    cache = model.make_cache()
    model(prompt[None], cache=cache)
    cp = cache.checkpoint()               # after the prompt
    ...                                   # decode a reply
    cache.restore(cp)                     # back to "after the prompt": decode another reply

Restoring drops the checkpoints taken after ``cp`` (the MLA positions they cover are overwritten by what comes next);
only the last ``max_checkpoints`` are kept (older ones are released and cannot be restored).

``make_cache(..., kv_bits=8 or 4, kv_group_size=32/64/128)`` gives MLA layers a ``QuantizedMLALatentCache``: each
latent part (``kv_latent``, ``k_pe``) stored as ``mx.quantize`` lays it out (affine: uint32-packed codes, one scale
and one bias per group in the model dtype), a part whose width the group does not divide stays float; what
``parallel.plan.cache_bytes(..., kv_bits, kv_group_size)`` counts. ``MLALatentCache.to_quantized`` converts a float
cache (mlx-lm's ``maybe_quantize_kv_cache`` calls it: ``quantized_kv_start``).

For serving many sequences: ``cache.snapshot(row)`` copies one sequence's whole cache out (a ``CacheSnapshot``, to
keep across requests), ``cache_from_snapshot(snap)`` makes a fresh cache from it, ``merge_caches(caches)`` stacks
caches into one left-padded batch, and ``cache.filter(rows)`` keeps some rows of a batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx


class _LayerCache:
    def __init__(self, left_padding: Optional[mx.array] = None):
        self.offset = 0
        self.left_padding = left_padding

    @property
    def left_padding(self) -> Optional[mx.array]:
        return self._left_padding

    @left_padding.setter
    def left_padding(self, pad: Optional[mx.array]) -> None:
        self._left_padding = pad
        self._padded_until = 0 if pad is None else int(pad.max().item())  # no row is padded from here on

    def valid_mask(self, n: int) -> Optional[mx.array]:
        """[B, n] bool: True where the next n positions are real tokens (None when none of them is padded: decoding
        a left-padded batch takes the unmasked path)."""
        if self.offset >= self._padded_until:
            return None
        pos = self.offset + mx.arange(n)
        return pos[None, :] >= self.left_padding[:, None]

    def empty(self) -> bool:
        return self.offset == 0


KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


def check_kv_quant(kv_bits: Optional[int], kv_group_size: int) -> None:
    """Refuse a latent-cache quantization setting we do not support (``kv_bits`` None: float cache)."""
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS} (or None for a float cache), got {kv_bits}")
    if kv_bits is not None and kv_group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {kv_group_size}")


def _map(part, fn):
    """Apply ``fn`` to a latent part: one float array, or the (codes, scales, biases) triple of a quantized one."""
    if part is None:
        return None
    return tuple(fn(a) for a in part) if isinstance(part, tuple) else fn(part)


def _arrays(part) -> list[mx.array]:
    return [] if part is None else list(part) if isinstance(part, tuple) else [part]


def _width(part) -> int:
    """Number of positions (axis 2) of a part."""
    return (part[0] if isinstance(part, tuple) else part).shape[2]


class MLALatentCache(_LayerCache):
    """Latent KV of one MLA layer; grows in steps of ``step`` positions, or at once to ``reserved`` positions.

    Growing copies the filled part into a larger buffer, so for a moment the cache is held twice: a transient of the
    cache's size at every growth. ``reserve(n)`` (what the generators call with prompt + max_tokens) makes the first
    allocation hold ``n`` positions, so a long prefill and its decode never regrow.
    """

    step = 256
    kv_bits: Optional[int] = None
    kv_group_size: int = 64

    def __init__(self, left_padding: Optional[mx.array] = None):
        super().__init__(left_padding)
        self.kv_latent = None  # [B, 1, capacity, r] (quantized: a (codes, scales, biases) triple)
        self.k_pe = None  # [B, 1, capacity, dr] (likewise)
        self.reserved = 0

    def reserve(self, n: int) -> None:
        """Hold room for ``n`` positions in all from the next growth on (no copy now)."""
        self.reserved = max(self.reserved, n)

    @property
    def quant(self) -> Optional[tuple[int, int]]:
        """(kv_bits, kv_group_size) of a quantized cache, None for a float one."""
        return None if self.kv_bits is None else (self.kv_bits, self.kv_group_size)

    def empty_like(self) -> "MLALatentCache":
        """An empty cache of the same kind (and quantization) with this cache's left padding."""
        return MLALatentCache(self.left_padding)

    def _encode(self, x: mx.array):
        """A new ``[B, 1, T, w]`` part as stored (float here)."""
        return x

    def update_and_fetch(self, kv_latent: mx.array, k_pe: mx.array):
        """Append ``[B, 1, T, r]`` / ``[B, 1, T, dr]`` and return the filled ``[B, 1, offset+T, ·]`` views (for a
        quantized cache: each part as stored, a triple or a float array)."""
        prev, n = self.offset, kv_latent.shape[2]
        new = [self._encode(kv_latent), self._encode(k_pe)]
        if self.kv_latent is None or prev + n > _width(self.kv_latent):
            grow = ((max(n, self.reserved - prev) + self.step - 1) // self.step) * self.step

            def extend(old: Optional[mx.array], a: mx.array) -> mx.array:
                zeros = mx.zeros((*a.shape[:2], grow, a.shape[3]), a.dtype)
                if old is None:
                    return zeros
                return mx.concatenate([old[:, :, :prev], zeros], axis=2)

            def extend_part(old, part):
                if isinstance(part, tuple):
                    return tuple(extend(o, a) for o, a in zip(old or (None,) * 3, part))
                return extend(old, part)

            self.kv_latent, self.k_pe = (extend_part(o, p) for o, p in zip((self.kv_latent, self.k_pe), new))
        self.offset += n
        for old, part in zip((self.kv_latent, self.k_pe), new):
            for o, a in zip(_arrays(old), _arrays(part)):
                o[:, :, prev : self.offset] = a
        return self.fetch()

    def fetch(self):
        """The filled ``[B, 1, offset, ·]`` parts."""
        return tuple(_map(p, lambda a: a[:, :, : self.offset]) for p in (self.kv_latent, self.k_pe))

    @property
    def state(self) -> list[mx.array]:
        """Every filled array (a quantized part contributes codes, scales, biases)."""
        if self.kv_latent is None:
            return []
        return [a for p in self.fetch() for a in _arrays(p)]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        parts, i = [], 0
        for _ in range(2):
            quantized = arrays[i].dtype == mx.uint32
            parts.append(tuple(arrays[i : i + 3]) if quantized else arrays[i])
            i += 3 if quantized else 1
        self.kv_latent, self.k_pe = parts
        self.offset = _width(self.kv_latent)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def to_quantized(self, group_size: int = 64, bits: int = 8) -> "QuantizedMLALatentCache":
        """This cache quantized (same offset and left padding); what mlx-lm's ``maybe_quantize_kv_cache`` calls."""
        q = QuantizedMLALatentCache(self.left_padding, bits=bits, group_size=group_size)
        q.reserved = self.reserved
        if self.kv_latent is not None:
            q.kv_latent, q.k_pe = (q._encode(p) for p in self.fetch())
        q.offset = self.offset
        return q


class QuantizedMLALatentCache(MLALatentCache):
    """``MLALatentCache`` holding each latent part as ``mx.quantize(part, group_size, bits)`` (affine), a part whose
    width ``group_size`` does not divide in float; attention reads it as stored (``ops.mla_attention``, ``quant=``)."""

    def __init__(self, left_padding: Optional[mx.array] = None, *, bits: int = 8, group_size: int = 64):
        check_kv_quant(bits, group_size)
        super().__init__(left_padding)
        self.kv_bits, self.kv_group_size = bits, group_size

    def empty_like(self) -> "QuantizedMLALatentCache":
        return QuantizedMLALatentCache(self.left_padding, bits=self.kv_bits, group_size=self.kv_group_size)

    def _encode(self, x: mx.array):
        if x.shape[-1] % self.kv_group_size:
            return x
        return tuple(mx.quantize(x, group_size=self.kv_group_size, bits=self.kv_bits))

    @property
    def to_quantized(self):
        # no to_quantized here: mlx-lm's maybe_quantize_kv_cache converts the layers that have one
        raise AttributeError("this latent cache is already quantized")


def _new_mla(quant: Optional[tuple[int, int]], left_padding: Optional[mx.array]) -> MLALatentCache:
    if quant is None:
        return MLALatentCache(left_padding)
    return QuantizedMLALatentCache(left_padding, bits=quant[0], group_size=quant[1])


class KDACache(_LayerCache):
    """Short-conv state and recurrent state of one KDA layer (cannot be trimmed: it is a running summary)."""

    def __init__(self, left_padding: Optional[mx.array] = None):
        super().__init__(left_padding)
        self.conv_state: Optional[mx.array] = None
        self.recurrent_state: Optional[mx.array] = None

    def empty_like(self) -> "KDACache":
        return KDACache(self.left_padding)

    def advance(self, n: int) -> None:
        self.offset += n

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv_state, self.recurrent_state) if a is not None]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.conv_state, self.recurrent_state = arrays

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)




class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this cache (released, from another cache, or ahead of it)."""


@dataclass(frozen=True)
class CacheCheckpoint:
    """Snapshot of a ``HybridCache`` at ``offset`` tokens.

    kda_states: per layer, ``(conv_state, recurrent_state)`` for KDA layers (``None`` entries while a layer is still
    empty), ``None`` for MLA layers. ``serial`` orders the checkpoints of one cache; ``cache_id`` names that cache.
    """

    cache_id: int
    serial: int
    offset: int
    kda_states: tuple

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for s in self.kda_states if s for a in s if a is not None)


@dataclass(frozen=True)
class CacheSnapshot:
    """One sequence's whole cache after ``offset`` tokens, without left padding (see ``HybridCache.snapshot``).

    kda_layers: per layer, whether it is a KDA layer. states: per layer, ``(conv_state [1, K-1, C],
    recurrent_state [1, H, Dv, Dk])`` for KDA layers, ``(kv_latent [1, 1, offset, r], k_pe [1, 1, offset, dr])``
    for MLA layers (each a (codes, scales, biases) triple when quantized); ``(None, None)`` while the layer is empty
    (offset 0). kv_quant: ``(kv_bits, kv_group_size)`` of the MLA layers, None for a float latent cache.
    """

    offset: int
    kda_layers: tuple
    states: tuple
    kv_quant: Optional[tuple] = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for s in self.states for p in s for a in _arrays(p))


_cache_ids = itertools.count()


class HybridCache(list):
    """Per-layer caches of one model (a ``list``, as mlx-lm expects) with ``checkpoint()`` / ``restore(cp)``.

    max_checkpoints: how many checkpoints are kept; taking one more releases the oldest.
    """

    def __init__(self, layers: list[_LayerCache], max_checkpoints: int = 8):
        super().__init__(layers)
        if max_checkpoints < 1:
            raise ValueError(f"max_checkpoints must be >= 1, got {max_checkpoints}")
        self.max_checkpoints = max_checkpoints
        self.checkpoints: list[CacheCheckpoint] = []
        self._id = next(_cache_ids)
        self._serial = itertools.count()

    @property
    def offset(self) -> int:
        """Tokens seen (the same for every layer)."""
        return self[0].offset if self else 0

    def checkpoint(self) -> CacheCheckpoint:
        """Snapshot the KDA states (evaluated, so the snapshot holds no graph) and the offset; returns the checkpoint."""
        offsets = {c.offset for c in self}
        if len(offsets) > 1:
            raise CheckpointError(f"cache layers disagree on the offset ({sorted(offsets)}); cannot checkpoint")
        states = tuple(
            (c.conv_state, c.recurrent_state) if isinstance(c, KDACache) else None for c in self
        )
        mx.eval([a for s in states if s for a in s if a is not None])
        cp = CacheCheckpoint(self._id, next(self._serial), self.offset, states)
        self.checkpoints.append(cp)
        del self.checkpoints[: -self.max_checkpoints]
        return cp

    def restore(self, cp: CacheCheckpoint) -> None:
        """Roll every layer back to ``cp``: KDA layers get the snapshot, MLA layers are trimmed to ``cp.offset``.

        The checkpoints taken after ``cp`` are dropped; ``cp`` itself stays restorable.
        """
        if cp.cache_id != self._id:
            raise CheckpointError("checkpoint was taken from another cache")
        if cp not in self.checkpoints:
            raise CheckpointError(
                f"checkpoint at offset {cp.offset} was released (only the last {self.max_checkpoints} are kept, and "
                "restoring an earlier checkpoint drops the later ones)"
            )
        if cp.offset > self.offset:
            raise CheckpointError(f"checkpoint at offset {cp.offset} is ahead of the cache (offset {self.offset})")
        for c, snap in zip(self, cp.kda_states):
            if snap is None:
                c.trim(c.offset - cp.offset)
            else:
                c.conv_state, c.recurrent_state = snap
                c.offset = cp.offset
        self.checkpoints = [k for k in self.checkpoints if k.serial <= cp.serial]

    def snapshot(self, row: int = 0) -> CacheSnapshot:
        """Row ``row`` of this (possibly left-padded) batch cache as a ``CacheSnapshot``, its padding dropped.

        The arrays are evaluated copies: the snapshot does not keep the cache's buffers alive, and later writes to
        the cache cannot reach it.
        """
        offset = _common_offset(self, "snapshot")
        rows = _rows(self)
        if not 0 <= row < rows:
            raise IndexError(f"row {row} out of range for a cache of {rows} rows")
        pad = int(self[0].left_padding[row].item()) if self[0].left_padding is not None else 0
        pad = min(pad, offset)
        states = []
        for c in self:
            if isinstance(c, KDACache):
                # one row's KDA state is the whole array (never written in place): shared, not copied
                pair = (c.conv_state, c.recurrent_state)
                states.append(tuple(a if a is None or rows == 1 else _copy(a[row : row + 1]) for a in pair))
            elif c.kv_latent is None or offset == pad:
                states.append((None, None))
            else:
                states.append(tuple(_map(p, lambda a: _copy(a[row : row + 1, :, pad:offset])) for p in (c.kv_latent, c.k_pe)))
        mx.eval([a for s in states for p in s for a in _arrays(p)])
        return CacheSnapshot(offset - pad, tuple(isinstance(c, KDACache) for c in self), tuple(states), _kv_quant(self))

    def filter(self, rows: list[int]) -> None:
        """Keep ``rows`` of the batch (in that order), in place; drop the left padding all kept rows share.

        The checkpoints are dropped (they hold every row's states).
        """
        n = _rows(self)
        if not rows or any(not 0 <= r < n for r in rows):
            raise IndexError(f"rows {rows} must be a non-empty list of rows of a cache of {n} rows")
        offset = _common_offset(self, "filter")
        idx = mx.array(rows)
        pad = self[0].left_padding
        kept = [int(p) for p in pad[idx].tolist()] if pad is not None else [0] * len(rows)
        drop = min(min(kept), offset)
        left_padding = _padding([p - drop for p in kept])
        for c in self:
            if isinstance(c, KDACache):
                pair = (c.conv_state, c.recurrent_state)
                c.conv_state, c.recurrent_state = (None if a is None else a[idx] for a in pair)
            elif c.kv_latent is not None:
                c.kv_latent, c.k_pe = (_map(p, lambda a: a[idx, :, drop:offset]) for p in (c.kv_latent, c.k_pe))
            c.offset = offset - drop
            c.left_padding = left_padding
        self.checkpoints = []

    def reset(self) -> None:
        """Empty every layer and drop all checkpoints."""
        for i, c in enumerate(self):
            self[i] = c.empty_like()
        self.checkpoints = []

    @property
    def kv_quant(self) -> Optional[tuple[int, int]]:
        """``(kv_bits, kv_group_size)`` of the MLA layers' latent cache, None when it is float."""
        return _kv_quant(self)

    @property
    def nbytes(self) -> int:
        """Bytes held by the layer caches and the checkpoints."""
        return sum(c.nbytes for c in self) + sum(cp.nbytes for cp in self.checkpoints)


def reserve_cache(cache: list, n: int, max_length: Optional[int] = None) -> None:
    """Have every MLA latent layer of ``cache`` allocate room for ``n`` positions (at most ``max_length``) at its next
    growth, so reaching ``n`` never regrows (``MLALatentCache.reserve``)."""
    n = n if max_length is None else min(n, max_length)
    for c in cache:
        if isinstance(c, MLALatentCache):
            c.reserve(n)


def make_cache(
    kda_layers: list[bool], left_padding: Optional[list[int]] = None, max_checkpoints: int = 8,
    kv_bits: Optional[int] = None, kv_group_size: int = 64,
) -> HybridCache:
    """One cache per layer: ``KDACache`` where ``kda_layers[i]`` is true, else ``MLALatentCache``
    (``QuantizedMLALatentCache`` with ``kv_bits`` 8 or 4 and ``kv_group_size`` 32, 64 or 128).

    ``left_padding``: per-sequence number of pad tokens at the start of a ragged, left-padded batch.
    ``max_checkpoints``: see ``HybridCache``.
    """
    check_kv_quant(kv_bits, kv_group_size)
    quant = None if kv_bits is None else (kv_bits, kv_group_size)
    pad = None
    if left_padding is not None and any(p > 0 for p in left_padding):
        pad = mx.array(left_padding, dtype=mx.int32)
    layers = [KDACache(pad) if is_kda else _new_mla(quant, pad) for is_kda in kda_layers]
    return HybridCache(layers, max_checkpoints)


def cache_from_snapshot(snap: CacheSnapshot, max_checkpoints: int = 8) -> HybridCache:
    """A fresh one-sequence cache holding exactly ``snap`` (the layout of ``model.make_cache()``)."""
    layers = []
    for is_kda, (a, b) in zip(snap.kda_layers, snap.states):
        c = KDACache() if is_kda else _new_mla(snap.kv_quant, None)
        if is_kda:
            c.conv_state, c.recurrent_state = a, b
        elif a is not None:
            # new array objects: MLX's slice assignment (update_and_fetch after a trim) rewrites its target in place
            c.kv_latent, c.k_pe = _map(a, mx.array), _map(b, mx.array)
        c.offset = snap.offset
        layers.append(c)
    return HybridCache(layers, max_checkpoints)


def merge_caches(caches: list[HybridCache]) -> HybridCache:
    """Stack the rows of ``caches`` (in order; each may hold B >= 1 left-padded rows) into one left-padded batch.

    The result is at the largest offset; a shorter cache's rows get that many more pad positions in front (zero
    MLA latents, hidden by the mask). An empty KDA state (a cache at offset 0) becomes zeros, which is what a KDA
    layer starts from. Every array is copied (cost: the whole batch's cache).
    """
    if not caches:
        raise ValueError("merge_caches needs at least one cache")
    kinds = [tuple(isinstance(c, KDACache) for c in cache) for cache in caches]
    if len(set(kinds)) > 1:
        raise ValueError("cannot merge caches of different layer layouts")
    quants = {_kv_quant(cache) for cache in caches}
    if len(quants) > 1:
        raise ValueError(f"cannot merge caches of different latent-cache quantizations ({_quant_names(quants)})")
    quant = quants.pop()
    offsets = [_common_offset(cache, "merge") for cache in caches]
    offset = max(offsets)
    sizes = [_rows(cache) for cache in caches]
    pads = []
    for cache, o, n in zip(caches, offsets, sizes):
        own = cache[0].left_padding.tolist() if cache and cache[0].left_padding is not None else [0] * n
        pads += [p + offset - o for p in own]
    left_padding = _padding(pads)
    layers = []
    for i, is_kda in enumerate(kinds[0]):
        parts = [cache[i] for cache in caches]
        c = KDACache(left_padding) if is_kda else _new_mla(quant, left_padding)
        if is_kda:
            c.conv_state = _stack([p.conv_state for p in parts], sizes)
            c.recurrent_state = _stack([p.recurrent_state for p in parts], sizes)
        elif offset > 0:
            filled = [p.fetch() if p.kv_latent is not None else (None, None) for p in parts]
            c.kv_latent, c.k_pe = (_stack_parts([_pad_front_part(f[j], offset - o) for f, o in zip(filled, offsets)],
                                                sizes) for j in range(2))
        c.offset = offset
        layers.append(c)
    return HybridCache(layers, caches[0].max_checkpoints)


def _kv_quant(cache: HybridCache) -> Optional[tuple[int, int]]:
    return next((c.quant for c in cache if isinstance(c, MLALatentCache)), None)


def _quant_names(quants) -> str:
    return ", ".join(sorted("float" if q is None else f"{q[0]}-bit group {q[1]}" for q in quants))


def _common_offset(cache: HybridCache, what: str) -> int:
    offsets = {c.offset for c in cache}
    if len(offsets) > 1:
        raise ValueError(f"cache layers disagree on the offset ({sorted(offsets)}); cannot {what}")
    return cache.offset


def _rows(cache: HybridCache) -> int:
    """Batch size of ``cache``: from its states, else its left padding, else 1 (an empty unpadded cache)."""
    for c in cache:
        for a in c.state:
            return a.shape[0]
    if cache and cache[0].left_padding is not None:
        return cache[0].left_padding.shape[0]
    return 1


def _padding(pads: list[int]) -> Optional[mx.array]:
    return mx.array(pads, dtype=mx.int32) if any(p > 0 for p in pads) else None


def _copy(a: mx.array) -> mx.array:
    """A copy of a slice that does not share (and so keep alive) the sliced buffer."""
    return mx.contiguous(a)


def _pad_front(a: Optional[mx.array], n: int) -> Optional[mx.array]:
    """``[B, 1, T, d]`` -> ``[B, 1, n + T, d]`` with n zero positions in front."""
    if a is None or n == 0:
        return a
    return mx.concatenate([mx.zeros((*a.shape[:2], n, a.shape[3]), a.dtype), a], axis=2)


def _pad_front_part(part, n: int):
    return _map(part, lambda a: _pad_front(a, n))


def _stack_parts(parts: list, sizes: list[int]):
    """``_stack`` of latent parts (float arrays or quantized triples, None for an empty cache)."""
    like = next((p for p in parts if p is not None), None)
    if not isinstance(like, tuple):
        return _stack(parts, sizes)
    return tuple(_stack([None if p is None else p[k] for p in parts], sizes) for k in range(3))


def _stack(arrays: list[Optional[mx.array]], sizes: list[int]) -> Optional[mx.array]:
    """Concatenate along the batch axis; a None part (an empty cache of ``sizes[i]`` rows) becomes zeros shaped
    like the others."""
    like = next((a for a in arrays if a is not None), None)
    if like is None:
        return None
    return mx.concatenate(
        [a if a is not None else mx.zeros((n, *like.shape[1:]), like.dtype) for a, n in zip(arrays, sizes)]
    )
