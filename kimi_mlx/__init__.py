"""kimi-mlx: Kimi Linear (and Kimi-K3) on Apple's MLX.

``load`` / ``generate`` / ``stream_generate`` are shaped like mlx-lm's.
"""

from .generate import batch_generate, generate, stream_generate
from .loading import load

__all__ = ["load", "generate", "stream_generate", "batch_generate"]
