"""What `rlflow bump` puts back when a dry run ends or a bump fails (Ctrl-C, SIGTERM included).

`TreeState` records, before the fetch, the refs, FETCH_HEAD and branch or detached HEAD of the
bumped submodule and of every nested one, and which nested ones were not initialized; its
`restore()` puts them back top-down and de-initializes the nested ones the bump initialized.
`snapshot()` and `restore()` do the same for the root: its pyproject.toml and uv.lock bytes, the
index entries of the bump, and the submodule checked out again at the commit it was at.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlflow.pins import gitcmd


@dataclass(frozen=True)
class TreeState:
    """The bumped submodule's and its nested submodules' states, restored top-down; nested
    submodules the bump had to initialize are de-initialized again."""

    repos: tuple[_RepoState, ...]
    uninitialized: tuple[tuple[Path, str], ...]  # (parent repository, path in it)

    @classmethod
    def of(cls, root: Path, checkout, path: str) -> TreeState:
        import posixpath

        below = [s for s in checkout.submodules if s.path == path or s.path.startswith(path + "/")]
        repos = tuple(_RepoState.of(root / s.path) for s in below if s.initialized)
        uninitialized = []
        for sub in below:
            if not sub.initialized:
                parent = posixpath.dirname(sub.declared_at.file)
                uninitialized.append((root / parent, posixpath.relpath(sub.path, parent or ".")))
        return cls(repos, tuple(uninitialized))

    def restore(self) -> None:
        for repo in self.repos:  # top-down: a parent's checkout moves its nested ones first
            repo.restore()
        for parent, rel in self.uninitialized:
            if (parent / rel / ".git").exists():
                gitcmd.run_raw(parent, "submodule", "deinit", "-q", "-f", "--", rel)


@dataclass(frozen=True)
class _RepoState:
    """A submodule's refs, FETCH_HEAD and branch or detached HEAD, to put back."""

    repo: Path
    refs: dict[str, str]
    branch: str | None
    fetch_head: bytes | None
    head: str | None = None

    @classmethod
    def of(cls, repo: Path) -> _RepoState:
        listing = gitcmd.run(repo, "for-each-ref", "--format=%(objectname) %(refname)")
        refs = dict(reversed(line.split(" ", 1)) for line in listing.splitlines() if line)
        branch = gitcmd.run_raw(repo, "symbolic-ref", "-q", "HEAD").stdout.strip() or None
        head = gitcmd.run_raw(repo, "rev-parse", "-q", "--verify", "HEAD").stdout.strip() or None
        git_dir = Path(gitcmd.run(repo, "rev-parse", "--absolute-git-dir").strip())
        fetch_head = git_dir / "FETCH_HEAD"
        data = fetch_head.read_bytes() if fetch_head.exists() else None
        return cls(repo, refs, branch, data, head)

    def restore(self) -> None:
        now = RepoRefs(self.repo)
        for ref in now.names - set(self.refs):
            gitcmd.run_raw(self.repo, "update-ref", "-d", ref)
        for ref, commit in self.refs.items():
            if now.get(ref) != commit:
                gitcmd.run_raw(self.repo, "update-ref", ref, commit)
        git_dir = Path(gitcmd.run(self.repo, "rev-parse", "--absolute-git-dir").strip())
        fetch_head = git_dir / "FETCH_HEAD"
        if self.fetch_head is None:
            fetch_head.unlink(missing_ok=True)
        else:
            fetch_head.write_bytes(self.fetch_head)
        current = gitcmd.run_raw(self.repo, "symbolic-ref", "-q", "HEAD").stdout.strip()
        now = gitcmd.run_raw(self.repo, "rev-parse", "-q", "--verify", "HEAD").stdout.strip()
        if self.branch and current != self.branch:
            gitcmd.run_raw(self.repo, "checkout", "-q", self.branch.removeprefix("refs/heads/"))
        elif not self.branch and self.head and (current or now != self.head):
            gitcmd.run_raw(self.repo, "checkout", "-q", "--detach", self.head)
        else:
            return
        gitcmd.run_raw(self.repo, "submodule", "update", "-q", "--recursive")


class RepoRefs:
    def __init__(self, repo: Path):
        listing = gitcmd.run(repo, "for-each-ref", "--format=%(objectname) %(refname)")
        self.refs = dict(reversed(line.split(" ", 1)) for line in listing.splitlines() if line)
        self.names = set(self.refs)

    def get(self, ref: str) -> str | None:
        return self.refs.get(ref)


def snapshot(root: Path) -> dict[Path, bytes]:
    files = [root / "pyproject.toml", root / "uv.lock"]
    return {f: f.read_bytes() for f in files if f.is_file()}


def restore(root: Path, path: str, head: str | None, files: dict[Path, bytes]) -> None:
    gitcmd.run_raw(root, "reset", "-q", "--", path, *[f.name for f in files])
    for file, data in files.items():
        if not file.is_file() or file.read_bytes() != data:  # untouched: not even its mtime
            file.write_bytes(data)
    if head:
        gitcmd.run_raw(root / path, "checkout", "-q", "--detach", head)
        gitcmd.run_raw(root / path, "submodule", "update", "-q", "--init", "--recursive")
