"""check-pins reads its usual command lines without click (rlflow/pins/check.py): every line it
reads must mean what click's own parse of the same line means, and every line it declines goes
to click (help, usage errors). Differential against the Click command itself."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from rlflow.pins.check import Options, parse_argv
from rlflow.pins.command import check_pins

READ = [
    [],
    ["--strict"],
    ["--fix"],
    ["--example"],
    ["--example", "--fix", "--strict"],
    ["--format", "json"],
    ["--format=json"],
    ["--format", "text", "--format", "json"],
    ["--repo", "."],
    ["--repo=sub dir"],
    ["--repo", "missing/dir", "--strict", "--format", "json"],
    ["--repo", "a", "--repo", "b"],
    ["--strict", "--strict"],
]
DECLINED = [
    ["--help"],
    ["-h"],
    ["--format", "yaml"],
    ["--format"],
    ["--repo"],
    ["--repo", "--strict"],
    ["--repo="],
    ["--example", "--repo", "."],
    ["--bogus"],
    ["extra"],
    ["--", "--strict"],
    ["--stric"],
    ["--repo", "pyproject.toml"],  # a file: click's "Directory ... is a file."
]


def click_reads(argv: list[str]) -> tuple[Path, bool, Options]:
    ctx = check_pins.make_context("check-pins", list(argv))
    p = ctx.params
    return p["repo"], p["example"], Options(strict=p["strict"], fmt=p["fmt"], fix=p["fix"])


@pytest.mark.parametrize("argv", READ, ids=" ".join)
def test_a_line_it_reads_means_what_click_reads(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_argv(argv) == click_reads(argv)


@pytest.mark.parametrize("argv", DECLINED, ids=" ".join)
def test_anything_else_goes_to_click(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    assert parse_argv(argv) is None


def test_click_refuses_or_answers_every_declined_line(tmp_path, monkeypatch):
    """The declined lines are help or usage errors for click too (or, `--repo=`, its own
    reading), so declining them loses nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    for argv in DECLINED:
        try:
            ctx = check_pins.make_context("check-pins", list(argv))
        except (click.exceptions.Exit, click.UsageError, click.BadParameter):
            continue
        assert argv in (["--repo="], ["--repo", "--strict"], ["--example", "--repo", "."]), argv
        ctx.close()
