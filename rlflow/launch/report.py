"""`rlflow report`: PNG plots of a run's metrics.jsonl (reward, accuracy, KL, step times).

Login-node safe: matplotlib is imported inside the callback, and only when it plots."""

from __future__ import annotations

from pathlib import Path

import click

from rlflow.errors import Diagnostic, RlflowError
from rlflow.train.metrics import METRICS_FILE, read_metrics

PLOTS = {
    "reward": ["train/reward", "val/reward"],
    "accuracy": ["train/accuracy", "val/accuracy"],
    "kl": ["train/kl"],
    "step_time": ["time/generation", "time/logprobs", "time/training", "time/reward", "time/step"],
}


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    if not (run / METRICS_FILE).exists():
        raise RlflowError(
            Diagnostic(
                "report.no-metrics",
                f"`{run}` has no {METRICS_FILE}",
                help="pass the run directory of an `rlflow train` run",
            )
        )
    records = read_metrics(run)
    out = Path(out_dir) if out_dir else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                steps, values = zip(*points)
                ax.plot(
                    steps,
                    values,
                    marker="o" if key.startswith("val/") else None,
                    markersize=3,
                    label=key,
                )
        ax.set_xlabel("step")
        ax.set_title(f"{run.name}: {name}")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        path = out / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


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
