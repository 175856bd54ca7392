"""A run's config -> its directory ``<run.output_dir>/<run.name>/`` and every file the run keeps
there, each with one reader and one writer.

    config.yaml       the resolved config (written at start)      write_config / read_config
    metrics.jsonl     one step record per line                    metrics_writer, write_metrics /
                                                                  read_metrics (metrics.writer)
    rollouts.jsonl    one line of response tokens per step        append_rollouts, write_rollouts /
                                                                  read_rollouts (metrics.rollouts)
    checkpoints/      step_<k>/ (or run.checkpoint_dir)           loop.checkpoint
    final/            the final HF checkpoint                     train.export
    bubblespec.png    the end-of-run plot                         metrics.plots
    heartbeat/        rank<R>.json                                loop.heartbeat
    logs/             rank<R>.log, the libraries' output          logs
    tensorboard/      TensorBoard's view of metrics.jsonl         metrics.writer
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from megatron_bubblespec.config import Config, load_config, to_yaml
from megatron_bubblespec.logs import LOG_DIR
from megatron_bubblespec.metrics import rollouts, writer

CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class RunDir:
    """The files of the run directory ``path`` (``checkpoint_dir``: run.checkpoint_dir, when the
    checkpoints live elsewhere)."""

    path: Path
    checkpoint_dir: Path | None = None

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))

    @classmethod
    def of(cls, cfg: Config) -> "RunDir":
        return cls(Path(cfg.run.output_dir) / cfg.run.name, cfg.run.checkpoint_dir or None)

    # -------------------------------------------------------------------------------- paths

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_file(self) -> Path:
        return writer.metrics_file(self.path)

    @property
    def rollouts_file(self) -> Path:
        return rollouts.rollouts_file(self.path)

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir or self.path / "checkpoints"

    @property
    def final(self) -> Path:
        return self.path / "final"

    @property
    def plot(self) -> Path:
        return self.path / "bubblespec.png"

    @property
    def heartbeat(self) -> Path:
        return self.path / "heartbeat"

    @property
    def logs(self) -> Path:
        return self.path / LOG_DIR

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    # ------------------------------------------------------------------------------- config

    def write_config(self, cfg: Config) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(to_yaml(cfg))

    def has_config(self) -> bool:
        return self.config_file.is_file()

    def read_config(self, overrides: Sequence[str] = ()) -> Config:
        """The run's resolved config (``overrides`` on top); FileNotFoundError when the
        directory holds none."""
        if not self.has_config():
            raise FileNotFoundError(f"{self.path} has no {CONFIG_FILE}: not a run directory; "
                                    "pass the directory a run wrote (run.output_dir/run.name)")
        return load_config(self.config_file, list(overrides))

    # --------------------------------------------------------------------- metrics, rollouts

    def metrics_writer(self, tensorboard: bool) -> writer.MetricsWriter:
        return writer.MetricsWriter(self.path, tensorboard=tensorboard)

    def write_metrics(self, records: Sequence[Mapping[str, object]]) -> None:
        writer.write_metrics(self.path, records)

    def read_metrics(self) -> list[dict]:
        return writer.read_metrics(self.path)

    def append_rollouts(self, step: int, responses: Mapping[int, Sequence[int]]) -> None:
        rollouts.append_rollouts(self.path, step, responses)

    def write_rollouts(self, steps: Sequence[Mapping[int, Sequence[int]]]) -> None:
        rollouts.write_rollouts(self.path, steps)

    def read_rollouts(self, before_step: int | None = None) -> list[dict[int, list[int]]]:
        return rollouts.read_rollouts(self.path, before_step)

    def restart_at(self, step: int) -> tuple[list[dict], list[dict[int, list[int]]]]:
        """The records and rollouts of the steps before ``step``, with both files cut back to
        them: a fresh run (step 0) starts empty files, a resumed run rewrites the steps after
        its checkpoint."""
        self.path.mkdir(parents=True, exist_ok=True)
        if step == 0:
            self.metrics_file.unlink(missing_ok=True)
            self.write_rollouts([])
            return [], []
        has_metrics = self.metrics_file.is_file()
        records = [r for r in self.read_metrics() if r["step"] < step] if has_metrics else []
        kept = self.read_rollouts(before_step=step)
        self.write_metrics(records)
        self.write_rollouts(kept)
        return records, kept
