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

    def valid_mask(self, n: int) -> Optional[mx.array]:
        """[B, n] bool: True where the next n positions are real tokens (None when nothing is padded)."""
        if self.left_padding is None:
            return None
        pos = self.offset + mx.arange(n)
        return pos[None, :] >= self.left_padding[:, None]

    def empty(self) -> bool:
        return self.offset == 0


class MLALatentCache(_LayerCache):
    """Latent KV of one MLA layer; grows in steps of ``step`` positions."""

    step = 256

    def __init__(self, left_padding: Optional[mx.array] = None):
        super().__init__(left_padding)
        self.kv_latent: Optional[mx.array] = None
        self.k_pe: Optional[mx.array] = None

    def update_and_fetch(self, kv_latent: mx.array, k_pe: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``[B, 1, T, r]`` / ``[B, 1, T, dr]`` and return the filled ``[B, 1, offset+T, ·]`` views."""
        prev, n = self.offset, kv_latent.shape[2]
        if self.kv_latent is None or prev + n > self.kv_latent.shape[2]:
            grow = ((n + self.step - 1) // self.step) * self.step

            def extend(old: Optional[mx.array], new: mx.array) -> mx.array:
                zeros = mx.zeros((*new.shape[:2], grow, new.shape[3]), new.dtype)
                if old is None:
                    return zeros
                return mx.concatenate([old[:, :, :prev], zeros], axis=2)

            self.kv_latent = extend(self.kv_latent, kv_latent)
            self.k_pe = extend(self.k_pe, k_pe)
        self.offset += n
        self.kv_latent[:, :, prev : self.offset] = kv_latent
        self.k_pe[:, :, prev : self.offset] = k_pe
        return self.kv_latent[:, :, : self.offset], self.k_pe[:, :, : self.offset]

    @property
    def state(self) -> list[mx.array]:
        if self.kv_latent is None:
            return []
        return [self.kv_latent[:, :, : self.offset], self.k_pe[:, :, : self.offset]]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.kv_latent, self.k_pe = arrays
        self.offset = self.kv_latent.shape[2]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


class KDACache(_LayerCache):
    """Short-conv state and recurrent state of one KDA layer (cannot be trimmed: it is a running summary)."""

    def __init__(self, left_padding: Optional[mx.array] = None):
        super().__init__(left_padding)
        self.conv_state: Optional[mx.array] = None
        self.recurrent_state: Optional[mx.array] = None

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

    def reset(self) -> None:
        """Empty every layer and drop all checkpoints."""
        for i, c in enumerate(self):
            self[i] = type(c)(c.left_padding)
        self.checkpoints = []

    @property
    def nbytes(self) -> int:
        """Bytes held by the layer caches and the checkpoints."""
        return sum(c.nbytes for c in self) + sum(cp.nbytes for cp in self.checkpoints)


def make_cache(
    kda_layers: list[bool], left_padding: Optional[list[int]] = None, max_checkpoints: int = 8
) -> HybridCache:
    """One cache per layer: ``KDACache`` where ``kda_layers[i]`` is true, else ``MLALatentCache``.

    ``left_padding``: per-sequence number of pad tokens at the start of a ragged, left-padded batch.
    ``max_checkpoints``: see ``HybridCache``.
    """
    pad = None
    if left_padding is not None and any(p > 0 for p in left_padding):
        pad = mx.array(left_padding, dtype=mx.int32)
    layers = [KDACache(pad) if is_kda else MLALatentCache(pad) for is_kda in kda_layers]
    return HybridCache(layers, max_checkpoints)
