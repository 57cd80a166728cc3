"""`submodule-refs`: the gitlink must be reachable from the approved ref of the submodule's
remote as fetched. Real repositories; the submodules are cloned from `file://` remotes."""

from __future__ import annotations

from pins_helpers import BRIDGE_PATH, check_pins, git, root_toml

POLICY = '\n[tool.rlflow.pins]\nsubmodule-refs = {{ "{path}" = "{ref}" }}\n'


def with_policy(layout, path: str, ref: str) -> None:
    """The policy at the root; Megatron-Bridge's origin becomes a `file://` remote, fetched."""
    git(layout.bridge, "remote", "set-url", "origin", f"file://{layout.upstream_bridge}")
    git(layout.bridge, "fetch", "-q", "origin")
    pyproject = layout.root / "pyproject.toml"
    pyproject.write_text(root_toml() + POLICY.format(path=path, ref=ref))


def codes(layout) -> list[str]:
    return check_pins("--repo", layout.root, "--format", "json").codes()


def test_commit_on_the_approved_branch_passes(nested):
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "main")
    assert check_pins("--repo", layout.root, "--strict").code == 0


def test_local_only_commit_is_rf012(nested):
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "main")
    (layout.bridge / "LOCAL").write_text("only here\n")
    git(layout.bridge, "add", "LOCAL")
    git(layout.bridge, "commit", "-qm", "local only")
    git(layout.root, "add", BRIDGE_PATH)
    result = check_pins("--repo", layout.root)
    assert result.code == 1
    assert "error[RF012]: the recorded commit" in result.out
    assert f"is not on `main` of `{layout.upstream_bridge}`" in result.out
    # Pushed upstream and fetched: the same commit is fine.
    git(layout.bridge, "push", "-q", "origin", "HEAD:refs/heads/feature")
    git(layout.upstream_bridge, "merge", "-q", "--ff-only", "feature")
    git(layout.bridge, "fetch", "-q", "origin")
    assert "RF012" not in codes(layout)


def test_fork_only_commit_is_rf012(nested, tmp_path):
    """The commit is on a fork's main, fetched into the submodule as `fork/main`: not approved."""
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "main")
    fork = tmp_path / "fork"
    git(tmp_path, "clone", "-q", f"file://{layout.upstream_bridge}", str(fork))
    (fork / "FORK").write_text("fork\n")
    git(fork, "add", "FORK")
    git(fork, "commit", "-qm", "fork only")
    git(layout.bridge, "remote", "add", "fork", f"file://{fork}")
    git(layout.bridge, "fetch", "-q", "fork")
    git(layout.bridge, "checkout", "-q", "fork/main")
    git(layout.root, "add", BRIDGE_PATH)
    assert "RF012" in codes(layout)


def test_unfetched_ref_and_tags(nested):
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "release")
    result = check_pins("--repo", layout.root)
    assert "error[RF012]: cannot check that submodule" in result.out
    assert "the ref could not be fetched" in result.out
    git(layout.upstream_bridge, "tag", "release")  # check-pins fetches it itself
    assert "RF012" not in codes(layout)


def test_entry_for_no_submodule_is_rf009_and_bad_value_is_exit_2(nested):
    layout = nested()
    with_policy(layout, "submodules/Nope", "main")
    assert "RF009" in codes(layout)
    pyproject = layout.root / "pyproject.toml"
    pyproject.write_text(root_toml() + '\n[tool.rlflow.pins]\nsubmodule-refs = { "x" = 3 }\n')
    result = check_pins("--repo", layout.root)
    assert result.code == 2 and "error[RF104]" in result.err and "--> pyproject.toml:" in result.err


# -- issue 24: the remote by its .gitmodules URL, shallow clones, never "ok" unchecked ---------
def test_ci_style_shallow_clone_is_checked_and_passes(nested, tmp_path):
    """`git clone --depth 1` + shallow submodules, as CI checks out: the approved ref is fetched
    from the .gitmodules URL and the commit is found on it (was a false RF012)."""
    layout = nested()
    layout.root.joinpath("pyproject.toml").write_text(
        root_toml() + POLICY.format(path=BRIDGE_PATH, ref="main")
    )
    git(layout.root, "commit", "-qam", "policy")
    clone = tmp_path / "ci"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{layout.root}", str(clone))
    git(clone, "submodule", "init", "-q")
    # A file:// URL, as CI's https one: git ignores --depth for a plain local path.
    git(clone, "config", f"submodule.{BRIDGE_PATH}.url", f"file://{layout.upstream_bridge}")
    git(clone, "submodule", "update", "-q", "--depth", "1", BRIDGE_PATH)
    git(clone / BRIDGE_PATH, "submodule", "update", "-q", "--init")
    assert git(clone / BRIDGE_PATH, "rev-parse", "--is-shallow-repository").strip() == "true"
    result = check_pins("--repo", clone, "--strict")
    assert result.code == 0, result.out


def test_origin_that_is_a_fork_is_not_the_approved_remote(nested, tmp_path):
    """origin points at a fork whose main has the commit; .gitmodules names upstream: RF012."""
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "main")
    fork = tmp_path / "fork"
    git(tmp_path, "clone", "-q", f"file://{layout.upstream_bridge}", str(fork))
    (fork / "FORK").write_text("fork\n")
    git(fork, "add", "FORK")
    git(fork, "commit", "-qm", "fork only")
    git(layout.bridge, "remote", "set-url", "origin", f"file://{fork}")
    git(layout.bridge, "fetch", "-q", "origin")
    git(layout.bridge, "checkout", "-q", "origin/main")
    git(layout.root, "add", BRIDGE_PATH)
    result = check_pins("--repo", layout.root)
    assert result.code == 1 and "error[RF012]" in result.out, result.out
    assert str(layout.upstream_bridge) in result.out


def test_no_origin_at_all(nested):
    """No remote: upstream's commit passes (fetched from the .gitmodules URL), a local one not."""
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "main")
    git(layout.bridge, "remote", "remove", "origin")
    assert "RF012" not in codes(layout)
    (layout.bridge / "LOCAL").write_text("only here\n")
    git(layout.bridge, "add", "LOCAL")
    git(layout.bridge, "commit", "-qm", "local only")
    git(layout.root, "add", BRIDGE_PATH)
    assert "RF012" in codes(layout)


def test_unreachable_remote_says_what_to_run(nested, tmp_path):
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "main")
    git(layout.bridge, "remote", "remove", "origin")
    gone = tmp_path / "gone"
    layout.upstream_bridge.rename(gone)
    try:
        result = check_pins("--repo", layout.root)
    finally:
        gone.rename(layout.upstream_bridge)
    assert result.code == 1 and "error[RF012]: cannot check" in result.out, result.out
    assert f"git -C {BRIDGE_PATH} fetch {layout.upstream_bridge} main" in result.out
