"""`rlflow bump SUBMODULE REF`, run through the console script on real repositories: upstream
Megatron-LM moves emerging-optimizers to v0.4.0, upstream Megatron-Bridge records that commit,
and the trainer bumps Megatron-Bridge to `main`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pins_helpers import BRIDGE_PATH, EMO_URL, GIT_ENV, LM_PATH, check_pins, git, root_toml

RLFLOW = Path(sys.executable).parent / "rlflow"
LOCKSTEP = '\n[tool.rlflow.pins]\nlockstep = ["emerging-optimizers"]\n'


def rlflow(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RLFLOW), *args],
        cwd=cwd,
        env={
            **os.environ,
            **GIT_ENV,
            "GIT_CONFIG_COUNT": "1",  # submodules are cloned from local paths
            "GIT_CONFIG_KEY_0": "protocol.file.allow",
            "GIT_CONFIG_VALUE_0": "always",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


def upstream_moves(layout, emo: str = "v0.4.0") -> str:
    """Megatron-LM pins `emo`; Megatron-Bridge's main records it. Returns the new LM commit."""
    lm = layout.upstream_lm / "pyproject.toml"
    lm.write_text(lm.read_text().replace('rev = "v0.3.0"', f'rev = "{emo}"'))
    git(layout.upstream_lm, "commit", "-qam", f"emerging-optimizers {emo}")
    nested_lm = layout.upstream_bridge / "3rdparty" / "Megatron-LM"
    git(nested_lm, "fetch", "-q", "origin")
    git(nested_lm, "checkout", "-q", "origin/main")
    git(layout.upstream_bridge, "commit", "-qam", "bump Megatron-LM")
    return git(layout.upstream_lm, "rev-parse", "HEAD").strip()


def test_dry_run_shows_the_plan_and_changes_nothing(nested):
    layout = nested(root=root_toml(body=LOCKSTEP))
    new_lm = upstream_moves(layout)
    before = git(layout.root, "rev-parse", "HEAD")
    stamp = (layout.root / "pyproject.toml").stat().st_mtime_ns
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert (layout.root / "pyproject.toml").stat().st_mtime_ns == stamp  # not even rewritten
    assert f"plan (--dry-run: nothing changed): {BRIDGE_PATH} -> origin/main" in done.stdout
    assert f"move {LM_PATH}: " in done.stdout and new_lm[:12] in done.stdout
    assert "emerging-optimizers: v0.3.0 -> v0.4.0" in done.stdout
    assert "pins a bump would move in pyproject.toml:" in done.stdout  # not "moved": nothing is
    assert git(layout.root, "rev-parse", "HEAD") == before
    assert git(layout.root, "status", "--porcelain", "--ignore-submodules=none") == ""
    assert git(layout.lm, "rev-parse", "HEAD").strip() != new_lm


def test_bump_moves_nested_submodules_mirrors_pins_and_commits_once(nested):
    layout = nested(root=root_toml(body=LOCKSTEP))
    new_lm = upstream_moves(layout)
    before = git(layout.root, "rev-parse", "HEAD").strip()
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main")
    assert done.returncode == 0, done.stdout + done.stderr
    assert git(layout.root, "rev-parse", "HEAD~1").strip() == before  # exactly one commit
    message = git(layout.root, "log", "-1", "--format=%B")
    assert message.startswith(f"Bump {BRIDGE_PATH} to origin/main (")
    assert "- emerging-optimizers: v0.3.0 -> v0.4.0 (pyproject.toml:" in message
    assert git(layout.lm, "rev-parse", "HEAD").strip() == new_lm
    text = (layout.root / "pyproject.toml").read_text()
    assert text == root_toml(emo="v0.4.0", body=LOCKSTEP)  # one value moved, layout kept
    assert git(layout.root, "status", "--porcelain", "--ignore-submodules=none") == ""
    assert check_pins("--repo", layout.root, "--strict").code == 0


def test_dirty_tree_is_refused(nested):
    layout = nested()
    upstream_moves(layout)
    (layout.root / "pyproject.toml").write_text(root_toml() + "# edit\n")
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main")
    assert done.returncode == 2
    assert "error[RF108]: the working tree has uncommitted changes" in done.stderr
    assert "M pyproject.toml" in done.stderr


def test_unknown_ref_and_nested_path_are_refused(nested):
    layout = nested()
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "no-such-ref")
    assert done.returncode == 2 and "`no-such-ref` is not a branch of `origin`" in done.stderr
    done = rlflow(layout.root, "bump", LM_PATH, "main")
    assert done.returncode == 2 and "a nested submodule moves with its parent" in done.stderr


def test_refused_pin_puts_everything_back(nested):
    """After the bump Megatron-Bridge pins v0.5.0 and Megatron-LM v0.4.0: a decision, not a
    fix. Nothing is committed and the submodules go back where they were."""
    layout = nested()
    bridge = layout.upstream_bridge / "pyproject.toml"
    source = f'emerging-optimizers = {{ git = "{EMO_URL}", rev = "v0.5.0" }}\n'
    bridge.write_text(
        bridge.read_text().replace(
            '"transformers>=5.0"', '"transformers>=5.0", "emerging-optimizers"'
        )
        + source
    )
    upstream_moves(layout, emo="v0.4.0")
    before = {p: git(p, "rev-parse", "HEAD") for p in (layout.root, layout.bridge, layout.lm)}
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error[RF108]: cannot move the root pins with the submodule" in done.stderr
    assert {p: git(p, "rev-parse", "HEAD") for p in before} == before
    assert git(layout.root, "status", "--porcelain", "--ignore-submodules=none") == ""


def test_bump_relocks_with_real_uv(tmp_path):
    """A root with a uv.lock: the bump re-locks it with `uv lock` and commits the new lock."""
    from pins_helpers import add_submodule, make_repo
    from test_pins_locks import CHILD, ROOT
    from test_pins_uv_differential import _leaf_toml

    emo = make_repo(
        tmp_path / "emo", {"pyproject.toml": _leaf_toml("emerging-optimizers", "0.2.0")}
    )
    git(emo, "tag", "v0.2.0")
    (emo / "pyproject.toml").write_text(_leaf_toml("emerging-optimizers", "0.3.0"))
    git(emo, "commit", "-qam", "0.3.0")
    git(emo, "tag", "v0.3.0")
    url = f"file://{emo}"
    child = make_repo(
        tmp_path / "up-child", {"pyproject.toml": CHILD.format(url=url, ref='rev = "v0.2.0"')}
    )
    root = make_repo(
        tmp_path / "root", {"pyproject.toml": ROOT.format(url=url, ref='rev = "v0.2.0"')}
    )
    add_submodule(root, child, "child-a")
    uv_env = {
        "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
        "UV_NO_CONFIG": "1",
        "UV_OFFLINE": "1",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_PYTHON": sys.executable,
    }
    subprocess.run(
        [str(RLFLOW.parent / "uv"), "lock", "-q"],
        cwd=root,
        env={**os.environ, **uv_env},
        check=True,
    )
    git(root, "add", "uv.lock")
    git(root, "commit", "-qm", "lock")
    (child / "pyproject.toml").write_text(CHILD.format(url=url, ref='rev = "v0.3.0"'))
    git(child, "commit", "-qam", "emerging-optimizers v0.3.0")
    done = rlflow(root, "bump", "child-a", "main", env=uv_env)
    assert done.returncode == 0, done.stdout + done.stderr
    message = git(root, "log", "-1", "--format=%B")
    assert "- emerging-optimizers: v0.2.0 -> v0.3.0 (pyproject.toml:" in message
    assert "uv.lock re-locked with `uv lock`." in message
    assert "?rev=v0.3.0" in (root / "uv.lock").read_text()
    assert git(root, "status", "--porcelain", "--ignore-submodules=none") == ""
    assert check_pins("--repo", root, "--strict").code == 0


# -- issue 24 ---------------------------------------------------------------------------------
def test_nothing_to_do_exits_0_with_a_clear_line(nested):
    """A nightly bump on a quiet night: the submodule is already at REF."""
    layout = nested()
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"nothing to do: {BRIDGE_PATH} is already at origin/main" in done.stdout


def refs_and_head(repo):
    return (
        git(repo, "for-each-ref", "--format=%(objectname) %(refname)"),
        git(repo, "symbolic-ref", "-q", "HEAD").strip(),
        (repo / ".git").read_text() if (repo / ".git").is_file() else "",
    )


def test_dry_run_leaves_refs_fetch_head_and_branch_as_they_were(nested):
    layout = nested(root=root_toml(body=LOCKSTEP))
    upstream_moves(layout)
    git(layout.bridge, "checkout", "-q", "-b", "work")
    git_dir = Path(git(layout.bridge, "rev-parse", "--absolute-git-dir").strip())
    before = refs_and_head(layout.bridge), (git_dir / "FETCH_HEAD").exists()
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main", "--dry-run")
    assert done.returncode == 0 and "plan (--dry-run" in done.stdout, done.stderr
    assert (refs_and_head(layout.bridge), (git_dir / "FETCH_HEAD").exists()) == before
    assert git(layout.root, "status", "--porcelain", "--ignore-submodules=none") == ""


def test_failed_bump_puts_the_branch_back(nested):
    layout = nested()
    bridge = layout.upstream_bridge / "pyproject.toml"
    source = f'emerging-optimizers = {{ git = "{EMO_URL}", rev = "v0.5.0" }}\n'
    bridge.write_text(
        bridge.read_text().replace(
            '"transformers>=5.0"', '"transformers>=5.0", "emerging-optimizers"'
        )
        + source
    )
    upstream_moves(layout, emo="v0.4.0")
    git(layout.bridge, "checkout", "-q", "-b", "work")
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main")
    assert done.returncode == 1, done.stdout + done.stderr
    assert git(layout.bridge, "symbolic-ref", "-q", "HEAD").strip() == "refs/heads/work"
    assert git(layout.root, "status", "--porcelain", "--ignore-submodules=none") == ""


def tree_state(layout):
    """What a user sees in every submodule: HEAD, branch, refs, FETCH_HEAD, status."""
    state = {}
    for repo in (layout.bridge, layout.lm):
        if not (repo / ".git").exists():
            state[repo] = "not initialized"
            continue
        git_dir = Path(git(repo, "rev-parse", "--absolute-git-dir").strip())
        state[repo] = (
            git(repo, "rev-parse", "HEAD"),
            git(repo, "for-each-ref", "--format=%(objectname) %(refname)"),
            git(repo, "branch", "--show-current"),  # "" when detached
            (git_dir / "FETCH_HEAD").read_bytes() if (git_dir / "FETCH_HEAD").exists() else None,
            git(repo, "status", "--porcelain=v2", "--branch", "--ignore-submodules=none"),
        )
    state["root"] = git(layout.root, "status", "--porcelain", "--ignore-submodules=none")
    return state


def test_dry_run_and_failure_leave_nested_submodules_as_they_were(nested):
    """Megatron-LM, nested in Megatron-Bridge, is on a branch and must move with the bump:
    a dry run left it detached, with its origin/main and FETCH_HEAD moved (issue 24)."""
    layout = nested(root=root_toml(body=LOCKSTEP))
    upstream_moves(layout)
    git(layout.lm, "checkout", "-q", "-b", "lm-work")
    git(layout.bridge, "checkout", "-q", "-b", "work")
    before = tree_state(layout)
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main", "--dry-run")
    assert done.returncode == 0 and f"move {LM_PATH}: " in done.stdout, done.stderr
    assert tree_state(layout) == before
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "no-such-ref")
    assert done.returncode == 2 and tree_state(layout) == before


def test_dry_run_leaves_an_uninitialized_nested_submodule_uninitialized(nested):
    layout = nested(root=root_toml(body=LOCKSTEP))
    upstream_moves(layout)
    git(layout.bridge, "submodule", "deinit", "-q", "-f", "3rdparty/Megatron-LM")
    before = tree_state(layout), git(layout.bridge, "config", "--list")
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main", "--dry-run")
    assert done.returncode == 0 and f"move {LM_PATH}: (none) -> " in done.stdout, done.stderr
    assert (tree_state(layout), git(layout.bridge, "config", "--list")) == before


def test_bump_twice_and_a_dry_run_after_it_have_nothing_to_do(nested):
    layout = nested(root=root_toml(body=LOCKSTEP))
    upstream_moves(layout)
    assert rlflow(layout.root, "bump", BRIDGE_PATH, "main").returncode == 0
    head = git(layout.root, "rev-parse", "HEAD")
    for extra in ((), ("--dry-run",)):
        done = rlflow(layout.root, "bump", BRIDGE_PATH, "main", *extra)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"nothing to do: {BRIDGE_PATH} is already at origin/main" in done.stdout
        assert git(layout.root, "rev-parse", "HEAD") == head


def test_a_refused_or_interrupted_commit_puts_everything_back(nested):
    """The bump's own `git commit` runs the root's pre-commit hook: a hook that refuses, and
    a Ctrl-C while it runs (SIGINT to the whole foreground process group, as a terminal
    sends it) and a SIGTERM (which skipped the restore), leave the root, the submodules and
    their branches as they were."""
    import signal

    layout = nested(root=root_toml(body=LOCKSTEP))
    upstream_moves(layout)
    git(layout.lm, "checkout", "-q", "-b", "lm-work")
    git(layout.bridge, "checkout", "-q", "-b", "work")
    hook = layout.root / ".git" / "hooks" / "pre-commit"
    before = tree_state(layout), git(layout.root, "rev-parse", "HEAD")
    pyproject = (layout.root / "pyproject.toml").read_bytes()
    for script, code in (
        ("echo refused by the hook >&2; exit 1", 1),
        ("kill -INT 0", 130),
        ("kill -TERM 0", 143),  # a CI job's timeout
    ):
        hook.write_text(f"#!/bin/sh\n{script}\n")
        hook.chmod(0o755)
        done = subprocess.run(
            [str(RLFLOW), "bump", BRIDGE_PATH, "main"],
            cwd=layout.root,
            env={
                **os.environ,
                **GIT_ENV,
                "GIT_CONFIG_COUNT": "1",
                "GIT_CONFIG_KEY_0": "protocol.file.allow",
                "GIT_CONFIG_VALUE_0": "always",
            },
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,  # its own process group, the hook's `kill 0` target
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert done.returncode == code, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        assert code != 1 or "`git commit` refused the bump: refused by the hook" in done.stderr
        assert (tree_state(layout), git(layout.root, "rev-parse", "HEAD")) == before, script
        assert (layout.root / "pyproject.toml").read_bytes() == pyproject


def test_origin_that_is_a_fork_is_not_where_bump_takes_ref_from(nested, tmp_path):
    """origin is a fork whose main has a fork-only commit: bumping to `main` committed it, and
    a fresh `git clone --recurse-submodules` of the result (real git) then fails. bump takes
    REF from the remote with the .gitmodules URL, and says how to add one when none has it."""
    layout = nested()
    fork = tmp_path / "fork"
    git(tmp_path, "clone", "-q", str(layout.upstream_bridge), str(fork))
    git(fork, "commit", "-q", "--allow-empty", "-m", "fork only")
    git(layout.bridge, "remote", "set-url", "origin", str(fork))
    head = git(layout.root, "rev-parse", "HEAD")
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no remote of `Megatron-Bridge` has the URL its .gitmodules declares" in done.stderr
    assert git(layout.root, "rev-parse", "HEAD") == head
    fix = done.stderr.split("add it: `", 1)[1].split("`", 1)[0]
    assert fix == f"git -C {BRIDGE_PATH} remote add upstream {layout.upstream_bridge}"
    git(layout.root, *fix.split()[1:])
    git(layout.upstream_bridge, "commit", "-q", "--allow-empty", "-m", "upstream moved")
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main")
    assert done.returncode == 0 and "-> upstream/main" in done.stdout, done.stdout + done.stderr
    clone = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", "--recurse-submodules", str(layout.root), str(clone))
    assert git(clone / BRIDGE_PATH, "log", "-1", "--format=%s").strip() == "upstream moved"


def test_untracked_file_in_the_way_is_refused_with_git_s_words(nested):
    """Upstream adds NEW; the submodule has an untracked NEW: real `git checkout` refuses.
    bump said only "Aborting" and "check that `git status` works there"."""
    layout = nested()
    (layout.upstream_bridge / "NEW").write_text("upstream\n")
    git(layout.upstream_bridge, "add", "NEW")
    git(layout.upstream_bridge, "commit", "-qm", "new file")
    (layout.bridge / "NEW").write_text("mine\n")
    git(layout.bridge, "checkout", "-q", "-b", "work")
    before = tree_state(layout)
    done = rlflow(layout.root, "bump", BRIDGE_PATH, "main")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: The following untracked working tree files would be overwritten" in done.stderr
    assert "= note: NEW" in done.stderr and f"git -C {BRIDGE_PATH} status" in done.stderr
    assert tree_state(layout) == before and (layout.bridge / "NEW").read_text() == "mine\n"


def test_submodule_path_relative_to_the_current_directory(nested):
    """From a subdirectory, git takes `../submodules/Megatron-Bridge`; so does bump."""
    layout = nested()
    upstream_moves(layout)
    (layout.root / "docs").mkdir()
    plan = f"plan (--dry-run: nothing changed): {BRIDGE_PATH} -> origin/main"
    for cwd, arg in [
        (layout.root / "docs", f"../{BRIDGE_PATH}"),
        (layout.root / "submodules", "Megatron-Bridge"),
        (layout.root / "docs", str(layout.bridge) + "/"),
    ]:
        done = rlflow(cwd, "bump", arg, "main", "--dry-run")
        assert done.returncode == 0 and plan in done.stdout, (arg, done.stdout + done.stderr)
    done = rlflow(layout.root / "docs", "bump", "Megatron-Bridge", "main")
    assert done.returncode == 2 and f"bump one of: {BRIDGE_PATH}" in done.stderr


def test_already_at_ref_but_a_pin_needs_a_decision_leaves_no_trace(nested):
    """Megatron-Bridge is at main already; it pins v0.5.0, Megatron-LM v0.4.0 (a decision):
    the refusal left the fetch's FETCH_HEAD behind, even with --dry-run."""
    from pins_helpers import bridge_toml, lm_toml

    source = f'emerging-optimizers = {{ git = "{EMO_URL}", rev = "v0.5.0" }}\n'
    layout = nested(
        bridge=bridge_toml(
            body=source, deps='"megatron-core[dev]", "transformers>=5.0", "emerging-optimizers"'
        ),
        lm=lm_toml(emo="v0.4.0"),
    )
    before = tree_state(layout)
    for extra in (("--dry-run",), ()):
        done = rlflow(layout.root, "bump", BRIDGE_PATH, "main", *extra)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "error[RF108]: cannot move the root pins with the submodule" in done.stderr
        assert tree_state(layout) == before


def test_check_pins_failing_after_the_bump_puts_everything_back(nested):
    """REF is a local-only commit and the policy approves only upstream main: the moved pins
    are fine, check-pins afterwards is not (RF012); nothing is committed or left moved."""
    layout = nested(
        root=root_toml(body=LOCKSTEP + f'submodule-refs = {{ "{BRIDGE_PATH}" = "main" }}\n')
    )
    upstream_moves(layout)
    git(layout.bridge, "fetch", "-q", "origin")
    git(layout.bridge, "checkout", "-q", "-b", "work", "origin/main")
    git(layout.bridge, "commit", "-q", "--allow-empty", "-m", "local only")
    local = git(layout.bridge, "rev-parse", "HEAD").strip()
    git(
        layout.bridge,
        "checkout",
        "-q",
        "-B",
        "work",
        git(layout.root, "ls-tree", "HEAD", BRIDGE_PATH).split()[2],
    )
    git(layout.bridge, "submodule", "update", "-q", "--recursive")
    before = tree_state(layout), git(layout.root, "rev-parse", "HEAD")
    pyproject = (layout.root / "pyproject.toml").read_bytes()
    done = rlflow(layout.root, "bump", BRIDGE_PATH, local)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error[RF012]: the recorded commit" in done.stderr
    assert "error[RF108]: check-pins fails after the bump" in done.stderr
    assert (tree_state(layout), git(layout.root, "rev-parse", "HEAD")) == before
    assert (layout.root / "pyproject.toml").read_bytes() == pyproject
