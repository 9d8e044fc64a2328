"""Generation caches for the hybrid model: one entry per decoder layer.

- ``MLALatentCache`` (MLA layers): the compressed latent ``kv_latent: [B, 1, S, kv_lora_rank]`` and the shared
  un-rotated key part ``k_pe: [B, 1, S, qk_rope_head_dim]`` (NoPE: nothing else is needed for any position).
- ``KDACache`` (KDA layers): ``conv_state: [B, K-1, 3*H*D]`` (last K-1 pre-conv q|k|v projections, activation dtype)
  and ``recurrent_state: [B, H, Dv, Dk]`` float32.

Both carry ``offset`` (tokens seen) and an optional ``left_padding: [B]`` (ragged batches are left-padded; padded
positions are masked out everywhere). They follow the parts of mlx-lm's cache protocol that ``mlx_lm.generate`` uses
(``state``, ``is_trimmable``, ``trim``, ``nbytes``), so our model also runs under mlx-lm's generator.
"""

from __future__ import annotations

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


def make_cache(kda_layers: list[bool], left_padding: Optional[list[int]] = None) -> list[_LayerCache]:
    """One cache per layer: ``KDACache`` where ``kda_layers[i]`` is true, else ``MLALatentCache``.

    ``left_padding``: per-sequence number of pad tokens at the start of a ragged, left-padded batch.
    """
    pad = None
    if left_padding is not None and any(p > 0 for p in left_padding):
        pad = mx.array(left_padding, dtype=mx.int32)
    return [KDACache(pad) if is_kda else MLALatentCache(pad) for is_kda in kda_layers]
