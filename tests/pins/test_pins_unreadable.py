"""Never "ok" on input check-pins could not read: each case is exit 2 with file and line, no
traceback (issue 11). Before, these submodules were skipped and real drift behind them hidden."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pins_helpers import BRIDGE_PATH, LM_PATH, check_pins, git, make_repo, root_toml
from test_pins_uv_differential import UV

RLFLOW = Path(sys.executable).parent / "rlflow"


def unusable(layout_root: Path, file: str, line: int | None = None) -> str:
    """Run the console script; assert exit 2, `--> file:line`, no traceback; return stderr."""
    done = subprocess.run(
        [str(RLFLOW), "check-pins", "--repo", str(layout_root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    arrow = f"--> {file}:{line}" if line else f"--> {file}:"
    assert arrow in done.stderr, done.stderr
    return done.stderr


def test_unparseable_gitmodules(nested):
    layout = nested()
    path = layout.root / ".gitmodules"
    path.write_text(path.read_text() + "[submodule \n  url = x\n")
    err = unusable(layout.root, ".gitmodules", 4)
    assert "error[RF105]: malformed `.gitmodules`" in err


def test_nested_gitmodules_is_a_directory(nested):
    layout = nested()
    path = layout.bridge / ".gitmodules"
    path.unlink()
    path.mkdir()
    (path / "x").write_text("")
    done = check_pins("--repo", layout.root)
    assert done.code == 2
    assert f"malformed `{BRIDGE_PATH}/.gitmodules`: it is a directory" in done.err


def test_gitlink_without_gitmodules_entry(nested):
    layout = nested()
    git(
        layout.bridge,
        "config",
        "-f",
        ".gitmodules",
        "--remove-section",
        "submodule.3rdparty/Megatron-LM",
    )
    err = unusable(layout.root, f"{BRIDGE_PATH}/.gitmodules")
    assert "`3rdparty/Megatron-LM` is a submodule in git's index" in err
    assert "has no entry for it" in err


def test_gitlink_with_no_gitmodules_file_at_all(tmp_path):
    """A gitlink added without `git submodule add`: git would not clone it; neither do we pass."""
    sub = make_repo(tmp_path / "sub", {"pyproject.toml": "[project]\nname = 's'\n"})
    root = make_repo(tmp_path / "root", {"pyproject.toml": root_toml()})
    head = git(sub, "rev-parse", "HEAD").strip()
    git(root, "update-index", "--add", "--cacheinfo", f"160000,{head},vendor/sub")
    done = check_pins("--repo", root)
    assert done.code == 2
    assert "`vendor/sub` is a submodule in git's index" in done.err
    assert "`.gitmodules` does not exist" in done.err


@pytest.mark.parametrize("kind", ["directory", "symlink loop", "device", "pipe"])
def test_submodule_pyproject_that_is_not_a_file(nested, kind):
    layout = nested()
    path = layout.lm / "pyproject.toml"
    path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink loop":
        path.symlink_to(path.name)
    elif kind == "device":
        path.symlink_to("/dev/null")
    else:
        os.mkfifo(path)
    line = 1 + (layout.bridge / ".gitmodules").read_text().splitlines().index(
        "\tpath = 3rdparty/Megatron-LM"
    )
    err = unusable(layout.root, f"{BRIDGE_PATH}/.gitmodules", line)
    assert f"cannot read `{LM_PATH}/pyproject.toml`: it is " in err
    assert {"directory": "directory", "symlink loop": "symlink loop"}.get(kind, "regular") in err


def test_deeply_nested_toml_is_exit_2_not_a_recursion_error(nested):
    layout = nested()
    text = root_toml() + "\n[tool.deep]\nx = " + "[" * 5000 + "]" * 5000 + "\n"
    (layout.root / "pyproject.toml").write_text(text)
    line = len(root_toml().splitlines()) + 3
    err = unusable(layout.root, "pyproject.toml", line)
    assert "nested too deeply" in err


def test_bom_is_read_like_uv_does(nested):
    layout = nested(root="\ufeff" + root_toml(emo="v0.2.0"))
    result = check_pins("--repo", layout.root)
    assert result.code == 1 and "RF001" in result.out  # read, and the drift found
    assert "BOM" not in result.out + result.err


def test_github_url_case_is_one_repository(nested):
    root = root_toml().replace("NVIDIA-NeMo/Emerging-Optimizers", "nvidia-nemo/emerging-optimizers")
    assert check_pins("--repo", nested(root=root).root).code == 0


def test_long_source_line_is_truncated(nested):
    layout = nested(root=root_toml(emo="v0.2.0"))
    path = layout.root / "pyproject.toml"
    filler = "x" * 1_000_000
    path.write_text(path.read_text().replace("# bumped with the submodule", "# " + filler))
    result = check_pins("--repo", layout.root)
    assert result.code == 1
    assert len(result.out) < 5000
    assert "..." in result.out


def test_gitmodules_scale_linearly(tmp_path):
    """20,000 uninitialized submodules (issue 11: over 120 s before) in seconds, and the time
    of 20,000 is about 5x that of 4,000, not 25x."""

    def repo_with(n: int) -> Path:
        root = make_repo(tmp_path / f"r{n}", {"pyproject.toml": root_toml()})
        sections = "".join(
            f'[submodule "s{i}"]\n\tpath = vendor/s{i}\n\turl = ../s{i}\n' for i in range(n)
        )
        (root / ".gitmodules").write_text(sections)
        head = git(root, "rev-parse", "HEAD").strip()
        records = "".join(f"160000 {head}\tvendor/s{i}\n" for i in range(n))
        subprocess.run(
            ["git", "update-index", "--index-info"], cwd=root, input=records, text=True, check=True
        )
        return root

    def seconds(root: Path) -> float:
        start = time.perf_counter()
        result = check_pins("--repo", root, "--format", "json")
        assert result.code == 0 and len(result.json["diagnostics"]) > 1000
        return time.perf_counter() - start

    small, large = repo_with(4000), repo_with(20000)
    t_small, t_large = seconds(small), seconds(large)
    assert t_large < 60, t_large
    print(f"4,000 sections: {t_small:.2f} s, 20,000: {t_large:.2f} s")
    assert t_large < 12 * max(t_small, 0.05), (t_small, t_large)


def test_malformed_uv_lock_is_exit_2_with_line(nested):
    layout = nested()
    (layout.root / "uv.lock").write_text('version = 1\n[[package]]\nname = "x\n')
    err = unusable(layout.root, "uv.lock", 3)
    assert "error[RF102]: malformed TOML" in err


@pytest.mark.parametrize("kind", ["directory", "pipe", "device"])
def test_a_root_uv_lock_that_is_not_a_file_is_exit_2_as_with_uv(nested, kind, tmp_path):
    """A uv.lock that is a directory got "ok" (issue 36): `uv lock --check` exits 2 there. A
    pipe (never waited on) or a link to /dev/zero (never read) is refused the same way."""
    layout = nested()
    lock = layout.root / "uv.lock"
    if kind == "directory":
        lock.mkdir()
        (lock / "x").write_text("")
        real = subprocess.run(
            [str(UV), "lock", "--check", "--offline", "--cache-dir", str(tmp_path / "cache")],
            cwd=layout.root,
            env={**os.environ, "UV_PYTHON": sys.executable, "UV_PYTHON_DOWNLOADS": "never"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert real.returncode == 2 and "uv.lock" in real.stderr, real.stderr
        what = "it is a directory, not a regular file"
    elif kind == "pipe":
        os.mkfifo(lock)
        what = "it is a named pipe (FIFO), not a regular file"
    else:
        lock.symlink_to("/dev/zero")
        what = "it links to /dev/zero, which is a character device, not a regular file"
    done = subprocess.run(
        [str(RLFLOW), "check-pins", "--repo", str(layout.root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f"error[RF102]: cannot read `uv.lock`: {what}\n  --> uv.lock\n" in done.stderr
