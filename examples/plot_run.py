"""Read a run directory's metrics and plot them, optionally against a plain (BubbleSpec off) run.

    python examples/plot_run.py runs/tiny [runs/tiny-plain] [--out plot.png]
"""

import argparse
from pathlib import Path

from megatron_bubblespec.metrics import plot_run, print_summary, read_metrics

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("baseline_dir", type=Path, nargs="?")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    records = read_metrics(args.run_dir)
    baseline = read_metrics(args.baseline_dir) if args.baseline_dir else None
    print_summary(records)
    out = args.out or args.run_dir / "plot.png"
    plot_run(records, out, baseline=baseline)
    print(f"wrote {out}")
