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


def test_unreachable_remote_says_what_to_run_and_running_it_fixes_the_check(nested, tmp_path):
    """Offline: RF012 "cannot check" names commands; run verbatim once the URL is reachable,
    they make the next offline check pass (a plain `git fetch <url> main` would not: it updates
    no remote-tracking ref)."""
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "main")
    git(layout.bridge, "remote", "remove", "origin")
    gone = tmp_path / "gone"
    layout.upstream_bridge.rename(gone)
    result = check_pins("--repo", layout.root)
    assert result.code == 1 and "error[RF012]: cannot check" in result.out, result.out
    assert "help: run `" in result.out and "push the commit" not in result.out, result.out
    commands = result.out.split("help: run `", 1)[1].split("`", 1)[0]
    assert commands == (
        f"git -C {BRIDGE_PATH} remote add upstream {layout.upstream_bridge} && "
        f"git -C {BRIDGE_PATH} fetch upstream"
    )
    gone.rename(layout.upstream_bridge)
    shell(layout.root, commands)
    layout.upstream_bridge.rename(gone)
    try:
        assert check_pins("--repo", layout.root, "--strict").code == 0  # offline, checked
    finally:
        gone.rename(layout.upstream_bridge)


def shell(cwd, command: str) -> None:
    import os
    import subprocess

    from pins_helpers import GIT_ENV

    env = {**os.environ, **GIT_ENV, "GIT_CONFIG_COUNT": "1"}
    env.update(GIT_CONFIG_KEY_0="protocol.file.allow", GIT_CONFIG_VALUE_0="always")
    done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def ci_clone(layout, tmp_path, name: str = "ci"):
    """`git clone --depth 1` + `git submodule update --depth 1`, as CI checks out."""
    clone = tmp_path / name
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{layout.root}", str(clone))
    git(clone, "submodule", "init", "-q")
    git(clone, "config", f"submodule.{BRIDGE_PATH}.url", f"file://{layout.upstream_bridge}")
    git(clone, "submodule", "update", "-q", "--depth", "1", BRIDGE_PATH)
    git(clone / BRIDGE_PATH, "submodule", "update", "-q", "--init")
    assert git(clone / BRIDGE_PATH, "rev-parse", "--is-shallow-repository").strip() == "true"
    return clone


def test_shallow_clone_whose_pin_is_behind_the_branch_tip(nested, tmp_path):
    """The usual CI case: upstream main moved on since the pin, so the shallow submodule has
    main's tip and the pin, not the commits between; `git fetch` adds none of them. Real git,
    with the whole history, says the pin is on main: check-pins must agree (was a false RF012)."""
    layout = nested()
    layout.root.joinpath("pyproject.toml").write_text(
        root_toml() + POLICY.format(path=BRIDGE_PATH, ref="main")
    )
    git(layout.root, "commit", "-qam", "policy")
    for n in range(4):
        git(layout.upstream_bridge, "commit", "-q", "--allow-empty", "-m", f"after the pin {n}")
    clone = ci_clone(layout, tmp_path)
    sub = clone / BRIDGE_PATH
    pin = git(sub, "rev-parse", "HEAD").strip()
    git(sub, "fetch", "-q", "origin")  # what the README used to suggest: not enough
    assert ancestor(sub, pin, "origin/main") == 1  # git too cannot tell from a shallow history
    result = check_pins("--repo", clone, "--strict")
    assert result.code == 0, result.out
    twin = tmp_path / "twin"  # real git, the whole history: the same answer
    git(tmp_path, "clone", "-q", f"file://{layout.upstream_bridge}", str(twin))
    assert ancestor(twin, pin, "origin/main") == 0


def ancestor(repo, commit: str, ref: str) -> int:
    import subprocess

    return subprocess.run(["git", "merge-base", "--is-ancestor", commit, ref], cwd=repo).returncode


def test_local_only_commit_in_a_shallow_clone_is_rf012(nested, tmp_path):
    layout = nested()
    layout.root.joinpath("pyproject.toml").write_text(
        root_toml() + POLICY.format(path=BRIDGE_PATH, ref="main")
    )
    git(layout.root, "commit", "-qam", "policy")
    clone = ci_clone(layout, tmp_path)
    sub = clone / BRIDGE_PATH
    git(sub, "commit", "-q", "--allow-empty", "-m", "local only")
    git(clone, "add", BRIDGE_PATH)
    result = check_pins("--repo", clone)
    assert result.code == 1 and "error[RF012]: the recorded commit" in result.out, result.out


def test_relative_gitmodules_url_resolves_like_git_submodule_init(nested, tmp_path):
    """`url = ../Megatron-Bridge` in a root cloned with `-o upstream` (no origin): git resolves
    it against the branch's remote; so must check-pins (was a false "cannot check")."""
    from rlflow.pins.refs import relative_url

    layout = nested()
    git(
        layout.root,
        "config",
        "-f",
        ".gitmodules",
        f"submodule.{BRIDGE_PATH}.url",
        "../Megatron-Bridge",
    )
    layout.root.joinpath("pyproject.toml").write_text(
        root_toml() + POLICY.format(path=BRIDGE_PATH, ref="main")
    )
    git(layout.root, "commit", "-qam", "relative url, policy")
    published = layout.upstream_bridge.parent / "trainer"
    git(tmp_path, "clone", "-q", "--bare", str(layout.root), str(published))
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "-o", "upstream", str(published), str(clone))
    git(clone, "submodule", "update", "-q", "--init", "--recursive")
    assert check_pins("--repo", clone, "--strict").code == 0
    # git's relative_url, differentially: `git submodule init` with each remote URL form
    for base, rel in [
        ("https://host/org/trainer.git", "../x.git"),
        ("https://host/org/trainer/", "./x"),
        ("git@host:org/trainer", "../x"),
        ("git@host:trainer", "../x"),
        ("ssh://git@host/org/trainer/.", "../../y/x"),
        ("/srv/git/trainer", "../x/"),
        ("https://h/o/t//", "../x"),
        ("https://h/o/t/", "../x//"),
        ("/srv/t/.", "../x"),
        ("../up/trainer", "../x"),
    ]:
        repo = tmp_path / "init" / str(abs(hash((base, rel))))
        repo.mkdir(parents=True)
        git(repo, "init", "-q")
        git(repo, "config", "remote.origin.url", base)
        git(repo, "config", "-f", ".gitmodules", "submodule.x.path", "x")
        git(repo, "config", "-f", ".gitmodules", "submodule.x.url", rel)
        git(repo, "update-index", "--add", "--cacheinfo", f"160000,{'1' * 40},x")
        git(repo, "submodule", "init", "-q")
        assert relative_url(base, rel) == git(repo, "config", "submodule.x.url").strip(), base


def test_remote_url_written_differently_is_still_the_declared_remote(nested, tmp_path):
    """Offline (the upstream unreachable), origin has fetched main: a `file://` URL with a
    trailing slash, or an `insteadOf` alias, is the .gitmodules path all the same."""
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "main")
    gone = tmp_path / "gone"
    aliases = [
        (f"file://{layout.upstream_bridge}/", None),
        ("up:Megatron-Bridge", f"url.{layout.upstream_bridge.parent}/.insteadOf=up:"),
    ]
    for remote_url, rewrite in aliases:
        git(layout.bridge, "remote", "set-url", "origin", remote_url)
        if rewrite:
            key, value = rewrite.split("=")
            git(layout.bridge, "config", key, value)
        git(layout.bridge, "fetch", "-q", "origin")
        layout.upstream_bridge.rename(gone)
        try:
            result = check_pins("--repo", layout.root, "--strict")
        finally:
            gone.rename(layout.upstream_bridge)
        assert result.code == 0, (remote_url, result.out)


def test_url_keys_ignore_transport_user_and_decorations():
    from rlflow.pins.refs import url_key

    same = [
        "https://github.com/NVIDIA/Megatron-LM.git",
        "https://user@github.com/nvidia/megatron-lm/",
        "git@github.com:NVIDIA/Megatron-LM.git",
        "ssh://git@github.com/NVIDIA/Megatron-LM",
        "git+ssh://git@github.com:22/NVIDIA/Megatron-LM.git",
    ]
    assert len({url_key(u) for u in same}) == 1
    assert url_key("git@github.com:someone/Megatron-LM.git") != url_key(same[0])  # a fork
    assert url_key("https://gitlab.com/NVIDIA/Megatron-LM") != url_key(same[0])
    local = [
        "/srv/git/bridge",
        "/srv/git/bridge/",
        "file:///srv/git/bridge",
        "/srv/git/bridge/.git",
    ]
    assert len({url_key(u) for u in local}) == 1
    assert url_key("/srv/git/bridge.git") != url_key("/srv/git/bridge")  # a bare one beside it


def test_a_local_tag_is_not_the_remote_s_tag(nested):
    """The approved ref is a tag: a tag of that name made locally (or fetched from a fork) on
    a local-only commit proves nothing: checked against the URL's own tag (was a false ok)."""
    layout = nested()
    with_policy(layout, BRIDGE_PATH, "release")
    git(layout.upstream_bridge, "tag", "release")
    assert "RF012" not in codes(layout)
    git(layout.bridge, "commit", "-q", "--allow-empty", "-m", "local only")
    git(layout.bridge, "tag", "-f", "release")
    git(layout.root, "add", BRIDGE_PATH)
    result = check_pins("--repo", layout.root)
    assert result.code == 1 and "error[RF012]: the recorded commit" in result.out, result.out


def test_a_glob_or_a_revision_as_the_approved_ref_is_refused(nested):
    """Globs are not implemented: refused with the entry and a fix, as git refuses the name."""
    import subprocess

    layout = nested()
    for ref in ("release/*", "main~1", "v1..v2", "feature/"):
        assert subprocess.run(["git", "check-ref-format", f"refs/heads/{ref}"]).returncode != 0
        with_policy(layout, BRIDGE_PATH, ref)
        result = check_pins("--repo", layout.root)
        assert result.code == 2 and "error[RF104]" in result.err, (ref, result.err)
        assert "is not one branch or tag name" in result.err and "--> pyproject.toml:" in result.err
    for ref in ("main", "release/v1.2", "v0.7.0"):
        assert subprocess.run(["git", "check-ref-format", f"refs/heads/{ref}"]).returncode == 0
        with_policy(layout, BRIDGE_PATH, ref)
        assert check_pins("--repo", layout.root).code in (0, 1)


def test_ref_names_are_refused_exactly_where_git_refuses_them():
    import subprocess

    from rlflow.pins.policy import _bad_ref_name

    names = [
        "main",
        "a/b",
        "v1.0",
        "x.lock",
        "a/.b",
        ".a",
        "a..b",
        "a@{1}",
        "@",
        "a b",
        "a:b",
        "a^",
        "a~",
        "a?",
        "a[",
        "a\\b",
        "a/",
        "a.",
        "a//b",
        "é",
        "a@b",
        "-x",
        "a.lock/b",
    ]
    for name in names:
        git_refuses = subprocess.run(["git", "check-ref-format", f"refs/heads/{name}"]).returncode
        assert _bad_ref_name(name) == (git_refuses != 0), name


def test_uninitialized_submodule_with_an_approved_ref_is_not_ok(nested, tmp_path):
    """A clone without `--recurse-submodules` (a CI checkout without submodules): the policy
    asks for a check that cannot run; it was a silent exit 0 (RF007 warns about pins only).
    The command it names makes the next check pass."""
    layout = nested()
    layout.root.joinpath("pyproject.toml").write_text(
        root_toml() + POLICY.format(path=BRIDGE_PATH, ref="main")
    )
    git(layout.root, "commit", "-qam", "policy")
    clone = tmp_path / "plain"
    git(tmp_path, "clone", "-q", str(layout.root), str(clone))
    result = check_pins("--repo", clone)
    assert result.code == 1, result.out
    assert f"error[RF012]: cannot check that submodule `{BRIDGE_PATH}` is on `main`" in result.out
    command = result.out.split("help: run `")[-1].split("`", 1)[0]
    shell(clone, command)
    assert check_pins("--repo", clone, "--strict").code == 0
