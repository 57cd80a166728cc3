"""The hook in real commits: `pre-commit install`, then `git commit` in a repository with nested
submodules (trainer -> Megatron-Bridge -> Megatron-LM).

git exports GIT_INDEX_FILE (and, for `commit -a` / `commit <paths>`, points it at a temporary
index) to its hooks; before issue 11 the git calls made inside the submodules inherited it and
every commit was refused (RF106 "index file open failed", or a false RF008 with `-a`). The hook
here is a `repo: local` hook running the installed console script (`.venv/bin/rlflow`), so the
test needs no network; the shipped hook definition is exercised by test_pins_precommit.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pins_helpers import BRIDGE_PATH, GIT_ENV, LM_PATH, git, root_toml

RLFLOW = Path(sys.executable).parent / "rlflow"
CONFIG = f"""\
repos:
  - repo: local
    hooks:
      - id: rlflow-check-pins
        name: rlflow check-pins
        entry: {RLFLOW} check-pins
        language: system
        pass_filenames: false
        always_run: true
        require_serial: true
"""


@pytest.fixture
def hooked(nested, tmp_path):
    """A nested layout with the hook installed by the real `pre-commit install`."""
    layout = nested()
    (layout.root / ".pre-commit-config.yaml").write_text(CONFIG)
    (layout.root / "docs").mkdir()
    (layout.root / "docs" / "notes.md").write_text("notes\n")
    git(layout.root, "add", ".pre-commit-config.yaml", "docs")
    git(layout.root, "commit", "-q", "--no-verify", "-m", "hook config")
    env = _env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "pre_commit", "install"],
        cwd=layout.root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return layout


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        **GIT_ENV,
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "PRE_COMMIT_COLOR": "never",
    }


def commit(cwd: Path, tmp_path: Path, *args: str) -> tuple[int, str]:
    """A real `git commit ARGS` (hooks run); returns (exit code, everything printed)."""
    done = subprocess.run(
        ["git", "commit", *args],
        cwd=cwd,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


def accepted(result: tuple[int, str]) -> None:
    code, output = result
    assert code == 0, output
    assert "rlflow check-pins" in output and "Passed" in output, output


def refused(result: tuple[int, str], finding: str) -> None:
    code, output = result
    assert code != 0, output
    assert finding in output, output
    assert "RF106" not in output and "Traceback" not in output, output


def drift_root(layout) -> None:
    (layout.root / "pyproject.toml").write_text(root_toml(emo="v0.2.0"))


RF001 = "error[RF001]: conflicting git revs for `emerging-optimizers`"


def test_plain_commit(hooked, tmp_path):
    (hooked.root / "docs" / "notes.md").write_text("more notes\n")
    git(hooked.root, "add", "docs/notes.md")
    accepted(commit(hooked.root, tmp_path, "-m", "notes"))
    drift_root(hooked)
    git(hooked.root, "add", "pyproject.toml")
    refused(commit(hooked.root, tmp_path, "-m", "drift"), RF001)


def test_commit_all(hooked, tmp_path):
    """`-a` commits through a temporary index; the nested Megatron-LM is still walked."""
    (hooked.root / "docs" / "notes.md").write_text("more notes\n")
    accepted(commit(hooked.root, tmp_path, "-a", "-m", "notes"))
    drift_root(hooked)
    refused(commit(hooked.root, tmp_path, "-a", "-m", "drift"), RF001)


def test_commit_paths(hooked, tmp_path):
    (hooked.root / "docs" / "notes.md").write_text("more notes\n")
    accepted(commit(hooked.root, tmp_path, "-m", "notes", "--", "docs/notes.md"))
    drift_root(hooked)
    refused(commit(hooked.root, tmp_path, "-m", "drift", "--", "pyproject.toml"), RF001)


def test_amend(hooked, tmp_path):
    accepted(commit(hooked.root, tmp_path, "--amend", "-m", "reworded"))
    drift_root(hooked)
    git(hooked.root, "add", "pyproject.toml")
    refused(commit(hooked.root, tmp_path, "--amend", "--no-edit"), RF001)


def test_commit_from_a_subdirectory(hooked, tmp_path):
    docs = hooked.root / "docs"
    (docs / "notes.md").write_text("more notes\n")
    git(docs, "add", "notes.md")
    accepted(commit(docs, tmp_path, "-m", "notes"))
    drift_root(hooked)
    git(docs, "add", "../pyproject.toml")
    refused(commit(docs, tmp_path, "-m", "drift"), RF001)


def _bump_megatron_lm(layout, emo: str) -> None:
    """Megatron-LM moves emerging-optimizers to `emo`; Megatron-Bridge records the new commit."""
    lm = layout.root / LM_PATH
    text = (lm / "pyproject.toml").read_text().replace('rev = "v0.3.0"', f'rev = "{emo}"')
    (lm / "pyproject.toml").write_text(text)
    git(lm, "commit", "-qam", f"emerging-optimizers {emo}")
    git(layout.bridge, "commit", "-qam", "bump Megatron-LM")


def test_commit_that_stages_a_submodule_bump(hooked, tmp_path):
    _bump_megatron_lm(hooked, "v0.4.0")
    git(hooked.root, "add", "submodules/Megatron-Bridge")
    refused(commit(hooked.root, tmp_path, "-m", "bump bridge"), "`v0.4.0`")
    (hooked.root / "pyproject.toml").write_text(root_toml(emo="v0.4.0"))
    git(hooked.root, "add", "pyproject.toml")
    accepted(commit(hooked.root, tmp_path, "-m", "bump bridge and the root pin"))


def test_commit_all_records_an_unstaged_bump(hooked, tmp_path):
    """The bump is only in the working tree; `-a` stages it in git's temporary index, which is
    what the hook must read (the real index still has the old gitlink: no false RF006)."""
    _bump_megatron_lm(hooked, "v0.3.0.post1")
    (hooked.root / "pyproject.toml").write_text(root_toml(emo="v0.3.0.post1"))
    accepted(commit(hooked.root, tmp_path, "-a", "-m", "bump bridge and the root pin"))
    assert git(hooked.root, "status", "--porcelain") == ""


def test_nested_gitlink_staged_but_not_committed_in_its_parent_is_refused(hooked, tmp_path):
    """Megatron-LM moves and Bridge stages it, but Bridge never commits: the root would record
    Bridge's old commit and a fresh clone would check out the old Megatron-LM (issue 24)."""
    lm = hooked.root / LM_PATH
    (lm / "NOTE").write_text("moved\n")
    git(lm, "add", "NOTE")
    git(lm, "commit", "-qm", "moved on")
    git(hooked.bridge, "add", "3rdparty/Megatron-LM")
    (hooked.root / "docs" / "notes.md").write_text("more notes\n")
    git(hooked.root, "add", "docs/notes.md")
    code, output = commit(hooked.root, tmp_path, "-m", "notes")
    assert code != 0 and "error[RF014]" in output, output
    fix = "git -C submodules/Megatron-Bridge commit -m 'bump 3rdparty/Megatron-LM'"
    assert fix in output and "git add submodules/Megatron-Bridge" in output, output
    assert "git -C submodules/Megatron-Bridge push origin HEAD:<branch>" in output, output
    git(hooked.bridge, "commit", "-qm", "bump 3rdparty/Megatron-LM")  # what the help says
    git(hooked.root, "add", "submodules/Megatron-Bridge")
    accepted(commit(hooked.root, tmp_path, "-m", "notes and the bump"))


def test_hook_with_git_dir_and_work_tree_and_no_dot_git(tmp_path):
    """`GIT_DIR=... GIT_WORK_TREE=... git commit` with the repository outside the work tree."""
    from pins_helpers import make_repo

    work = make_repo(tmp_path / "work", {"pyproject.toml": root_toml()})
    store = tmp_path / "store.git"
    (work / ".git").rename(store)
    hook = store / "hooks" / "pre-commit"
    hook.write_text(f"#!/bin/sh\nexec {RLFLOW} check-pins\n")
    hook.chmod(0o755)
    env = {**_env(tmp_path), "GIT_DIR": str(store), "GIT_WORK_TREE": str(work)}

    def run(*args):
        return subprocess.run(
            ["git", *args], cwd=work, env=env, capture_output=True, text=True, timeout=120
        )

    (work / "README").write_text("hi\n")
    assert run("add", "README").returncode == 0
    done = run("commit", "-m", "readme")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: 1 pyproject.toml file, 0 submodules" in done.stdout + done.stderr
    (work / "pyproject.toml").write_text("[project\n")
    run("add", "pyproject.toml")
    done = run("commit", "-m", "broken")
    assert done.returncode != 0 and "error[RF102]" in done.stdout + done.stderr


def test_hook_with_core_worktree_and_only_git_dir_set(nested, tmp_path):
    """A repository outside its work tree found through `core.worktree` (`GIT_DIR` alone, as a
    dotfiles-style setup runs git): nested submodules, the hook from the real `pre-commit
    install`. Every commit was refused (RF100 "not inside a git repository")."""
    layout = nested()
    store, work = tmp_path / "store.git", tmp_path / "work"
    work.mkdir()
    git(tmp_path, "init", "-q", "--bare", str(store))
    git(store, "config", "core.bare", "false")
    git(store, "config", "core.worktree", str(work))
    env = {**_env(tmp_path), "GIT_DIR": str(store)}

    def run(*args, cwd=work):
        done = subprocess.run(
            ["git", "-c", "protocol.file.allow=always", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.returncode, done.stdout + done.stderr

    (work / "pyproject.toml").write_text(root_toml())
    (work / ".pre-commit-config.yaml").write_text(CONFIG)
    assert run("add", "pyproject.toml", ".pre-commit-config.yaml")[0] == 0
    assert run("submodule", "add", "-q", str(layout.upstream_bridge), BRIDGE_PATH)[0] == 0
    assert run("submodule", "update", "-q", "--init", "--recursive")[0] == 0
    done = subprocess.run(
        [sys.executable, "-m", "pre_commit", "install"], cwd=work, env=env, capture_output=True
    )
    assert done.returncode == 0 and (store / "hooks" / "pre-commit").is_file(), done.stderr
    accepted(run("commit", "-m", "trainer with Megatron-Bridge"))
    accepted(run("commit", "--allow-empty", "-m", "from a subdirectory", cwd=work / "submodules"))
    drift_root(SimpleNamespace(root=work))
    refused(run("commit", "-am", "drift"), RF001)
    (work / "pyproject.toml").write_text(root_toml())
    git(work / LM_PATH, "commit", "-q", "--allow-empty", "-m", "moved on")
    git(work / BRIDGE_PATH, "add", "3rdparty/Megatron-LM")
    refused(run("commit", "--allow-empty", "-m", "notes"), "error[RF014]")


def test_commit_in_a_linked_worktree(hooked, tmp_path):
    """`git worktree add`: the checkout's `.git` is a file, its index is under the main
    repository's `.git/worktrees/`; the hook reads that index, submodules included."""
    linked = tmp_path / "linked"
    git(hooked.root, "worktree", "add", "-q", str(linked))
    git(linked, "submodule", "update", "-q", "--init", "--recursive")
    assert (linked / ".git").is_file()
    (linked / "docs" / "notes.md").write_text("from the linked worktree\n")
    accepted(commit(linked, tmp_path, "-am", "notes"))
    drift_root(SimpleNamespace(root=linked))
    refused(commit(linked, tmp_path, "-am", "drift"), RF001)
    (linked / "pyproject.toml").write_text(root_toml())
    git(linked / LM_PATH, "commit", "-q", "--allow-empty", "-m", "moved on")
    git(linked / BRIDGE_PATH, "add", "3rdparty/Megatron-LM")
    refused(commit(linked, tmp_path, "--allow-empty", "-m", "notes"), "error[RF014]")
