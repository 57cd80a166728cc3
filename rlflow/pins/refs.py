"""`submodule-refs`: each listed submodule's gitlink must be on an approved ref of its remote.

    [tool.rlflow.pins]
    submodule-refs = { "submodules/Megatron-Bridge" = "main" }

A commit that exists only in a local checkout or on a fork breaks every fresh clone
(`git submodule update` cannot fetch it). The check is offline: the commit must be reachable from
the ref *as fetched* (`refs/remotes/<remote>/<ref>`, or the tag `<ref>`) in the submodule's own
repository, via `git merge-base --is-ancestor`. RF012 when it is not, or when the ref was never
fetched; RF009 when an entry names no submodule.
"""

from __future__ import annotations

from rlflow.pins import gitcmd
from rlflow.pins.model import Finding


def ref_findings(checkout, policy) -> list[Finding]:
    findings = []
    by_path = {s.path: s for s in checkout.submodules}
    for path, (ref, where) in policy.submodule_refs.items():
        sub = by_path.get(path)
        if sub is None:
            findings.append(
                Finding(
                    "RF009",
                    "warning",
                    package=path,
                    location=where,
                    detail=f"submodule-refs entry `{path}`",
                )
            )
            continue
        if not sub.initialized or not sub.gitlink:
            continue  # RF007 already says its state cannot be checked
        problem = unreachable(checkout.root / path, sub.gitlink, ref, path)
        if problem:
            findings.append(
                Finding("RF012", "error", submodule=sub, location=where, detail=problem)
            )
    return findings


def unreachable(repo, commit: str, ref: str, label: str) -> str | None:
    """Why `commit` is not on `ref` of the repository's remote, or None when it is."""
    remote = _remote(repo)
    candidates = [f"refs/remotes/{remote}/{ref}", f"refs/tags/{ref}"]
    target = next((c for c in candidates if _exists(repo, c)), None)
    short = commit[:12]
    if target is None:
        return (
            f"submodule `{label}` must be on `{remote}/{ref}` ([tool.rlflow.pins] "
            f"submodule-refs), but `{remote}/{ref}` was never fetched there"
        )
    done = gitcmd.run_raw(repo, "merge-base", "--is-ancestor", commit, target)
    if done.returncode == 0:
        return None
    missing = done.returncode != 1
    return (
        f"the recorded commit {short} of submodule `{label}` is not on "
        f"`{target.removeprefix('refs/remotes/').removeprefix('refs/')}`"
        + (" (the commit is not even in the submodule's repository)" if missing else "")
        + ": a local-only or fork-only commit, which a fresh clone cannot fetch"
    )


def _remote(repo) -> str:
    remotes = gitcmd.run(repo, "remote").split()
    return "origin" if "origin" in remotes or not remotes else remotes[0]


def _exists(repo, ref: str) -> bool:
    return (
        gitcmd.run_raw(repo, "rev-parse", "--verify", "--quiet", ref + "^{commit}").returncode == 0
    )
