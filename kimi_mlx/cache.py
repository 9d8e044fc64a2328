"""Generation caches for the hybrid model: one entry per decoder layer.

- ``MLALatentCache`` (MLA layers): the compressed latent ``kv_latent: [B, 1, S, kv_lora_rank]`` and the shared
  un-rotated key part ``k_pe: [B, 1, S, qk_rope_head_dim]`` (NoPE: nothing else is needed for any position), stored
  in **pages** of ``PAGE_SIZE`` positions (``LatentPage``; page k holds positions [k P, (k + 1) P)). Growing adds a
  page, or doubles the room of the last one (``_room``: a last page holds from ``MIN_ROOM`` to ``PAGE_SIZE``
  positions); a full page is never copied to grow. Attention reads the pages where they lie, as consecutive key
  segments (``fetch()``; ``ops.mla_attention`` takes the lists).
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
only the last ``max_checkpoints`` are kept (older ones are released and cannot be restored). ``cache.trim(n)`` drops
the last n tokens the same way: it restores the checkpoint taken at ``offset - n``, so a caller that may roll back
takes a checkpoint there first (mlx-lm's ``trim_prompt_cache`` asks the layers, and a KDA layer is not trimmable).

Each layer cache implements what ``HybridCache`` does with it: ``checkpoint`` / ``restore``, ``snapshot`` (one row's
entry of a ``CacheSnapshot``) / ``load_snapshot``, ``filter`` (keep rows), ``merge`` (stack several caches' layers),
``depend_on`` and mlx-lm's ``trim``.

``make_cache(..., kv_bits=8 or 4, kv_group_size=32/64/128)`` gives MLA layers a ``QuantizedMLALatentCache``: each
latent part (``kv_latent``, ``k_pe``) stored as a ``QuantizedLatent`` (``ops/latent.py``: ``mx.quantize``'s affine
layout, uint32-packed codes, one scale and one bias per group in the model dtype, with its bits and group size), a
part whose width the group does not divide stays float; attention reads the parts as stored. That layout is what
``parallel.accounting.cache_bytes(..., kv_bits, kv_group_size)`` counts. ``MLALatentCache.to_quantized`` converts a float
cache (mlx-lm's ``maybe_quantize_kv_cache`` calls it: ``quantized_kv_start``).

For serving many sequences: ``cache.snapshot(row)`` takes one sequence's whole cache out (a ``CacheSnapshot``, to
keep across requests), ``cache_from_snapshot(snap)`` makes a fresh cache from it, ``merge_caches(caches)`` stacks
caches into one left-padded batch, and ``cache.filter(rows)`` keeps some rows of a batch. Snapshots inside one
prefill call: ``cache.mark(offsets)`` before it makes each KDA layer keep its state where the call passes those
offsets (it cuts its scan there), and ``cache.snapshot(row, at=offset)`` after it gives the cache as it was there
(the latent positions before ``at``, the kept state)::

    cache.mark([n_system])                # the system prompt's end lies inside the next call
    model(prompt[None], cache=cache)
    system = cache.snapshot(at=n_system)  # what a call of the system prompt alone would have left

**Pages are shared, never modified.** A page is immutable: the cache writes its last page functionally (a new
``LatentPage`` each time), so whoever else holds the old page keeps it as it was. MLX writes the buffer in place when
the cache is its only holder and copies that one page otherwise: copy on write of the last, partial page. What
shares and what copies:

- growth, decode, chunked prefill: a full page is never copied; the last page is copied when it outgrows its room
  (doubled, up to ``PAGE_SIZE``), fewer positions in all than the page holds;
- ``snapshot`` of a one-row cache, ``cache_from_snapshot``, ``merge_caches`` of one cache, prompt-cache files loaded:
  full pages are shared; a snapshot copies the filled part of a partial last page (fewer than ``PAGE_SIZE``
  positions), and a cache whose last page is such a short page copies it into one with room (``_room``) at its next write;
- batches (B > 1): attention reads a page as one ``[B, 1, P, ·]`` array, so ``merge_caches`` of several caches
  copies every row into batch pages once, and ``filter`` copies the kept rows (a filter down to one row instead
  shares the pages that row had before the merge, see below, and copies the rest). With
  ``merge_caches(..., keep_row_pages=True)`` (the server, whose prefix cache holds the same pages) a batch keeps each
  merged one-row cache's full pages (``origins``), so a ``snapshot`` of that row shares them and copies only the
  positions written since the merge (plus the partial page before them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .ops import latent
from .ops.latent import Latent


class _LayerCache:
    """What every layer cache has: ``offset``, ``left_padding`` and the padding mask. Each kind implements
    ``checkpoint`` / ``restore`` (roll back to a checkpoint), ``mark`` (keep what a snapshot inside the next forward
    call needs), ``snapshot`` / ``load_snapshot`` (one row out, into a fresh cache), ``filter`` (keep rows),
    ``merge`` (stack caches' rows), ``depend_on``, and mlx-lm's ``trim``."""

    is_kda = False  # a KDA layer's cache (``CacheSnapshot.kda_layers``)
    quant: Optional[tuple[int, int]] = None  # (kv_bits, kv_group_size) of a quantized latent; None: float or none

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


PAGE_SIZE = 4096  # positions per latent page (bench/bench_long_context.py, bench/bench_mla_attention.py: the choice)


@dataclass(frozen=True, eq=False)
class LatentPage:
    """Consecutive positions of one MLA layer's latent cache: ``kv_latent [B, 1, n, r]`` and ``k_pe [B, 1, n, dr]``
    as stored (each a float array or a ``QuantizedLatent``, ``ops/latent.py``). ``n`` is ``PAGE_SIZE``, or less for
    a last page (its room, ``_room``) and the short last page a snapshot or a file ends with. Never modified: writing gives a new page (``written``), and
    caches and snapshots hold pages by reference, so a shared page is one object (``is``) and one buffer."""

    kv_latent: Latent
    k_pe: Latent

    @property
    def size(self) -> int:
        return latent.width(self.kv_latent)

    @property
    def rows(self) -> int:
        return latent.rows(self.kv_latent)

    @property
    def arrays(self) -> list[mx.array]:
        return [*latent.arrays(self.kv_latent), *latent.arrays(self.k_pe)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def parts(self, a: int, b: int, rows: Optional[mx.array] = None) -> tuple:
        """(kv_latent, k_pe) of positions [a, b) and ``rows`` (an index array; None: all), views unless rows are
        picked (the page's own parts when that is all of it)."""
        if rows is None and (a, b) == (0, self.size):
            return self.kv_latent, self.k_pe

        def cut(x: mx.array) -> mx.array:
            x = x[:, :, a:b]
            return x if rows is None else x[rows]

        return latent.map_arrays(self.kv_latent, cut), latent.map_arrays(self.k_pe, cut)

    def written(self, at: int, parts: tuple) -> "LatentPage":
        """This page with ``parts`` ((kv_latent, k_pe) ``[B, 1, m, ·]`` as stored) written at position ``at``, as a
        new page. MLX writes the buffer in place when this page has no other holder, and copies it otherwise."""
        return LatentPage(*(latent.write(mine, new, at) for mine, new in zip((self.kv_latent, self.k_pe), parts)))

    def with_arrays(self, arrays: list[mx.array]) -> "LatentPage":
        """A page of the same layout made of ``arrays`` (in the order of ``arrays``)."""
        flat = iter(arrays)
        return LatentPage(*(latent.map_arrays(p, lambda _: next(flat)) for p in (self.kv_latent, self.k_pe)))


MIN_ROOM = 256  # positions a new last page has room for at least


def _room(n: int, P: int) -> int:
    """Positions to allocate for a last page that must hold ``n`` (<= P): the next power of two, at least
    ``MIN_ROOM``, at most ``P``. A page outgrowing its room is copied into one twice as large, so filling a page
    copies fewer positions than it holds, and a batch made of short pages (a merge, a filter, a restored snapshot)
    does not allocate and copy ``P`` positions per row at its next step."""
    return min(P, max(MIN_ROOM, 1 << (n - 1).bit_length()))


def _blank(like: LatentPage, rows: int, size: int) -> tuple:
    """Zero parts (kv_latent, k_pe) ``[rows, 1, size, ·]`` in the layout of ``like``."""
    return tuple(latent.map_arrays(p, lambda a: mx.zeros((rows, a.shape[1], size, *a.shape[3:]), a.dtype))
                 for p in (like.kv_latent, like.k_pe))


class MLALatentCache(_LayerCache):
    """Latent KV of one MLA layer, in pages of ``page_size`` positions (``pages``: page k holds positions
    [k P, (k + 1) P), every page full but the last). Growing allocates a page; nothing stored is copied.

    ``origins`` (a batch made by ``merge_caches(..., keep_row_pages=True)``, else None): per row, the full pages that
    row had as a one-row cache before the merge (its positions [0, len * P) after its own padding), shared with
    whoever else holds them, so that a snapshot of the row does not copy them again.
    """

    page_size = PAGE_SIZE
    kv_bits: Optional[int] = None
    kv_group_size: int = 64

    def __init__(self, left_padding: Optional[mx.array] = None):
        super().__init__(left_padding)
        self.pages: list[LatentPage] = []
        self.origins: Optional[list[tuple[LatentPage, ...]]] = None

    @property
    def quant(self) -> Optional[tuple[int, int]]:
        """(kv_bits, kv_group_size) of a quantized cache, None for a float one (what snapshots and files record)."""
        return None if self.kv_bits is None else (self.kv_bits, self.kv_group_size)

    def empty_like(self, left_padding: Optional[mx.array]) -> "MLALatentCache":
        """An empty cache of the same kind (and quantization) with ``left_padding``."""
        return MLALatentCache(left_padding)

    def _encode(self, x: mx.array) -> Latent:
        """A new ``[B, 1, T, w]`` part as stored (float here)."""
        return x

    def update_and_fetch(self, kv_latent: mx.array, k_pe: mx.array) -> tuple[list, list]:
        """Append ``[B, 1, T, r]`` / ``[B, 1, T, dr]`` and return the filled pages as key segments: (kv_latent parts,
        k_pe parts), each ``[B, 1, n, ·]`` as stored (see ``fetch``)."""
        new = (self._encode(kv_latent), self._encode(k_pe))
        P, n, done, B = self.page_size, kv_latent.shape[2], 0, kv_latent.shape[0]
        while done < n:
            k, at = divmod(self.offset + done, P)
            m = min(n - done, P - at)
            if k == len(self.pages):
                self.pages.append(LatentPage(*_blank(LatentPage(*new), B, _room(m, P))))
            page = self.pages[k]
            if page.size < at + m:  # a last page without room (a snapshot's or a file's end, or outgrown): copied
                grown = LatentPage(*_blank(page, B, _room(at + m, P)))
                page = grown.written(0, page.parts(0, at)) if at else grown
            self.pages[k] = page.written(at, tuple(latent.positions(p, done, done + m) for p in new))
            done += m
        self.offset += n
        return self.fetch()

    def fetch(self) -> tuple[list, list]:
        """The filled positions as key segments, one per page: (kv_latent parts, k_pe parts), views ``[B, 1, n, ·]``
        (n = ``page_size`` but for the last), never concatenated."""
        P = self.page_size
        segments = [page.parts(0, min(page.size, self.offset - k * P)) for k, page in enumerate(self.pages)]
        return [s[0] for s in segments], [s[1] for s in segments]

    def whole(self) -> tuple:
        """The filled positions as one (kv_latent, k_pe) pair ``[B, 1, offset, ·]`` as stored: the pages
        concatenated (a copy; prompt-cache files store this)."""
        return tuple(latent.concatenate(parts, axis=2) for parts in self.fetch())

    def load(self, kv_latent: Latent, k_pe: Latent) -> None:
        """Hold ``[B, 1, N, ·]`` parts as stored (e.g. read from a file) as this cache's N positions: the pages are
        views of them (no copy; a short last page is copied into a full one at the next write)."""
        P, N = self.page_size, latent.width(kv_latent)
        self.pages = [LatentPage(*(latent.positions(p, s, min(s + P, N)) for p in (kv_latent, k_pe)))
                      for s in range(0, N, P)]
        self.offset = N

    def depend_on(self, x: mx.array) -> None:
        """Make the last page depend on ``x``: evaluating the cache then evaluates ``x`` too (a pipeline stage's
        communication runs when the cache is evaluated)."""
        page = self.pages[-1]
        self.pages[-1] = page.with_arrays(mx.depends(page.arrays, [x]))

    @property
    def state(self) -> list[mx.array]:
        """Every filled array, page by page (a quantized part contributes codes, scales, biases)."""
        return [a for parts in zip(*self.fetch()) for p in parts for a in latent.arrays(p)]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions (mlx-lm's protocol; returns how many were dropped); pages past the new end
        are released (the next write goes into the page that holds it, copied first if someone else holds it)."""
        n = min(self.offset, n)
        self.offset -= n
        del self.pages[-(-self.offset // self.page_size) :]
        if self.origins is not None:
            pads = self.left_padding.tolist() if self.left_padding is not None else [0] * len(self.origins)
            self.origins = [o[: max(self.offset - p, 0) // self.page_size] for o, p in zip(self.origins, pads)]
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the filled positions (a last page's unfilled room is not counted)."""
        return sum(a.nbytes for a in self.state)

    def to_quantized(self, group_size: int = 64, bits: int = 8) -> "QuantizedMLALatentCache":
        """This cache quantized (same offset and left padding), page by page; what mlx-lm's
        ``maybe_quantize_kv_cache`` calls. A batch's ``origins`` (float pages) are not kept."""
        q = QuantizedMLALatentCache(self.left_padding, bits=bits, group_size=group_size)
        q.pages = [LatentPage(q._encode(p.kv_latent), q._encode(p.k_pe)) for p in self.pages]
        q.offset = self.offset
        return q

    def row_pages(self, row: int, pad: int, end: Optional[int] = None) -> list[LatentPage]:
        """Row ``row``'s positions [pad, end) (``end`` None: the offset) as one-row pages from position ``pad`` (every
        page full but a short last one). Shared: the full pages of a one-row cache without padding, and the row's
        ``origins``; the rest is copied."""
        end = self.offset if end is None else end
        origin = self.origins[row][: (end - pad) // self.page_size] if self.origins else ()
        rows = None if self.pages[0].rows == 1 else mx.array([row])
        return list(origin) + _repage(self, pad + len(origin) * self.page_size, end, rows)

    def checkpoint(self) -> None:
        """What a ``CacheCheckpoint`` keeps of this layer: nothing (``restore`` trims the positions written since)."""
        return None

    def restore(self, state: None, offset: int) -> None:
        """Roll back to a checkpoint taken at ``offset`` tokens (``state``: this layer's ``checkpoint()``, None):
        the latent trimmed to ``offset`` positions."""
        self.trim(self.offset - offset)

    def mark(self, offsets: tuple[int, ...]) -> None:
        """Nothing to keep: the positions before any offset stay in the pages (``snapshot(..., end)`` reads them)."""

    def snapshot(self, row: int, pad: int, end: int) -> tuple[LatentPage, ...]:
        """Row ``row``'s positions [pad, end) as one-row pages from position ``pad`` (see ``row_pages``), ``()``
        when there are none: this layer's entry of a ``CacheSnapshot`` taken after ``end`` tokens."""
        return tuple(self.row_pages(row, pad, end)) if self.pages and end > pad else ()

    def load_snapshot(self, pages: tuple[LatentPage, ...], offset: int) -> None:
        """Hold a snapshot's ``pages`` (shared: this cache's writes make new pages) as positions [0, offset)."""
        self.pages, self.offset = list(pages), offset

    def filter(self, rows: list[int], drop: int, left_padding: Optional[mx.array]) -> None:
        """Keep ``rows`` of the batch (in that order) from position ``drop`` on (padding every kept row has), with
        ``left_padding``. The kept rows' positions are copied into new pages, but for all rows in order with nothing
        to drop (shared) and one row (the pages it had before a merge, ``origins``, shared)."""
        if self.pages and len(rows) == 1:
            self.pages, self.origins = self.row_pages(rows[0], drop), None
        elif self.pages and (rows != list(range(self.pages[0].rows)) or drop):
            self.pages = _repage(self, drop, self.offset, mx.array(rows))
            self.origins = [self.origins[r] for r in rows] if self.origins else None
        self.offset -= drop
        self.left_padding = left_padding

    def merge(self, parts: list["MLALatentCache"], rows: list[int], keep_row_pages: bool) -> None:
        """Become the batch of ``parts`` (this cache empty, with the batch's left padding; ``rows``: each part's
        row count) at their largest offset, a shorter part's rows behind zero positions. One part: its pages are
        shared. Several: every row is copied into batch pages; ``keep_row_pages`` also keeps each one-row part's
        full pages (``origins``)."""
        offsets = [p.offset for p in parts]
        if len(parts) == 1:
            self.pages, self.origins = list(parts[0].pages), parts[0].origins
        elif max(offsets) > 0:
            self.pages = _batch_pages(parts, offsets, rows)
            if keep_row_pages:
                self.origins = [o for p, n in zip(parts, rows) for o in _origins(p, n)]
        self.offset = max(offsets)


def _columns(cache: MLALatentCache, a: int, b: int, rows: Optional[mx.array]) -> tuple:
    """Positions [a, b) of ``cache`` (0 <= a < b <= offset) for ``rows`` (None: all) as (kv_latent, k_pe) parts
    ``[R, 1, b - a, ·]``; a view of one page when they lie in one page and all rows are taken."""
    P, pieces = cache.page_size, []
    for k in range(a // P, -(-b // P)):
        pieces.append(cache.pages[k].parts(max(a, k * P) - k * P, min(b, (k + 1) * P) - k * P, rows))
    return tuple(latent.concatenate([p[j] for p in pieces], axis=2) for j in range(2))


def _repage(cache: MLALatentCache, a: int, b: int, rows: Optional[mx.array]) -> list[LatentPage]:
    """Positions [a, b) of ``cache`` for ``rows`` (an index array; None: all) as pages of ``page_size`` positions
    from ``a``, the last one short. A page that is one of the cache's own pages (all rows, a on a page boundary)
    is that page, shared; the others are copies."""
    P, out = cache.page_size, []
    for s in range(a, b, P):
        e = min(s + P, b)
        page = cache.pages[s // P]
        if rows is None and s % P == 0 and e - s == page.size:
            out.append(page)
        else:
            out.append(LatentPage(*(latent.map_arrays(p, mx.contiguous) for p in _columns(cache, s, e, rows))))
    return out


class QuantizedMLALatentCache(MLALatentCache):
    """``MLALatentCache`` holding each latent part as ``mx.quantize(part, group_size, bits)`` (affine), a part whose
    width ``group_size`` does not divide in float (``ops.latent.quantize``); attention reads it as stored."""

    def __init__(self, left_padding: Optional[mx.array] = None, *, bits: int = 8, group_size: int = 64):
        check_kv_quant(bits, group_size)
        super().__init__(left_padding)
        self.kv_bits, self.kv_group_size = bits, group_size

    def empty_like(self, left_padding: Optional[mx.array]) -> "QuantizedMLALatentCache":
        return QuantizedMLALatentCache(left_padding, bits=self.kv_bits, group_size=self.kv_group_size)

    def _encode(self, x: mx.array) -> Latent:
        return latent.quantize(x, self.kv_bits, self.kv_group_size)

    @property
    def to_quantized(self):
        # no to_quantized here: mlx-lm's maybe_quantize_kv_cache converts the layers that have one
        raise AttributeError("this latent cache is already quantized")


def _new_mla(quant: Optional[tuple[int, int]], left_padding: Optional[mx.array]) -> MLALatentCache:
    if quant is None:
        return MLALatentCache(left_padding)
    return QuantizedMLALatentCache(left_padding, bits=quant[0], group_size=quant[1])


def _new_layer(is_kda: bool, quant: Optional[tuple[int, int]], left_padding: Optional[mx.array]) -> _LayerCache:
    """An empty layer cache: a ``KDACache`` for a KDA layer, else the latent cache of ``quant`` (None: float)."""
    return KDACache(left_padding) if is_kda else _new_mla(quant, left_padding)


class KDACache(_LayerCache):
    """Short-conv state and recurrent state of one KDA layer. A running summary: it cannot drop tokens by itself
    (mlx-lm's ``is_trimmable`` is False), it is rolled back to a ``checkpoint()`` by ``restore``, and it keeps its
    state at the offsets ``mark`` names inside the next forward call (the layer asks for ``cuts`` and hands each
    state to ``keep``), for a ``snapshot`` there."""

    is_kda = True

    def __init__(self, left_padding: Optional[mx.array] = None):
        super().__init__(left_padding)
        self.conv_state: Optional[mx.array] = None
        self.recurrent_state: Optional[mx.array] = None
        self.marks: tuple[int, ...] = ()  # offsets at which the next forward call keeps its state (``mark``)
        self.kept: dict[int, tuple] = {}  # offset -> (conv_state, recurrent_state) kept there (``keep``)

    def empty_like(self, left_padding: Optional[mx.array]) -> "KDACache":
        return KDACache(left_padding)

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
        """mlx-lm's protocol: drops nothing (``HybridCache.trim`` rolls the state back through a checkpoint)."""
        return 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def checkpoint(self) -> tuple:
        """What a ``CacheCheckpoint`` keeps of this layer: ``(conv_state, recurrent_state)`` (None while empty), the
        arrays themselves (they are replaced, never written in place)."""
        return self.conv_state, self.recurrent_state

    def restore(self, state: tuple, offset: int) -> None:
        """Roll back to a checkpoint taken at ``offset`` tokens (``state``: this layer's ``checkpoint()`` then); the
        marks and the states kept at them are dropped."""
        self.conv_state, self.recurrent_state = state
        self.offset = offset
        self.mark(())

    def mark(self, offsets: tuple[int, ...]) -> None:
        """The next forward call keeps its state at each of ``offsets`` it passes (the layer cuts its scan there and
        hands each state to ``keep``), so that ``snapshot(..., end)`` can give the layer as it was there; the states
        kept for earlier marks are dropped."""
        self.marks, self.kept = tuple(offsets), {}

    def cuts(self, n: int) -> list[int]:
        """The marks strictly inside the next ``n`` tokens, as positions of that call (0 < cut < n), in order: where
        the layer hands over its state."""
        return sorted(m - self.offset for m in self.marks if self.offset < m < self.offset + n)

    def keep(self, at: int, conv_state: mx.array, recurrent_state: mx.array) -> None:
        """The state after the first ``at`` tokens of the call now running (before ``advance``)."""
        self.kept[self.offset + at] = (conv_state, recurrent_state)

    def snapshot(self, row: int, pad: int, end: int) -> tuple:
        """Row ``row``'s ``(conv_state [1, K-1, C], recurrent_state [1, H, Dv, Dk])`` after ``end`` tokens (the
        offset, or a mark the last forward call passed; ``(None, None)`` while empty): this layer's entry of a
        ``CacheSnapshot``. A one-row cache's arrays are shared, a batch row's copied; ``pad`` does not matter (the
        state summarises the real tokens only)."""
        if end == self.offset:
            state = self.checkpoint()
        elif end in self.kept:
            state = self.kept[end]
        else:
            raise CheckpointError(f"no KDA state kept at offset {end} (cache at {self.offset}, kept at "
                                  f"{sorted(self.kept)}): mark() the offset before the forward call that passes it")
        return tuple(a if a is None or a.shape[0] == 1 else _copy(a[row : row + 1]) for a in state)

    def load_snapshot(self, state: tuple, offset: int) -> None:
        """Hold a snapshot's ``state`` (shared) as the state after ``offset`` tokens."""
        self.restore(state, offset)

    def filter(self, rows: list[int], drop: int, left_padding: Optional[mx.array]) -> None:
        """Keep ``rows`` of the batch (in that order) and forget ``drop`` leading positions, with ``left_padding``."""
        idx = mx.array(rows)
        self.conv_state, self.recurrent_state = (None if a is None else a[idx] for a in self.checkpoint())
        self.offset -= drop
        self.left_padding = left_padding
        self.mark(())

    def merge(self, parts: list["KDACache"], rows: list[int], keep_row_pages: bool) -> None:
        """Become the batch of ``parts`` (this cache empty, with the batch's left padding; ``rows``: each part's
        row count): their states stacked, an empty part's as zeros (where a KDA layer starts from)."""
        self.conv_state = _stack([p.conv_state for p in parts], rows)
        self.recurrent_state = _stack([p.recurrent_state for p in parts], rows)
        self.offset = max(p.offset for p in parts)

    def depend_on(self, x: mx.array) -> None:
        """Make the recurrent state depend on ``x``: evaluating the cache then evaluates ``x`` too."""
        self.recurrent_state = mx.depends(self.recurrent_state, x)


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this cache (released, from another cache, or ahead of it), or a
    ``trim`` with no checkpoint to go back to."""


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
    recurrent_state [1, H, Dv, Dk])`` for KDA layers (``(None, None)`` while the layer is empty), and for MLA layers
    the ``LatentPage``s of positions [0, offset) (one row; every page ``PAGE_SIZE`` positions but a short last one;
    ``()`` while empty), shared by reference with caches and other snapshots. kv_quant: ``(kv_bits,
    kv_group_size)`` of the MLA layers, None for a float latent cache.
    """

    offset: int
    kda_layers: tuple
    states: tuple
    kv_quant: Optional[tuple] = None

    def holders(self) -> list:
        """What holds this snapshot's memory, each once: its latent pages (which other snapshots and caches may
        hold too: the same objects) and its KDA state arrays; each has ``nbytes``."""
        return [h for state in self.states for h in state if h is not None]

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.holders())


_cache_ids = itertools.count()


class HybridCache(list):
    """Per-layer caches of one model (a ``list``, as mlx-lm expects) with ``checkpoint()`` / ``restore(cp)`` and
    ``trim(n)`` (back to the checkpoint n tokens before the end).

    max_checkpoints: how many checkpoints are kept; taking one more releases the oldest.

    mlx-lm's ``can_trim_prompt_cache`` asks each layer: a KDA layer is not trimmable, so mlx-lm's own trimming
    (``trim_prompt_cache``, its speculative decoding) sees a cache it cannot trim; ``trim`` is this cache's way.
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

    def checkpoint(self, transient: bool = False) -> CacheCheckpoint:
        """Keep every layer's ``checkpoint()`` (the KDA states, evaluated so that it holds no graph) and the offset;
        returns the checkpoint. ``transient``: one its taker releases again at once (a speculative verify pass's:
        ``speculative.verify``), so taking it releases none of the kept ones (until it goes, the cache holds one
        more than ``max_checkpoints``)."""
        offsets = {c.offset for c in self}
        if len(offsets) > 1:
            raise CheckpointError(f"cache layers disagree on the offset ({sorted(offsets)}); cannot checkpoint")
        states = tuple(c.checkpoint() for c in self)
        mx.eval([a for s in states if s for a in s if a is not None])
        cp = CacheCheckpoint(self._id, next(self._serial), self.offset, states)
        self.checkpoints.append(cp)
        if not transient:
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
        for c, state in zip(self, cp.kda_states):
            c.restore(state, cp.offset)
        self.checkpoints = [k for k in self.checkpoints if k.serial <= cp.serial]

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (0 <= n <= offset): ``restore`` the latest kept checkpoint taken at offset − n
        (the MLA latents trimmed, the KDA conv and recurrent states set back); returns ``n``. Needs that checkpoint
        (``checkpoint()`` at that position, still kept): without one, raises ``CheckpointError`` naming the offsets
        of the checkpoints there are. ``n`` = 0 changes nothing."""
        if not 0 <= n <= self.offset:
            raise ValueError(f"cannot trim {n} tokens from a cache of {self.offset}")
        if n == 0:
            return 0
        target = self.offset - n
        cp = next((k for k in reversed(self.checkpoints) if k.offset == target), None)
        if cp is None:
            raise CheckpointError(f"no checkpoint at offset {target} to trim {n} of {self.offset} tokens (checkpoints "
                                  f"at offsets {[k.offset for k in self.checkpoints]})")
        self.restore(cp)
        return n

    def mark(self, offsets) -> None:
        """Snapshot points inside the next forward call: each KDA layer keeps its state at these offsets (each after
        the current offset) as the call passes them, so that ``snapshot(row, at=offset)`` gives the cache as it was
        there, after the call, and one call does what a call per snapshot point did (same scan, chunks restarting at
        each mark). Marks and kept states last until the next ``mark``, ``restore`` or ``filter``."""
        offsets = tuple(sorted(int(p) for p in offsets))
        if offsets and offsets[0] <= self.offset:
            raise ValueError(f"mark offsets must be after the cache's offset {self.offset}, got {list(offsets)}")
        for c in self:
            c.mark(offsets)

    def snapshot(self, row: int = 0, at: Optional[int] = None) -> CacheSnapshot:
        """Row ``row`` of this (possibly left-padded) batch cache as a ``CacheSnapshot``, its padding dropped: after
        ``at`` tokens (None: all of them; else an offset the last forward call passed and ``mark`` named).

        The snapshot shares the full latent pages it can (see the module doc) and copies the rest (a partial last
        page, a batch row's positions), evaluated; later writes to the cache never reach it.
        """
        offset = _common_offset(self, "snapshot")
        at = offset if at is None else at
        if not 0 <= at <= offset:
            raise ValueError(f"cannot snapshot at offset {at} of a cache of {offset} tokens")
        rows = _rows(self)
        if not 0 <= row < rows:
            raise IndexError(f"row {row} out of range for a cache of {rows} rows")
        pad = int(self[0].left_padding[row].item()) if self[0].left_padding is not None else 0
        pad = min(pad, at)
        states = tuple(c.snapshot(row, pad, at) for c in self)
        snap = CacheSnapshot(at - pad, tuple(c.is_kda for c in self), states, _kv_quant(self))
        mx.eval([a for h in snap.holders() for a in (h.arrays if isinstance(h, LatentPage) else [h])])
        return snap

    def filter(self, rows: list[int]) -> None:
        """Keep ``rows`` of the batch (in that order), in place; drop the left padding all kept rows share.

        The latent pages are copied for the kept rows (all rows in order with nothing to drop: shared); keeping
        one row shares the pages it had before a merge (``origins``). The checkpoints are dropped (they hold every
        row's states).
        """
        n = _rows(self)
        if not rows or any(not 0 <= r < n for r in rows):
            raise IndexError(f"rows {rows} must be a non-empty list of rows of a cache of {n} rows")
        offset = _common_offset(self, "filter")
        pad = self[0].left_padding
        kept = [int(p) for p in pad[mx.array(rows)].tolist()] if pad is not None else [0] * len(rows)
        drop = min(min(kept), offset)
        left_padding = _padding([p - drop for p in kept])
        for c in self:
            c.filter(rows, drop, left_padding)
        mx.eval([c.state for c in self])
        self.checkpoints = []

    def reset(self) -> None:
        """Empty every layer and drop all checkpoints."""
        for i, c in enumerate(self):
            self[i] = c.empty_like(c.left_padding)
        self.checkpoints = []

    @property
    def kv_quant(self) -> Optional[tuple[int, int]]:
        """``(kv_bits, kv_group_size)`` of the MLA layers' latent cache, None when it is float."""
        return _kv_quant(self)

    @property
    def nbytes(self) -> int:
        """Bytes held by the layer caches and the checkpoints."""
        return sum(c.nbytes for c in self) + sum(cp.nbytes for cp in self.checkpoints)


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
    return HybridCache([_new_layer(is_kda, quant, pad) for is_kda in kda_layers], max_checkpoints)


def cache_from_snapshot(snap: CacheSnapshot, max_checkpoints: int = 8) -> HybridCache:
    """A fresh one-sequence cache holding exactly ``snap`` (the layout of ``model.make_cache()``); its latent pages
    are the snapshot's (shared: the cache's writes make new pages)."""
    layers = []
    for is_kda, state in zip(snap.kda_layers, snap.states):
        c = _new_layer(is_kda, snap.kv_quant, None)
        c.load_snapshot(state, snap.offset)
        layers.append(c)
    return HybridCache(layers, max_checkpoints)


def merge_caches(caches: list[HybridCache], keep_row_pages: bool = False) -> HybridCache:
    """Stack the rows of ``caches`` (in order; each may hold B >= 1 left-padded rows) into one left-padded batch.

    The result is at the largest offset; a shorter cache's rows get that many more pad positions in front (zero
    MLA latents, hidden by the mask). An empty KDA state (a cache at offset 0) becomes zeros, which is what a KDA
    layer starts from. One cache: its pages are shared. Several: every row's latent is copied into batch pages
    (evaluated here, so the inputs' buffers are free once their caches are dropped). ``keep_row_pages``: the batch
    also keeps each one-row input's full pages (``MLALatentCache.origins``), so a later snapshot or one-row filter
    of that row shares them instead of copying (they stay alive while the row is in the batch).
    """
    if not caches:
        raise ValueError("merge_caches needs at least one cache")
    kinds = [tuple(c.is_kda for c in cache) for cache in caches]
    if len(set(kinds)) > 1:
        raise ValueError("cannot merge caches of different layer layouts")
    quants = {_kv_quant(cache) for cache in caches}
    if len(quants) > 1:
        raise ValueError(f"cannot merge caches of different latent-cache quantizations ({_quant_names(quants)})")
    offsets = [_common_offset(cache, "merge") for cache in caches]
    offset = max(offsets)
    sizes = [_rows(cache) for cache in caches]
    pads = []
    for cache, o, n in zip(caches, offsets, sizes):
        own = cache[0].left_padding.tolist() if cache and cache[0].left_padding is not None else [0] * n
        pads += [p + offset - o for p in own]
    left_padding = _padding(pads)
    layers = []
    for parts in zip(*caches):
        c = parts[0].empty_like(left_padding)
        c.merge(list(parts), sizes, keep_row_pages)
        layers.append(c)
    merged = HybridCache(layers, caches[0].max_checkpoints)
    mx.eval([c.state for c in merged])
    return merged


def _batch_pages(parts: list[MLALatentCache], offsets: list[int], sizes: list[int]) -> list[LatentPage]:
    """The pages of the merge of ``parts`` (offsets and row counts given) at the largest offset: page k stacks, for
    each part, its positions that land on [k P, (k + 1) P) (zeros where they fall in its front padding)."""
    like = next(p.pages[0] for p in parts if p.pages)
    P, offset = parts[0].page_size, max(offsets)
    pages = []
    for s in range(0, offset, P):
        e = min(s + P, offset)
        stacked = []
        for p, o, n in zip(parts, offsets, sizes):
            lo, hi = s - (offset - o), e - (offset - o)  # this part's own positions
            pieces = [_blank(like, n, min(hi, 0) - lo)] if lo < 0 else []
            if hi > 0:
                pieces.append(_columns(p, max(lo, 0), hi, None))
            stacked.append(tuple(latent.concatenate([q[j] for q in pieces], axis=2) for j in range(2)))
        pages.append(LatentPage(*(latent.concatenate([q[j] for q in stacked], axis=0) for j in range(2))))
    return pages


def _origins(cache: MLALatentCache, rows: int) -> list[tuple[LatentPage, ...]]:
    """Per row of ``cache``, the full pages a merge can keep for it (``MLALatentCache.origins``)."""
    if cache.origins is not None:
        return list(cache.origins)
    if rows == 1 and cache.left_padding is None:
        return [tuple(cache.pages[: cache.offset // cache.page_size])]
    return [()] * rows


def _kv_quant(cache: HybridCache) -> Optional[tuple[int, int]]:
    return next((c.quant for c in cache if c.quant is not None), None)


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


def _stack(arrays: list[Optional[mx.array]], sizes: list[int]) -> Optional[mx.array]:
    """Concatenate along the batch axis; a None part (an empty cache of ``sizes[i]`` rows) becomes zeros shaped
    like the others."""
    like = next((a for a in arrays if a is not None), None)
    if like is None:
        return None
    return mx.concatenate(
        [a if a is not None else mx.zeros((n, *like.shape[1:]), like.dtype) for a, n in zip(arrays, sizes)]
    )
