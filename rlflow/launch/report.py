"""`rlflow report`: PNG plots of a run's metrics.jsonl (reward, accuracy, KL, step times).

Login-node safe: matplotlib is imported inside the callback, and only when it plots."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import click

from rlflow.errors import Diagnostic, RlflowError
from rlflow.job.files import short
from rlflow.train.metrics import METRICS_FILE, read_metrics

PLOTS = {
    "reward": ["train/reward", "val/reward"],
    "accuracy": ["train/accuracy", "val/accuracy"],
    "kl": ["train/kl"],
    "step_time": ["time/generation", "time/logprobs", "time/training", "time/reward", "time/step"],
}


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """One PNG per plot of PLOTS in `out_dir` (default RUN_DIR/plots). Every value is checked
    before the folder is made, and every plot drawn before the first file is written: a bad
    metrics file leaves no plot behind, and each PNG is written whole or not at all."""
    run = Path(run_dir)
    series = _series(run, _records(run))
    out = Path(out_dir) if out_dir else run / "plots"
    with _writing(out):
        out.mkdir(parents=True, exist_ok=True)  # a folder that cannot be made: before drawing
    pngs = {name: _plot(f"{run.name}: {name}", lines) for name, lines in series.items()}
    written = []
    for name, png in pngs.items():
        path, tmp = out / f"{name}.png", out / f".{name}.png.tmp"
        with _writing(out, tmp):
            tmp.write_bytes(png)
            tmp.replace(path)
        written.append(path)
    return written


@contextmanager
def _writing(out: Path, tmp: Path | None = None):
    """An OSError while writing to `out` -> report.out (and no torn `tmp` left)."""
    try:
        yield
    except OSError as err:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise RlflowError(
            Diagnostic(
                "report.out",
                f"cannot write the plots to {out}: {err.strerror or err}",
                file=str(err.filename or out),
                help="pass --out a folder you can write to (with free space)",
            )
        ) from None


def _records(run: Path) -> list[dict]:
    """metrics.jsonl's records: a regular file, bounded (rlflow/bounded.py), else an error."""
    path = run / METRICS_FILE
    try:
        return read_metrics(run)
    except FileNotFoundError:
        code, problem = "report.no-metrics", f"`{run}` has no {METRICS_FILE}"
        help = f"pass the run directory of an `rlflow train` run (it writes {METRICS_FILE})"
    except OSError as err:
        code, problem = "report.unreadable", f"cannot read {path}: {err.strerror or err}"
        help = "the trainer appends one line per step to this file: move what is there aside"
    raise RlflowError(Diagnostic(code, problem, file=str(path), help=help))


def _series(run: Path, records: list[dict]) -> dict[str, list[tuple[str, list, list]]]:
    """Per plot, its lines (key, steps, values); a value that is not a number is an error
    naming its step and key. NaN and infinity are gaps (a diverged step), not points."""
    path = run / METRICS_FILE
    series, points = {}, 0
    for name, keys in PLOTS.items():
        lines = []
        for key in keys:
            steps, values = [], []
            for record in records:
                if key not in record:
                    continue
                value = _number(record[key])
                if value is None:
                    raise RlflowError(
                        Diagnostic(
                            "report.not-a-number",
                            f"{path}: step {record['step']}: `{key}` is "
                            f"{short(record[key])}, not a number",
                            file=str(path),
                            help="the trainer writes numbers there; fix or delete that line",
                        )
                    )
                steps.append(record["step"])
                values.append(value)
                points += math.isfinite(value)
            if steps:
                lines.append((key, steps, values))
        series[name] = lines
    if not points:
        wanted = ", ".join(k for keys in PLOTS.values() for k in keys)
        raise RlflowError(
            Diagnostic(
                "report.no-metrics",
                f"{path} holds no step with a number to plot ({len(records)} record"
                f"{'s' * (len(records) != 1)})",
                file=str(path),
                help=f"`rlflow report` plots {wanted}; a run writes them after its first step",
            )
        )
    return series


def _number(value) -> float | None:
    """A metric as a float (NaN, a gap, for one no chart can show: non-finite, or beyond
    1e300); None for what is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float: as off the chart as infinity
        return math.nan
    return value if math.isfinite(value) and abs(value) < 1e300 else math.nan


def _plot(title: str, lines: list[tuple[str, list, list]]) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, steps, values in lines:
        ax.plot(
            steps,
            values,
            marker="o" if key.startswith("val/") else None,
            markersize=3,
            label=key,
        )
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def compare_runs(
    run_dirs: list[str | Path], labels: list[str], key: str, out: str | Path, title: str
) -> Path:
    """One plot of `key` against step for several runs (e.g. two generation backends)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    # Distinct line styles: identical curves (the point of a parity plot) must stay visible.
    styles = [("-", "o", 6), ("--", "s", 4), (":", "^", 4)]
    for index, (run_dir, label) in enumerate(zip(run_dirs, labels, strict=True)):
        points = [(r["step"], r[key]) for r in read_metrics(Path(run_dir)) if key in r]
        if points:
            steps, values = zip(*points)
            line, marker, size = styles[index % len(styles)]
            ax.plot(steps, values, linestyle=line, marker=marker, markersize=size, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder for the PNG files (default: RUN_DIR/plots).",
)
def report(run_dir, out):
    """Plot a run's metrics (reward, accuracy, KL, step time) to PNG files.

    RUN_DIR is a run directory holding metrics.jsonl.
    """
    for path in write_report(run_dir, out):
        click.echo(path)
