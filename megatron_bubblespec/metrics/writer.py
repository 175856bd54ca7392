"""Metrics writer: step records -> run_dir/metrics.jsonl (one JSON line per step) + TensorBoard.

The JSONL file is the source of truth: numbers only, one flushed line per step, NaN, infinities and
None written as JSON null (``to_json``, used for every JSON file the project writes) and read back
as NaN. TensorBoard scalars (run_dir/tensorboard) are a view
of the same records, written when torch's SummaryWriter can be imported.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Mapping

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def json_safe(value):
    """``value`` with NaN / infinities as None and tensors / numpy scalars as Python numbers,
    recursively through mappings, lists and tuples (what strict JSON can hold)."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # 0-d torch / numpy
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_json(value, **dumps_options) -> str:
    """Strict JSON text of ``value`` (``json_safe`` first): the one way this project writes
    numbers that may be NaN or infinite (they become null, read back as NaN by ``read_metrics``)."""
    return json.dumps(json_safe(value), allow_nan=False, **dumps_options)


def _number(key: str, value) -> int | float | None:
    """A metric's JSON value: int or finite float, None for missing / NaN / inf."""
    value = json_safe(value)
    if isinstance(value, bool):
        return int(value)
    if value is None or isinstance(value, (int, float)):
        return value
    raise TypeError(f"metric {key!r} is {type(value).__name__} {value!r}; metrics must be numbers")


def metrics_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def record_line(record: Mapping[str, object]) -> str:
    """One line of metrics.jsonl: the step record, every value a number or null."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"a step record needs an integer 'step', got {step!r}")
    return to_json({key: _number(key, value) for key, value in record.items()}) + "\n"


def write_metrics(run_dir: str | Path, records) -> Path:
    """Rewrite ``run_dir/metrics.jsonl`` with ``records`` (a finished replay; a resumed run cut
    back to its checkpoint)."""
    path = metrics_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(record_line(r) for r in records), encoding="utf-8")
    return path


class MetricsWriter:
    """Appends step records to ``run_dir/metrics.jsonl`` and, optionally, to TensorBoard."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = metrics_file(self.run_dir)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                warnings.warn(f"TensorBoard logging is off ({err}); install the `tensorboard` "
                              f"package or pass tensorboard=False", stacklevel=2)
            else:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))

    def write(self, record: Mapping[str, object]) -> None:
        """Write one step record; it must hold an integer "step"."""
        self._file.write(record_line(record))
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and (value := _number(key, value)) is not None:
                    self._tb.add_scalar(key, value, global_step=record["step"])
            self._tb.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The step records of ``run_dir/metrics.jsonl`` in file order; null values come back as NaN."""
    path = metrics_file(run_dir)
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}; is it the run directory of a run "
                                f"that logged metrics?")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({err})") from err
            records.append({k: math.nan if v is None else v for k, v in raw.items()})
    return records
