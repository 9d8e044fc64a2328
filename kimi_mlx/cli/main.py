"""``kimi-mlx`` console entry point: one sub-command per module of this package, imported only when it runs.

``kimi-mlx --help`` imports no sub-command; ``kimi-mlx NAME ...`` imports ``kimi_mlx.cli.NAME``, whose
``add_parser(commands)`` adds the sub-command's arguments and sets ``run(args) -> exit status``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> its line in ``kimi-mlx --help`` (the module of the same name describes it in full)
COMMANDS = {
    "generate": "generate text from a prompt",
    "chat": "interactive chat in the terminal",
    "convert": "convert a GGUF / HF checkpoint to an MLX model directory",
    "lora": "fine-tune LoRA/DoRA adapters (QLoRA on a quantized base)",
    "fuse": "merge adapters into the base model and save it",
    "bench": "measure prompt and generation tokens/s and peak memory",
    "plan": "split a model over Macs: memory per rank, fit, predicted tokens/s",
    "serve": "OpenAI- and Anthropic-compatible HTTP server",
}


def _command_named(argv: list[str]) -> str | None:
    """The sub-command ``argv`` runs: its first word, None when ``-h`` / ``--help`` comes first (then the list of
    sub-commands is printed, and none is imported)."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return None
        if not arg.startswith("-"):
            return arg
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="kimi-mlx", description="Kimi Linear / Kimi-K3 on MLX")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, line in COMMANDS.items():
        if name == _command_named(argv):
            importlib.import_module(f"{__package__}.{name}").add_parser(commands)
        else:
            commands.add_parser(name, help=line)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
