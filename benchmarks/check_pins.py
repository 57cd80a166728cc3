"""Wall time of `rlflow check-pins` vs `uv lock --check` on one repository with three submodules.

The repository has the NeMo-RL shape: a training repo whose submodules are Megatron-Bridge
(which nests Megatron-LM, as the real one does) and Automodel. Their pyprojects carry realistic
dependency lists (torch, transformers, datasets, ...) and git pins of emerging-optimizers and
fast-hadamard-transform that point at local `file://` repositories with tags. The pins agree,
so `uv lock` succeeds and `uv lock --check` has a lockfile to verify.

Each sample is a fresh process, as a user or a pre-commit hook runs it; commands are
interleaved so a busy machine slows them alike. Reported: median, min and max of

  pins agree, lock up to date (nothing to find):
    rlflow check-pins                 the console script, bytecode cached (a normal install);
                                      includes the lock-level checks (RF010/RF011, uv.lock read)
    rlflow check-pins, no .pyc        every module compiled from source (PYTHONDONTWRITEBYTECODE)
    rlflow check-pins, no uv.lock     the pyproject-level check alone
  stale lock (the root asks for one more package than uv.lock has):
    rlflow check-pins                 exit 1, RF011
    uv lock --check --offline         exit 1
    uv lock --check                   warm uv cache (network allowed) and --offline
  after a Megatron-LM bump (each sample a new bump, the incident):
    rlflow check-pins                 exit 1, RF001 naming both files and the fix
    uv lock --check, then uv lock     warm cache; exit 1, "conflicting URLs"
    uv lock --check                   empty cache (a CI runner; --cold-runs samples)

Submodule metadata is measured both ways: static (uv reads pyproject.toml) and dynamic
(setuptools computes the version, as Megatron-LM and Megatron-Bridge do, so uv must build).
Needs the network for uv (PyPI metadata of torch, transformers, ...).

    uv run python benchmarks/check_pins.py [--runs 15] [--uv-runs 7] [--cold-runs 2] [--bump-runs 7]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlflow.pins.example import add_submodule, git, make_repo  # noqa: E402

BIN = Path(sys.executable).parent
HATCH = '\n[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'


SETUPTOOLS = """
[build-system]
requires = ["setuptools>=77", "pybind11"]
build-backend = "setuptools.build_meta"

[tool.setuptools.dynamic]
version = {{ attr = "{module}.package_info.__version__" }}

[tool.setuptools.packages.find]
include = ["{top}*"]
"""


def leaf(name: str, version: str) -> str:
    return f'[project]\nname = "{name}"\nversion = "{version}"\nrequires-python = ">=3.10"\n{HATCH}'


def metadata(dynamic: bool, version: str, module: str) -> tuple[str, str, dict[str, str]]:
    """(version line, build-system tables, extra files) for a submodule project.

    dynamic=True is how Megatron-LM and Megatron-Bridge really ship: a setuptools build whose
    version is computed, so uv must run the build backend to learn the metadata.
    """
    if not dynamic:
        return f'version = "{version}"', HATCH, {}
    top = module.split(".")[0]
    files = {f"{module.replace('.', '/')}/package_info.py": f'__version__ = "{version}"\n'}
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        files.setdefault("/".join(parts[:i]) + "/__init__.py", "")
    return 'dynamic = ["version"]', SETUPTOOLS.format(module=module, top=top), files


def build(base: Path, dynamic: bool, bump_tags: int) -> Path:
    """The benchmark repository; returns the root (the training repo)."""
    urls = {}
    for name, tags in (
        ("emerging-optimizers", ("0.2.0", "0.3.0")),
        ("fast-hadamard-transform", ("1.0.4",)),
    ):
        repo = None
        for version in tags:
            if repo is None:
                repo = make_repo(base / "upstream" / name, {"pyproject.toml": leaf(name, version)})
            else:
                (repo / "pyproject.toml").write_text(leaf(name, version))
                git(repo, "commit", "-qam", version)
            git(repo, "tag", f"v{version}")
        if name == "emerging-optimizers":  # the tags later Megatron-LM bumps move to
            for i in range(bump_tags):  # each its own commit: uv compares resolved commits
                (repo / "pyproject.toml").write_text(leaf(name, f"0.4.{i}"))
                git(repo, "commit", "-qam", f"0.4.{i}")
                git(repo, "tag", f"v0.4.{i}")
        urls[name] = f"file://{repo}"
    lm_version, lm_build, lm_files = metadata(dynamic, "0.19.2", "megatron.core")
    lm = make_repo(
        base / "upstream" / "Megatron-LM",
        {
            **lm_files,
            "pyproject.toml": f"""\
[project]
name = "megatron-core"
{lm_version}
requires-python = ">=3.10"
dependencies = ["torch>=2.6", "numpy>=1.26", "packaging>=24.2"]

[project.optional-dependencies]
dev = ["emerging_optimizers", "fast-hadamard-transform", "einops~=0.8", "tensorstore",
       "nvtx", "transformers", "setuptools", "opentelemetry-api"]
mlm = ["flask-restful", "sentencepiece", "tiktoken", "wandb", "transformers"]

[dependency-groups]
test = ["pytest", "pytest-mock", "coverage"]

[tool.uv.sources]
emerging_optimizers = {{ git = "{urls["emerging-optimizers"]}", rev = "v0.3.0" }}
fast-hadamard-transform = {{ git = "{urls["fast-hadamard-transform"]}", rev = "v1.0.4" }}
{lm_build}""",
        },
    )
    mb_version, mb_build, mb_files = metadata(dynamic, "0.6.2", "megatron.bridge")
    bridge = make_repo(
        base / "upstream" / "Megatron-Bridge",
        {
            **mb_files,
            "pyproject.toml": f"""\
[project]
name = "megatron-bridge"
{mb_version}
requires-python = ">=3.10"
dependencies = ["megatron-core[dev,mlm]", "transformers>=5.0", "datasets", "accelerate",
                "omegaconf", "hydra-core", "tqdm", "pillow", "qwen-vl-utils", "regex", "rich"]

[tool.uv.sources]
megatron-core = {{ path = "3rdparty/Megatron-LM", editable = true }}
{mb_build}""",
        },
    )
    add_submodule(bridge, lm, "3rdparty/Megatron-LM")
    automodel = make_repo(
        base / "upstream" / "Automodel",
        {
            "pyproject.toml": f"""\
[project]
name = "nemo-automodel"
version = "0.3.0"
requires-python = ">=3.10"
dependencies = ["torch>=2.6", "transformers>=5.0", "datasets", "torchdata", "pyyaml", "wandb"]
{HATCH}"""
        },
    )
    root = make_repo(
        base / "trainer",
        {
            "pyproject.toml": f"""\
[project]
name = "trainer"
version = "0.1.0"
requires-python = ">=3.12"
dependencies = ["torch==2.11.0", "transformers==5.17.0", "numpy>=2.0"]

[project.optional-dependencies]
mcore = ["megatron-bridge"]
automodel = ["nemo-automodel"]

[tool.uv]
# Flow transitively from megatron-core[dev]: keep in sync with Megatron-LM's [tool.uv.sources].
constraint-dependencies = [
    "emerging-optimizers @ git+{urls["emerging-optimizers"]}@v0.3.0",
    "fast-hadamard-transform @ git+{urls["fast-hadamard-transform"]}@v1.0.4",
]

[tool.uv.sources]
megatron-bridge = {{ path = "submodules/Megatron-Bridge", editable = true }}
nemo-automodel = {{ path = "submodules/Automodel", editable = true }}
"""
        },
    )
    add_submodule(root, bridge, "submodules/Megatron-Bridge")
    add_submodule(root, automodel, "submodules/Automodel")
    return root


def run_once(command: list[str], cwd: Path, env: dict, expect: int = 0, says: str = "") -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    output = done.stdout + done.stderr
    assert done.returncode == expect and says in output, (
        f"{command}: exit {done.returncode}\n{output}"
    )
    return elapsed


def bump_megatron_lm(root: Path, tag: str) -> None:
    """What the nightly bump bot does: Megatron-LM moves emerging-optimizers to a new tag and
    only the gitlinks are updated; the root pyproject still says v0.3.0."""
    lm = root / "submodules/Megatron-Bridge/3rdparty/Megatron-LM"
    text = (lm / "pyproject.toml").read_text()
    text = re.sub(r'(emerging_optimizers = .*rev = ")[^"]+', rf"\g<1>{tag}", text)
    (lm / "pyproject.toml").write_text(text)
    git(lm, "commit", "-qam", f"emerging-optimizers {tag}")
    git(root / "submodules/Megatron-Bridge", "commit", "-qam", f"bump Megatron-LM ({tag})")
    git(root, "commit", "-qam", f"bump Megatron-Bridge ({tag})")


def row(name: str, samples: list[float], baseline: float | None) -> str:
    median = statistics.median(samples)
    ratio = f"{median / baseline:.1f}x" if baseline else "1x"
    return (
        f"| {name} | {median:.3f} | {min(samples):.3f} | {max(samples):.3f} | {len(samples)} "
        f"| {ratio} |"
    )


def measure(base: Path, dynamic: bool, args) -> None:
    root = build(base, dynamic, bump_tags=args.bump_runs)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    uv_env = {
        **env,
        "UV_CACHE_DIR": str(base / "uv-cache"),
        "UV_PYTHON": sys.executable,
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_CONFIG": "1",
    }
    uv = [str(BIN / "uv"), "lock", "--check", "-q"]
    first_lock = [run_once(uv[:2] + ["-q"], root, {**uv_env, "UV_CACHE_DIR": str(base / "first")})]
    git(root, "add", "uv.lock")
    git(root, "commit", "-qm", "lock")
    run_once(uv, root, uv_env)  # warms the benchmark's own cache
    check = [str(BIN / "rlflow"), "check-pins"]
    run_once(check, root, env)  # writes the .pyc files a normal install has
    # An empty cache prefix and no writing: every module compiled from source, every time.
    no_pyc = {**env, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(base / "no-pyc")}
    samples: dict[str, list[float]] = {
        k: []
        for k in ("pins", "nopyc", "nolock", "start", "uv", "offline", "bpins", "buv", "block")
    }
    lock, away = root / "uv.lock", base / "uv.lock.away"
    for i in range(args.runs):  # interleaved, so a busy machine slows every command alike
        samples["pins"].append(run_once(check, root, env))
        samples["nopyc"].append(run_once(check, root, no_pyc))
        lock.rename(away)  # the same check without the lock-level part (RF010/RF011)
        try:
            samples["nolock"].append(run_once(check, root, env))
        finally:
            away.rename(lock)
        samples["start"].append(run_once([sys.executable, "-c", "pass"], root, env))
        if i < args.uv_runs:
            samples["uv"].append(run_once(uv, root, uv_env))
            samples["offline"].append(run_once(uv + ["--offline"], root, uv_env))
    stale_samples(root, env, uv, uv_env, samples, args)
    samples["bcold"] = []
    for i in range(args.bump_runs):  # each sample is a new bump: uv cannot reuse its last answer
        bump_megatron_lm(root, f"v0.4.{i}")
        samples["bpins"].append(run_once(check, root, env, 1, "error[RF001]"))
        samples["buv"].append(run_once(uv, root, uv_env, 1, "conflicting URLs"))
        samples["block"].append(run_once(uv[:2], root, uv_env, 1, "conflicting URLs"))
        if i < args.cold_runs:  # a CI runner: empty uv cache
            cold_env = {**uv_env, "UV_CACHE_DIR": str(base / f"cold-{i}")}
            samples["bcold"].append(run_once(uv, root, cold_env, 1, "conflicting URLs"))
    report(root, dynamic, samples, first_lock)


def stale_samples(root: Path, env: dict, uv: list, uv_env: dict, samples: dict, args) -> None:
    """A stale lock: the root asks for one more package than uv.lock records."""
    path = root / "pyproject.toml"
    original = path.read_text()
    path.write_text(original.replace("dependencies = [", 'dependencies = [\n    "einops",', 1))
    check = [str(BIN / "rlflow"), "check-pins"]
    samples["spins"], samples["suv"] = [], []
    try:
        for _ in range(args.bump_runs):
            samples["spins"].append(run_once(check, root, env, 1, "error[RF011]"))
            samples["suv"].append(run_once(uv + ["--offline"], root, uv_env, 1))
    finally:
        path.write_text(original)


def report(
    root: Path, dynamic: bool, samples: dict[str, list[float]], first_lock: list[float]
) -> None:
    base = statistics.median(samples["pins"])
    kind = (
        "dynamic: setuptools computes the version, as Megatron-LM and Megatron-Bridge do"
        if dynamic
        else "static: uv reads pyproject.toml, no build"
    )
    print(f"\n### Submodule metadata {kind}\n")
    print(
        f"3 submodules (Megatron-Bridge nesting Megatron-LM, Automodel), "
        f"{len(list(root.rglob('pyproject.toml')))} pyproject.toml files; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs after the runs\n"
    )
    print("| command | median s | min s | max s | runs | / check-pins |")
    print("|---|---|---|---|---|---|")
    print(row("pins agree, lock up to date: `rlflow check-pins`", samples["pins"], None))
    print(
        row(
            "... `rlflow check-pins`, no bytecode cache (all compiled from source)",
            samples["nopyc"],
            base,
        )
    )
    print(
        row(
            "... `rlflow check-pins` without uv.lock (pyproject level only, no RF010/RF011)",
            samples["nolock"],
            base,
        )
    )
    print(row("... `python -c pass` (interpreter start-up)", samples["start"], base))
    print(row("... `uv lock --check`, warm cache", samples["uv"], base))
    print(row("... `uv lock --check --offline`, warm cache", samples["offline"], base))
    print(row("(the first `uv lock` of this repository, empty cache)", first_lock, base))
    stale = statistics.median(samples["spins"])
    print(
        row(
            "stale lock (root asks for one more package): `rlflow check-pins` (exit 1, RF011)",
            samples["spins"],
            base,
        )
    )
    print(row("... `uv lock --check --offline`, warm cache (exit 1)", samples["suv"], stale))
    bump = statistics.median(samples["bpins"])
    print(
        row(
            "after a Megatron-LM bump (the incident): `rlflow check-pins` (exit 1)",
            samples["bpins"],
            base,
        )
    )
    print(row("... `uv lock --check`, warm cache (exit 1: conflicting URLs)", samples["buv"], bump))
    print(
        row(
            "... `uv lock` right after, same bump (exit 1: conflicting URLs)",
            samples["block"],
            bump,
        )
    )
    print(
        row(
            "... `uv lock --check`, empty cache: a CI runner (exit 1: conflicting URLs)",
            samples["bcold"],
            bump,
        )
    )


def lock_only(root: Path, runs: int = 20) -> None:
    import tomllib

    from rlflow.pins.check import _read_root
    from rlflow.pins.lock.level import lock_findings
    from rlflow.pins.parse import parse_document, read_manifest
    from rlflow.pins.walk import walk

    docs = [parse_document("pyproject.toml", _read_root(root))]
    manifests = [read_manifest(docs[0], "", root, True)]
    text = (root / "uv.lock").read_text()
    times: dict[str, list[float]] = {"lock_findings": [], "tomllib whole lock": [], "walk": []}
    for _ in range(runs):
        for name, call in (
            ("lock_findings", lambda: lock_findings(root, manifests, docs)),
            ("tomllib whole lock", lambda: tomllib.loads(text)),
            ("walk", lambda: walk(root)),
        ):
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    print(f"{len(text)} bytes of uv.lock; load average {os.getloadavg()[0]:.0f}")
    for name, samples in times.items():
        print(
            f"{name}: min {min(samples) * 1e3:.1f} ms, median {statistics.median(samples) * 1e3:.1f} ms"
        )


# What any check-pins run must import (the standard library's TOML parser, git processes,
# paths, packaging's specifiers): with the interpreter's start-up, the floor of a run in Python.
FLOOR = "import pathlib, subprocess, tomllib; from packaging.specifiers import SpecifierSet"


def replayed_interpreter(base: Path, python: str, uv: list, env: dict, cases: dict) -> Path:
    """A stand-in for `python` that answers uv's interpreter query from a file, recorded from
    one real query (uv runs the same query script every time)."""
    answer, record, replay = base / "query.json", base / "record-query", base / "replay-query"
    record.write_text(f'#!/bin/sh\n"{python}" "$@" > "{answer}"\nexec cat "{answer}"\n')
    replay.write_text(f'#!/bin/sh\nexec cat "{answer}"\n')
    for shim in (record, replay):
        shim.chmod(0o755)
    run_once([*uv, str(record)], cases["real locks: `rlflow check-pins`"], env)
    return replay


def real_tree(args) -> None:
    """Issue 24's workload: the real NeMo-RL tree (tests/pins/real_tree.py) without its uv.lock
    files ("case A") and with them, this repository, and 20,000 requirements in one array;
    each a fresh `rlflow check-pins` process, bytecode cached, interleaved with the uv reference.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "pins"))
    import real_tree as tree

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-pins-real-") as tmp:
        base = Path(tmp)
        env["PYTHONPYCACHEPREFIX"] = str(base / "pyc")  # a normal install keeps .pyc files
        check = [str(BIN / "rlflow"), "check-pins"]
        cases = {
            "case A (no uv.lock): `rlflow check-pins`": tree.build(base / "a", locks=False),
            "real locks: `rlflow check-pins`": tree.build(base / "locks"),
            "this repository: `rlflow check-pins`": Path(__file__).resolve().parents[1],
        }
        for n in args.sizes:
            names = "".join(f'  "pkg{i}>=1.{i % 7}",\n' for i in range(n))
            text = f'[project]\nname = "big"\nversion = "1"\ndependencies = [\n{names}]\n'
            cases[f"{n:,} requirements in one array: `rlflow check-pins`"] = make_repo(
                base / f"big{n}", {"pyproject.toml": text}
            )
        commands = {name: (check, root, env) for name, root in cases.items()}
        if args.baseline:  # the same check-pins calls on another checkout's code, interleaved
            base_env = {
                **env,
                "PYTHONPATH": args.baseline,
                "PYTHONPYCACHEPREFIX": str(base / "pyc-baseline"),
            }
            for name, root in list(cases.items()):
                commands[f"{name} [baseline]"] = (check, root, base_env)
        if args.uv_python:
            uv_env = {**env, "UV_PYTHON_DOWNLOADS": "never"}
            if args.uv_cache:
                uv_env["UV_CACHE_DIR"] = args.uv_cache
            uv = [str(BIN / "uv"), "lock", "--check", "--offline", "-q", "--python"]
            commands["real locks: `uv lock --check --offline`, warm cache"] = (
                [*uv, args.uv_python],
                cases["real locks: `rlflow check-pins`"],
                uv_env,
            )
            # uv queries the interpreter on every call here (it caches the answer for a real
            # interpreter, not for a wrapper script): the same call with the query's answer
            # replayed from a file is uv's own cost.
            replay = replayed_interpreter(base, args.uv_python, uv, uv_env, cases)
            commands["real locks: `uv lock --check --offline`, interpreter query replayed"] = (
                [*uv, str(replay)],
                cases["real locks: `rlflow check-pins`"],
                uv_env,
            )
        commands["`git --version` (one git process)"] = (["git", "--version"], base, env)
        commands["`python -c pass` (interpreter start-up)"] = (
            [sys.executable, "-c", "pass"],
            base,
            env,
        )
        commands[f"the floor: `python -c '{FLOOR}'`"] = ([sys.executable, "-c", FLOOR], base, env)
        for command, cwd, run_env in commands.values():  # warm caches; each must pass
            run_once(command, cwd, run_env)
        samples: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, (command, cwd, run_env) in commands.items():
                samples[name].append(run_once(command, cwd, run_env))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs after the runs\n")
    print("| command | median s | min s | max s | runs | / check-pins |")
    print("|---|---|---|---|---|---|")
    base_time = statistics.median(samples["real locks: `rlflow check-pins`"])
    for name, times in samples.items():
        print(row(name, times, base_time))


def big_toml(megabytes: int, runs: int) -> None:
    """Issue 24's "a 50 MB valid TOML": one pyproject of that size (a [tool] table of short
    strings beside a one-requirement [project]); check-pins against tomllib's parse of the same
    file, each a fresh process, interleaved."""
    lines = [
        '[project]\nname = "big"\nversion = "1"\ndependencies = ["requests>=2"]\n\n[tool.other]'
    ]
    size, i = 0, 0
    while size < megabytes * 1_000_000:
        lines.append(f'key{i} = "{"x" * 80}"')
        size += len(lines[-1]) + 1
        i += 1
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-pins-toml-") as tmp:
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pyc")
        root = make_repo(Path(tmp) / "big", {"pyproject.toml": "\n".join(lines) + "\n"})
        parse = "import tomllib; tomllib.load(open('pyproject.toml', 'rb'))"
        commands = {
            f"{megabytes} MB pyproject.toml: `rlflow check-pins`": [
                str(BIN / "rlflow"),
                "check-pins",
            ],
            f'{megabytes} MB pyproject.toml: `python -c "{parse}"`': [sys.executable, "-c", parse],
        }
        samples: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(runs):
            for name, command in commands.items():
                samples[name].append(run_once(command, root, env))
    print("| command | median s | min s | max s | runs | / check-pins |")
    print("|---|---|---|---|---|---|")
    base_time = statistics.median(next(iter(samples.values())))
    for name, times in samples.items():
        print(row(name, times, base_time))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--uv-runs", type=int, default=7)
    parser.add_argument("--cold-runs", type=int, default=2)
    parser.add_argument("--bump-runs", type=int, default=7)
    parser.add_argument("--metadata", choices=["static", "dynamic", "both"], default="both")
    parser.add_argument(
        "--lock-only",
        action="store_true",
        help="only time the lock-level check (RF010/RF011) in-process on this repository's "
        "uv.lock, against a whole-file tomllib parse",
    )
    parser.add_argument(
        "--real-tree",
        action="store_true",
        help="issue 24: the real NeMo-RL tree with and without its locks, this repository and "
        "20,000 requirements (no network); uv only with --uv-python",
    )
    parser.add_argument(
        "--sizes",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[4000, 20000],
        help="requirement counts of the one-array cases (comma-separated; empty: none)",
    )
    parser.add_argument("--uv-python", help="a Python >=3.13.14 for uv (NeMo-RL requires it)")
    parser.add_argument("--uv-cache", help="UV_CACHE_DIR holding the tree's metadata (warm)")
    parser.add_argument(
        "--baseline",
        help="with --real-tree: a directory holding another version's `rlflow` package (e.g. "
        "`git archive main rlflow | tar -x -C DIR`), run the same way, interleaved",
    )
    parser.add_argument(
        "--toml-mb",
        type=int,
        help="only time check-pins on one valid pyproject.toml of this many MB, against tomllib",
    )
    args = parser.parse_args()
    if args.toml_mb:
        big_toml(args.toml_mb, args.runs)
        return
    if args.real_tree:
        real_tree(args)
        return
    if args.lock_only:
        lock_only(Path(__file__).resolve().parents[1])
        return
    for dynamic in {"static": [False], "dynamic": [True], "both": [False, True]}[args.metadata]:
        with tempfile.TemporaryDirectory(prefix="rlflow-bench-pins-") as tmp:
            measure(Path(tmp), dynamic, args)


if __name__ == "__main__":
    main()
