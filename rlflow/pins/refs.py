"""`submodule-refs`: each listed submodule's gitlink must be on an approved ref of its remote.

    [tool.rlflow.pins]
    submodule-refs = { "submodules/Megatron-Bridge" = "main" }

A commit that exists only in a local checkout or on a fork breaks every fresh clone
(`git submodule update` cannot fetch it). "Its remote" is the URL the parent's .gitmodules
declares (a relative one resolved as `git submodule init` does), never a remote picked by name:
`origin` may be a fork, or missing. Remotes are matched to that URL the way git would fetch
them: after `url.<base>.insteadOf`, with the transport (`https://`, `ssh://`, `git@host:`), user,
port, a trailing `/` or `.git` ignored, and local paths resolved.

The commit must be reachable (`git merge-base --is-ancestor`) from `refs/remotes/<remote>/<ref>`
of a remote with that URL, as fetched. Otherwise (no such remote, a tag: a local tag proves
nothing about the remote, the clone is shallow as CI checkouts are, the ref was never fetched,
or the commit is not on it as last fetched) check-pins fetches the ref itself from the URL into
`refs/rlflow/approved/<ref>` (no FETCH_HEAD, no remote changed) and decides on that; in a
shallow clone it deepens that ref's history (`--deepen` 100, then 2,000 commits, then
`--unshallow`) until the answer is certain. If a fetch fails, RF012 says so with the exact
commands that make the next check pass: never "ok" without having checked. RF009 when an entry
names no submodule.
"""

from __future__ import annotations

import os
import shlex
from urllib.parse import unquote, urlsplit

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
        if not sub.gitlink:
            continue  # nothing recorded, nothing to check
        if not sub.initialized:  # RF007 warns; the policy asked for this check: not "ok"
            from rlflow.pins.report import git_in_parent

            update = git_in_parent(sub, "submodule", "update", "--init", "--recursive")
            problem = (
                f"cannot check that submodule `{path}` is on `{ref}` "
                "([tool.rlflow.pins] submodule-refs): it is not initialized"
                f"\nrun `{update}`, then check again"
            )
            findings.append(
                Finding("RF012", "error", submodule=sub, location=where, detail=problem)
            )
            continue
        url = declared_url(checkout.root, sub)
        problem = unreachable(checkout.root / path, sub.gitlink, ref, path, url)
        if problem:
            findings.append(
                Finding("RF012", "error", submodule=sub, location=where, detail=problem)
            )
    return findings


def declared_url(root, sub) -> str | None:
    """The submodule's URL from its parent's .gitmodules, a relative one resolved like
    `git submodule init`: against the URL of the parent's default remote (its branch's
    `branch.<name>.remote`, else `origin`), or the parent's work tree when it has none."""
    import posixpath

    url = sub.url
    if not url or not url.startswith(("./", "../")):
        return url
    parent = root / posixpath.dirname(sub.declared_at.file)
    branch = gitcmd.run_raw(parent, "symbolic-ref", "-q", "--short", "HEAD").stdout.strip()
    remote = "origin"
    if branch:
        configured = gitcmd.run_raw(parent, "config", "--get", f"branch.{branch}.remote")
        remote = configured.stdout.strip() or "origin"
    base = gitcmd.run_raw(parent, "config", "--get", f"remote.{remote}.url").stdout.strip()
    resolved = relative_url(base or str(parent.resolve()), url)
    if resolved is None:
        return url
    if _is_local(resolved) and not os.path.isabs(resolved):
        resolved = os.path.normpath(os.path.join(parent.resolve(), resolved))
    return resolved


def relative_url(remote_url: str, url: str) -> str | None:
    """git's `relative_url()` (builtin/submodule--helper.c, git 2.39): `url` (`../x`, `./x`)
    against the superproject's remote URL; None where git dies ("cannot strip one component")."""
    remote = _strip_url_ending(remote_url)
    is_relative = _is_local(remote) and not os.path.isabs(remote)
    if is_relative and not remote.startswith(("./", "../")):
        remote = "./" + remote
    colonsep = False
    while True:
        if url.startswith("../"):
            url = url[3:]
            cut = remote.rfind("/")
            if cut >= 0:
                remote = remote[:cut]
                continue
            cut = remote.rfind(":")
            if cut >= 0:
                remote, colonsep = remote[:cut], True
                continue
            if is_relative or remote == ".":
                return None
            remote = "."
        elif url.startswith("./"):
            url = url[2:]
        else:
            break
    out = _strip_url_ending(remote + (":" if colonsep else "/") + url)
    return out[2:] if out.startswith("./") else out


def _strip_url_ending(url: str) -> str:
    """One trailing `/`, as git 2.39 strips it (a trailing `/.` is kept, and chopped by `..`)."""
    return url[:-1] if url.endswith("/") and len(url) > 1 else url


def _is_local(url: str) -> bool:
    """git's `url_is_local_not_ssh`: no `:` before the first `/`."""
    colon, slash = url.find(":"), url.find("/")
    return colon < 0 or (0 <= slash < colon)


def unreachable(repo, commit: str, ref: str, label: str, url: str | None = None) -> str | None:
    """Why `commit` is not on `ref` of the declared remote, or None when it is."""
    config = remote_config(repo)
    remotes = matching_remotes(config, url) if url else _only_remote(repo)
    shallow = _is_shallow(repo)
    if not shallow:
        for remote in remotes:
            target = f"refs/remotes/{remote}/{ref}"
            if _exists(repo, target) and _is_ancestor(repo, commit, target) is True:
                return None
    source = url or (config.urls.get(remotes[0]) if remotes else None)
    fetched = _fetch(repo, source, ref) if source else None
    if fetched is None:
        return _cannot_check(label, ref, source, remotes, config, shallow)
    local, remote_ref = fetched
    verdict = _is_ancestor(repo, commit, local)
    if verdict is not True and _is_shallow(repo):
        # A shallow history proves nothing by omission: deepen `ref` until the commit is on it
        # or its history is whole (`--deepen` never shortens what is there, unlike
        # `--shallow-since`/`--depth`; a pin is usually a few commits behind the tip).
        for step in ("--deepen=100", "--deepen=2000", "--unshallow"):
            if not _fetch_into(repo, source, remote_ref, local, step):
                return _cannot_check(label, ref, source, remotes, config, True)
            verdict = _is_ancestor(repo, commit, local)
            if verdict is True or not _is_shallow(repo):
                break
    if verdict is True:
        return None
    missing = verdict is None
    return (
        f"the recorded commit {commit[:12]} of submodule `{label}` is not on `{ref}` of "
        f"`{source}`"
        + (" (the commit is not even in the submodule's repository)" if missing else "")
        + ": a local-only or fork-only commit, which a fresh clone cannot fetch"
    )


def _cannot_check(label, ref, source, remotes, config, shallow) -> str:
    """The finding's text (first line) and the commands that make the next check pass."""
    sub = shlex.quote(label)
    deepen = " --unshallow" if shallow else ""
    if remotes:
        commands = f"git -C {sub} fetch{deepen} {shlex.quote(remotes[0])}"
    elif source:
        name = next(
            (n for n in ("upstream", "approved", "rlflow-approved") if n not in config.urls),
            "declared",
        )
        commands = (
            f"git -C {sub} remote add {name} {shlex.quote(source)} && "
            f"git -C {sub} fetch{deepen} {name}"
        )
    else:
        commands = f"git -C {sub} remote add upstream <the .gitmodules url> && ..."
    return (
        f"cannot check that submodule `{label}` is on `{ref}` of `{source or '(no URL)'}` "
        "([tool.rlflow.pins] submodule-refs): the ref could not be fetched from it "
        "(offline, no access, or no such branch or tag?)"
        f"\nrun `{commands}` where `{source}` can be reached, then check again"
    )


class _Config:
    def __init__(self, urls: dict[str, str], rewrites: list[tuple[str, str]]):
        self.urls = urls  # remote name -> url, in config order
        self.rewrites = rewrites  # (insteadOf prefix, base)

    def expand(self, url: str) -> str:
        """`url.<base>.insteadOf`: the longest matching prefix wins, as in git's remote.c."""
        best = max(
            (p for p in self.rewrites if url.startswith(p[0])),
            key=lambda p: len(p[0]),
            default=None,
        )
        return best[1] + url[len(best[0]) :] if best else url


def remote_config(repo) -> _Config:
    done = gitcmd.run_raw(
        repo, "config", "-z", "--get-regexp", r"^(remote\..*\.url|url\..*\.insteadof)$"
    )
    urls: dict[str, str] = {}
    rewrites = []
    for record in done.stdout.split("\0"):
        key, _, value = record.partition("\n")
        if key.startswith("remote.") and key.endswith(".url"):
            urls.setdefault(key[len("remote.") : -len(".url")], value)
        elif key.startswith("url.") and key.lower().endswith(".insteadof"):
            rewrites.append((value, key[len("url.") : -len(".insteadof")]))
    return _Config(urls, rewrites)


def matching_remotes(config: _Config, url: str) -> list[str]:
    want = url_key(config.expand(url))
    return [name for name, value in config.urls.items() if url_key(config.expand(value)) == want]


def _only_remote(repo) -> list[str]:
    remotes = gitcmd.run(repo, "remote").split()
    return ["origin"] if "origin" in remotes else remotes[:1]


def url_key(url: str) -> tuple[str, str]:
    """What makes two fetch URLs the same repository: (host, path), or ("", real path)."""
    url = url.strip().removeprefix("git+")
    if "://" not in url:
        colon, slash = url.find(":"), url.find("/")
        if colon > 0 and (slash < 0 or colon < slash):  # scp-like `[user@]host:path`
            host, path = url[:colon].rsplit("@", 1)[-1], url[colon + 1 :]
            return _key(host, "/" + path.lstrip("/"))
        return "", _local(url)
    parts = urlsplit(url)
    if parts.scheme.lower() == "file":
        return "", _local(unquote(parts.path))
    return _key(parts.hostname or "", parts.path)


def _key(host: str, path: str) -> tuple[str, str]:
    host = host.lower()
    path = path.rstrip("/").removesuffix(".git").rstrip("/")
    return host, path.lower() if host == "github.com" else path


def _local(path: str) -> str:
    """A local repository by its real path (`x/.git` is `x`); `x.git` beside `x` is another
    repository (a bare upstream beside someone's checkout), so its suffix stays."""
    path = os.path.realpath(os.path.expanduser(path)).rstrip("/")
    return path.removesuffix("/.git")


def _fetch(repo, source: str, ref: str) -> tuple[str, str] | None:
    """Fetch `ref` (a branch or a tag) of `source` into refs/rlflow/approved/:
    (that local ref, the remote's ref), or None."""
    local = f"refs/rlflow/approved/{ref}"
    for remote_ref in (f"refs/heads/{ref}", f"refs/tags/{ref}"):
        if _fetch_into(repo, source, remote_ref, local):
            return local, remote_ref
    return None


def _fetch_into(repo, source: str, remote_ref: str, local: str, *options: str) -> bool:
    """A fetch that never waits for a password at the terminal (a hook, a CI runner): with
    no credential helper it fails at once, and RF012 names the fetch to run by hand."""
    done = gitcmd.run_raw(
        repo,
        "fetch",
        "-q",
        "--no-tags",
        "--no-write-fetch-head",
        "--no-recurse-submodules",
        *options,
        source,
        f"+{remote_ref}:{local}",
        extra_env={"GIT_TERMINAL_PROMPT": "0"},
    )
    return done.returncode == 0


def _is_shallow(repo) -> bool:
    done = gitcmd.run_raw(repo, "rev-parse", "--is-shallow-repository")
    return done.stdout.strip() == "true"


def _is_ancestor(repo, commit: str, target: str) -> bool | None:
    done = gitcmd.run_raw(repo, "merge-base", "--is-ancestor", commit, target)
    return True if done.returncode == 0 else (False if done.returncode == 1 else None)


def _exists(repo, ref: str) -> bool:
    return (
        gitcmd.run_raw(repo, "rev-parse", "--verify", "--quiet", ref + "^{commit}").returncode == 0
    )
