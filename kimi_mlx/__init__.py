"""kimi-mlx: Kimi Linear (and Kimi-K3) on Apple's MLX.

``load`` / ``generate`` / ``stream_generate`` / ``batch_generate`` are shaped like mlx-lm's; ``SamplingParams`` holds
the sampling options they (and ``ChatSession``, the server and the CLI) take. Each is imported on
first use (``kimi_mlx.load`` imports ``kimi_mlx.loading``), so ``import kimi_mlx``, the CLI's start-up and
``kimi_mlx.<submodule>`` imports do not pay for mlx-lm, which imports transformers.
"""

import importlib
import sys
import types

__all__ = ["load", "load_draft", "generate", "stream_generate", "batch_generate", "SamplingParams"]

_HOMES = {"load": "loading", "load_draft": "loading", "generate": "generate", "stream_generate": "generate", "batch_generate": "generate",
          "SamplingParams": "sampling"}


class _Package(types.ModuleType):
    """The ``kimi_mlx`` module object: its public functions are looked up in their modules on first use.

    ``generate`` names the function even though the submodule ``kimi_mlx.generate`` has the same name (importing a
    submodule sets the package attribute of its name; that assignment is not kept for these names).
    """

    def __getattr__(self, name: str):
        if name not in _HOMES:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
