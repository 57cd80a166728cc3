"""`submodule-refs`: each listed submodule's gitlink must be on an approved ref of its remote.

    [tool.rlflow.pins]
    submodule-refs = { "submodules/Megatron-Bridge" = "main" }

A commit that exists only in a local checkout or on a fork breaks every fresh clone
(`git submodule update` cannot fetch it). "Its remote" is the URL the parent's .gitmodules
declares, never a remote picked by name: `origin` may be a fork, or missing. The commit must be
reachable (`git merge-base --is-ancestor`) from `<ref>` of the remote whose URL is that one, as
fetched; when no remote has that URL, the clone is shallow (CI checkouts are), the ref was never
fetched, or the commit is not on the ref as last fetched, check-pins fetches the ref itself
from the .gitmodules URL into `refs/rlflow/approved/<ref>` (no FETCH_HEAD, no remote changed)
and decides on that. If even that fetch fails, RF012 says so with the exact command: never "ok"
without having checked. RF009 when an entry names no submodule.
"""

from __future__ import annotations

import shlex

from rlflow.pins import gitcmd
from rlflow.pins.model import Finding
from rlflow.pins.urls import normalize_repo


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
        url = declared_url(checkout.root, sub)
        problem = unreachable(checkout.root / path, sub.gitlink, ref, path, url)
        if problem:
            findings.append(
                Finding("RF012", "error", submodule=sub, location=where, detail=problem)
            )
    return findings


def declared_url(root, sub) -> str | None:
    """The submodule's URL from its parent's .gitmodules, a relative one resolved like git."""
    import posixpath

    url = sub.url
    if not url or not url.startswith(("./", "../")):
        return url
    parent = root / posixpath.dirname(sub.declared_at.file)
    base = gitcmd.run_raw(parent, "config", "--get", "remote.origin.url").stdout.strip()
    if not base:
        return str((parent / url).resolve())
    base = base.rstrip("/")
    for part in url.split("/"):
        if part == "..":
            base = base.rsplit("/", 1)[0]
        elif part not in (".", ""):
            base += "/" + part
    return base


def unreachable(repo, commit: str, ref: str, label: str, url: str | None = None) -> str | None:
    """Why `commit` is not on `ref` of the declared remote, or None when it is."""
    remote = _matching_remote(repo, url) if url else _only_remote(repo)
    shallow = gitcmd.run_raw(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    target = None
    if remote:
        target = next(
            (c for c in (f"refs/remotes/{remote}/{ref}", f"refs/tags/{ref}") if _exists(repo, c)),
            None,
        )
    if target and not shallow and _is_ancestor(repo, commit, target) is True:
        return None
    source = url or remote
    fetched = _fetch(repo, source, ref) if source else None
    if fetched is None:
        command = f"git -C {shlex.quote(label)} fetch {shlex.quote(source or '<the .gitmodules url>')} {shlex.quote(ref)}"
        return (
            f"cannot check that submodule `{label}` is on `{ref}` of `{source}` "
            "([tool.rlflow.pins] submodule-refs): the ref could not be fetched "
            f"(offline, or no such branch or tag?); run `{command}` and check again"
        )
    verdict = _is_ancestor(repo, commit, fetched)
    if verdict is True:
        return None
    missing = verdict is None
    return (
        f"the recorded commit {commit[:12]} of submodule `{label}` is not on `{ref}` of "
        f"`{source}`"
        + (" (the commit is not even in the submodule's repository)" if missing else "")
        + ": a local-only or fork-only commit, which a fresh clone cannot fetch"
    )


def _matching_remote(repo, url: str) -> str | None:
    want = _same_url(url)
    done = gitcmd.run_raw(repo, "config", "--get-regexp", r"^remote\..*\.url$")
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        if _same_url(value) == want:
            return key[len("remote.") : -len(".url")]
    return None


def _only_remote(repo) -> str | None:
    remotes = gitcmd.run(repo, "remote").split()
    return "origin" if "origin" in remotes else (remotes[0] if remotes else None)


def _same_url(url: str) -> str:
    url = url.strip()
    if url.startswith("/"):
        url = "file://" + url
    return normalize_repo(url)


def _fetch(repo, source: str, ref: str) -> str | None:
    """Fetch `ref` (a branch or a tag) of `source` into refs/rlflow/approved/; the ref or None."""
    local = f"refs/rlflow/approved/{ref}"
    for remote_ref in (f"refs/heads/{ref}", f"refs/tags/{ref}"):
        done = gitcmd.run_raw(
            repo,
            "fetch",
            "-q",
            "--no-tags",
            "--no-write-fetch-head",
            "--no-recurse-submodules",
            source,
            f"+{remote_ref}:{local}",
        )
        if done.returncode == 0:
            return local
    return None


def _is_ancestor(repo, commit: str, target: str) -> bool | None:
    done = gitcmd.run_raw(repo, "merge-base", "--is-ancestor", commit, target)
    return True if done.returncode == 0 else (False if done.returncode == 1 else None)


def _exists(repo, ref: str) -> bool:
    return (
        gitcmd.run_raw(repo, "rev-parse", "--verify", "--quiet", ref + "^{commit}").returncode == 0
    )
