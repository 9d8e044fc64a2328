"""``kimi-mlx`` console entry point: one sub-command per module in this package."""

from __future__ import annotations

import argparse
import sys

from . import bench, chat, convert, fuse, generate, lora, plan, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kimi-mlx", description="Kimi Linear / Kimi-K3 on MLX")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(commands)
    chat.add_parser(commands)
    convert.add_parser(commands)
    lora.add_parser(commands)
    fuse.add_parser(commands)
    bench.add_parser(commands)
    plan.add_parser(commands)
    serve.add_parser(commands)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
