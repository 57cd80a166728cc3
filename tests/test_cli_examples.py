"""Every subcommand's --help, and every example in a help text, the README or the manual
(docs/*.md), run through the console script.

Examples are found by a small parser, so a new one is covered without touching this file:
help texts' `Examples:` sections, and the shell lines of README.md and docs/*.md (```bash
blocks, `$ ` lines of ```console blocks, inline `uv run rlflow ...`; a console block that shows
an `error[...]` line must print it and exit 2). Each runs the way it can run here, decided by
its subcommand (RUN_AS), and never skipped:
  real      as written (check-pins, check-tests, report, init-tiny-model's tiny preset)
  dry-run   train needs minutes on CPU or a GPU: `submit --dry-run` of the same recipe and
            overrides on 1 node x --nproc; submit gets --dry-run; setup-env gets --check
  parse     the command line is parsed and validated by the command itself (click's
            make_context), without running it: status/logs/cancel need a job on a Slurm
            cluster (tests/launch/test_launch_slurm.py runs them there), bump needs the
            Megatron-Bridge submodule (tests/pins/test_pins_bump.py), init-tiny-model's
            3B preset needs a GPU, serve runs until stopped (tests/serve starts it)
A usage synopsis (`rlflow train RECIPE [OVERRIDES...]`: ALL-CAPS placeholders or [options])
runs as `rlflow <command> --help`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, replace
from itertools import takewhile
from pathlib import Path

import click
import pytest

from rlflow.cli import COMMANDS, cli

ROOT = Path(__file__).resolve().parents[1]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")
# The documents whose examples run: the README and every page of the manual.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The README's reference run (benchmarks/results): what `rlflow report runs/tiny-clevr-cpu` plots.
METRICS = ROOT / "benchmarks" / "results" / "tiny_recipe_cpu.jsonl"
RUN_AS = {
    "check-pins": "real",
    "check-tests": "real",
    "report": "real",
    "init-tiny-model": "real",
    "submit": "dry-run",
    "train": "dry-run",
    "setup-env": "dry-run",
    "status": "parse",
    "logs": "parse",
    "cancel": "parse",
    "bump": "parse",
    "serve": "parse",  # a server runs until stopped: tests/serve starts it for real
}
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{2,}\b|\[")


@dataclass(frozen=True)
class Example:
    source: str  # where it is shown: "README.md:12", "docs/train.md:5" or "rlflow train --help"
    cwd: str  # relative to the repository ("tests/user_task" for `cd tests/user_task && ...`)
    argv: tuple[str, ...]  # after `rlflow`
    shows_error: str | None = None  # a document's console block's first `error[...]` output line

    def __str__(self) -> str:
        return f"{self.source}: rlflow {shlex.join(self.argv)}"


def parse_line(text: str, source: str) -> Example | None:
    """`[pip install uv &&] [cd DIR &&] [uv run | path/]rlflow ARGS [# comment]` -> Example."""
    text = re.sub(r"^\$ ", "", text.strip())
    cwd = "."
    for part in [p.strip() for p in text.split("&&")][:-1]:
        if part.startswith("cd "):
            cwd = part[3:].strip()
    words = shlex.split(text.split("&&")[-1], comments=True)
    while words and words[0] in ("uv", "run"):
        words = words[1:]
    if not words or Path(words[0]).name != "rlflow":
        return None
    words = words[1:]
    gloss = next((i for i, w in enumerate(words) if w.startswith("(")), len(words))
    words = words[:gloss]  # "rlflow cancel 1234_3   (element 3 of a sweep)"
    return Example(source, cwd, tuple(words))


def help_examples() -> list[Example]:
    found = []
    for name in sorted(COMMANDS):
        command = cli.get_command(click.Context(cli), name)
        text = command.epilog or ""
        lines = text.split("Examples:", 1)[1].splitlines()[1:] if "Examples:" in text else []
        for line in lines:
            if not line.strip():
                break
            example = parse_line(line, f"rlflow {name} --help")
            assert example is not None, f"`rlflow {name} --help` shows a non-example: {line!r}"
            found.append(example)
    return found


def document_examples(path: Path) -> list[Example]:
    """The shell examples of one Markdown document (the README or a docs/ page)."""
    text = path.read_text()
    name = path.relative_to(ROOT).as_posix()
    found = []
    for block in re.finditer(r"^```(bash|console)\n(.*?)^```", text, re.S | re.M):
        first = text[: block.start(2)].count("\n") + 1
        lines = block.group(2).splitlines()
        for n, line in enumerate(lines):
            if block.group(1) == "console" and not line.startswith("$ "):
                continue  # output
            example = parse_line(line, f"{name}:{first + n}")
            if example is not None:
                output = takewhile(lambda x: not x.startswith("$ "), lines[n + 1 :])
                error = next((x for x in output if x.startswith("error[")), None)
                found.append(replace(example, shows_error=error))
    for inline in re.finditer(r"`(uv run rlflow [^`]+)`", text):
        found.append(
            parse_line(inline.group(1), f"{name}:{text[: inline.start()].count(chr(10)) + 1}")
        )
    return found


def unique(examples: list[Example]) -> list[Example]:
    """Each command line once (the documents repeat some), named by where it is first shown."""
    seen: dict[tuple, Example] = {}
    for example in examples:
        seen.setdefault((example.cwd, example.argv, example.shows_error), example)
    return list(seen.values())


EXAMPLES = unique(help_examples() + [e for doc in DOCUMENTS for e in document_examples(doc)])


def builds_a_model(example: Example) -> bool:
    """init-tiny-model run for real imports torch and transformers (~10 s): slow, like the
    model tests (its 3B preset on a GPU and its synopsis are only parsed)."""
    argv = example.argv
    return (
        argv[0] == "init-tiny-model"
        and "--device" not in argv
        and not PLACEHOLDER.search(" ".join(argv))
    )


def test_the_parser_finds_the_examples():
    sources = {e.source.split(":")[0] for e in EXAMPLES}
    assert {"README.md", "rlflow train --help", "rlflow submit --help"} <= sources
    assert {"docs/train.md", "docs/launch.md", "docs/lockstep.md"} <= sources
    assert len(EXAMPLES) >= 40
    assert {e.argv[0] for e in EXAMPLES} >= {"train", "submit", "check-pins", "status", "report"}


# The examples run as on a login node with no Slurm config: once a test has started the session's
# cluster (SLURM_CONF exported), a dry run would also check the job's shape against its 4-GPU
# nodes, and the 3B recipe's 8-GPU example would depend on the test order.
NO_CLUSTER = {**os.environ, "SLURM_CONF": "/nonexistent"}


def rlflow(*argv: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RLFLOW, *argv], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=NO_CLUSTER
    )


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_help(name, tmp_path):
    result = rlflow(name, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: rlflow {name} ")
    summary = cli.get_command(click.Context(cli), name).get_short_help_str(limit=200)
    assert " ".join(result.stdout.split()).count(summary) == 1  # its one source of help
    top = " ".join(rlflow("--help", cwd=tmp_path).stdout.split())
    assert f"{name} {summary}" in top


def _dry_run_of_train(argv: tuple[str, ...]) -> list[str]:
    """`train RECIPE OVERRIDES [--run-dir D] [--nproc N]` -> the submit dry run of that job."""
    words, nproc, i = [], "1", 1
    while i < len(argv):
        if argv[i] in ("--run-dir", "--nproc"):
            nproc = argv[i + 1] if argv[i] == "--nproc" else nproc
            i += 2
            continue
        words.append(argv[i])
        i += 1
    return ["submit", *words, "--nodes", "1", "--gpus", nproc, "--dry-run"]


@pytest.mark.parametrize(
    "example",
    [pytest.param(e, marks=pytest.mark.slow) if builds_a_model(e) else e for e in EXAMPLES],
    ids=str,
)
def test_every_example_runs(example, tmp_path):
    name, argv = example.argv[0], list(example.argv)
    cwd = ROOT / example.cwd
    if PLACEHOLDER.search(" ".join(argv)):
        result = rlflow(name, "--help", cwd=cwd)  # a usage synopsis
        assert result.returncode == 0, result.stderr
        return
    mode = RUN_AS[name]
    if name == "init-tiny-model" and "--device" in argv:
        mode = "parse"  # the 3B-shaped preset on a GPU
    if mode == "parse":
        command = cli.get_command(click.Context(cli), name)
        with command.make_context(name, argv[1:]) as ctx:  # raises on a bad command line
            assert ctx.params
        return
    expect = (0,)
    if name == "train":
        argv = _dry_run_of_train(tuple(argv))
    elif name == "submit" and "--dry-run" not in argv:
        argv.append("--dry-run")
    elif name == "setup-env" and "--check" not in argv:
        argv.append("--check")
    if name == "setup-env" or argv[:2] == ["check-pins", "--example"] and "--fix" not in argv:
        expect = (0, 1)  # built or not; the bundled incident is a finding
    if name == "init-tiny-model":
        argv[1] = str(tmp_path / Path(argv[1]).name)
    if name == "report":
        run = tmp_path / argv[1]
        run.mkdir(parents=True)
        shutil.copy(METRICS, run / "metrics.jsonl")
        cwd = tmp_path
    result = rlflow(*argv, cwd=cwd)
    if example.shows_error:  # the document shows it failing: it must, with that error
        assert result.returncode == 2 and example.shows_error + "\n" in result.stderr, (
            f"{example}\n{result.stderr}"
        )
        return
    assert result.returncode in expect, f"{example}\n{result.stdout[-2000:]}{result.stderr}"
    assert "Traceback" not in result.stderr
