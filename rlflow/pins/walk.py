"""Nested git submodules -> pyproject.toml files and the state of each submodule.

The gitlink is read from the parent's index (what the next commit records), not from HEAD,
so a staged submodule bump checks clean in a pre-commit hook. Each level costs one
`git ls-files` in the parent and one `git status` per submodule; gitpython (about 0.1 s to
import) is loaded only when the repository has a .gitmodules file.
"""

from __future__ import annotations

import configparser
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.pins.model import Checkout, Location, Submodule

_SECTION = re.compile(r'^\s*\[\s*submodule\s+"(?P<name>(?:[^"\\]|\\.)*)"\s*\]')
_PATH_KEY = re.compile(r"^\s*path\s*=", re.IGNORECASE)


@dataclass(frozen=True)
class _Declared:
    path: str  # relative to the parent repository
    location: Location


def walk(start: Path) -> Checkout:
    """The repository containing `start`, its root pyproject and every submodule below it."""
    root = find_root(start)
    if not (root / "pyproject.toml").is_file():
        raise RlflowError(
            Diagnostic(
                "RF101",
                f"no pyproject.toml at the repository root `{root}`",
                help="check-pins compares submodule pins with the root pyproject.toml; run it in "
                "(or pass --repo) a uv project",
            )
        )
    pyprojects, submodules = [""], []
    if (root / ".gitmodules").is_file():
        try:
            import git  # heavy-ish: only repositories with submodules need it
        except ImportError as err:  # gitpython refuses to load without a git executable
            raise RlflowError(
                Diagnostic(
                    "RF106",
                    f"cannot run git: {err}".splitlines()[0],
                    help="install git (or set GIT_PYTHON_GIT_EXECUTABLE)",
                )
            ) from None
        _walk_level(git, root, "", pyprojects, submodules, seen=set())
    return Checkout(root, tuple(pyprojects), tuple(submodules))


def find_root(start: Path) -> Path:
    """The working tree root above `start`, like `git rev-parse --show-toplevel`."""
    start = start.expanduser()
    if not start.is_dir():
        raise RlflowError(
            Diagnostic(
                "RF100",
                f"`{start}` is not a directory",
                help="pass --repo the path of a git checkout",
            )
        )
    for directory in [start.resolve(), *start.resolve().parents]:
        marker = directory / ".git"
        if (marker / "HEAD").is_file() or (marker.is_file() and _is_gitdir_file(marker)):
            return directory
    raise RlflowError(
        Diagnostic(
            "RF100",
            f"`{start}` is not inside a git repository",
            help="check-pins reads submodules through git: run it in a clone (`git init` for a new "
            "project)",
        )
    )


def _is_gitdir_file(marker: Path) -> bool:
    try:
        return marker.read_text(encoding="utf-8", errors="replace").startswith("gitdir:")
    except OSError:
        return False


def _walk_level(
    git,
    root: Path,
    parent_rel: str,
    pyprojects: list[str],
    submodules: list[Submodule],
    seen: set[Path],
) -> None:
    parent_abs = root / parent_rel
    if parent_abs.resolve() in seen:
        return
    seen.add(parent_abs.resolve())
    declared = read_gitmodules(git, root, parent_rel)
    if not declared:
        return
    with _open_repo(git, parent_abs, parent_rel or ".") as parent:
        gitlinks = _gitlinks(git, parent, [d.path for d in declared], parent_rel)
    for entry in declared:
        if entry.path not in gitlinks:
            continue  # listed in .gitmodules but not a submodule in the index: git ignores it too
        rel = posixpath.join(parent_rel, entry.path) if parent_rel else entry.path
        submodule = _inspect(git, root, rel, entry, gitlinks[entry.path])
        submodules.append(submodule)
        if not submodule.initialized:
            continue
        if (root / rel / "pyproject.toml").is_file():
            pyprojects.append(rel)
        if (root / rel / ".gitmodules").is_file():
            _walk_level(git, root, rel, pyprojects, submodules, seen)


def _inspect(git, root: Path, rel: str, entry: _Declared, gitlink: str) -> Submodule:
    sub_abs = root / rel
    if not (sub_abs / ".git").exists():
        return Submodule(rel, entry.location, gitlink, head=None)
    with _open_repo(git, sub_abs, rel) as repo:
        try:
            status = repo.git(no_optional_locks=True).status(
                "--porcelain=v2", "--branch", "--", "pyproject.toml"
            )
        except git.GitCommandError as err:
            raise _git_failed(rel, err) from None
    head, dirty = None, False
    for line in status.splitlines():
        if line.startswith("# branch.oid "):
            oid = line.split()[-1]
            head = oid if oid != "(initial)" else "(no commit)"
        elif line and not line.startswith("#"):
            dirty = True
    return Submodule(rel, entry.location, gitlink, head=head, pyproject_dirty=dirty)


def _gitlinks(git, repo, paths: list[str], parent_rel: str) -> dict[str, str]:
    """path -> commit for the paths that the parent's index records as submodules."""
    try:
        out = repo.git(literal_pathspecs=True).ls_files("--stage", "-z", "--", *paths)
    except git.GitCommandError as err:
        raise _git_failed(parent_rel or ".", err) from None
    links = {}
    for record in out.split("\0"):
        meta, _, path = record.partition("\t")
        fields = meta.split()
        if len(fields) == 3 and fields[0] == "160000":
            links[path] = fields[1]
    return links


class _open_repo:
    """`git.Repo` as a context manager that turns git's exceptions into diagnostics."""

    def __init__(self, git, path: Path, rel: str):
        self.git, self.path, self.rel = git, path, rel

    def __enter__(self):
        try:
            self.repo = self.git.Repo(self.path)
        except (self.git.InvalidGitRepositoryError, self.git.NoSuchPathError):
            raise RlflowError(
                Diagnostic(
                    "RF106",
                    f"`{self.rel}` has a .git but is not a usable git repository",
                    help=f"re-create it: `git submodule deinit -f {self.rel} && "
                    f"git submodule update --init --recursive {self.rel}`",
                )
            ) from None
        return self.repo

    def __exit__(self, *exc) -> None:
        self.repo.close()


def _git_failed(rel: str, err) -> RlflowError:
    stderr = (getattr(err, "stderr", "") or "").strip().strip("'").strip()
    return RlflowError(
        Diagnostic(
            "RF106",
            f"git failed in `{rel}`: {stderr or err}",
            help="check that `git status` works there",
        )
    )


def read_gitmodules(git, root: Path, parent_rel: str) -> list[_Declared]:
    """The submodules a .gitmodules declares, with the line of each `path =`; bad file -> exit 2."""
    rel_file = posixpath.join(parent_rel, ".gitmodules") if parent_rel else ".gitmodules"
    parser = git.GitConfigParser(str(root / rel_file), read_only=True)
    try:
        sections = {
            s: parser.get(s, "path") if parser.has_option(s, "path") else ""
            for s in parser.sections()
        }
        text = (root / rel_file).read_text(encoding="utf-8")
    except (configparser.Error, OSError, ValueError) as err:
        line = getattr(err, "lineno", None) or _first_error_line(err)
        raise _bad_gitmodules(rel_file, line, str(err).splitlines()[0]) from None
    lines = text.splitlines()
    out = []
    for section, path in sections.items():
        match = re.fullmatch(r'submodule\s+"(.*)"', section.strip())
        if not match or not path:
            continue
        line = _path_line(lines, match.group(1))
        out.append(_Declared(_safe_path(path.strip(), rel_file, line), Location(rel_file, line)))
    return out


def _first_error_line(err: configparser.Error) -> int | None:
    errors = getattr(err, "errors", None)
    return errors[0][0] if errors else None


def _path_line(lines: list[str], name: str) -> int | None:
    """Line of `path =` inside the section of submodule `name`."""
    inside = False
    for number, text in enumerate(lines, start=1):
        section = _SECTION.match(text)
        if section:
            inside = section.group("name") == name
        elif text.lstrip().startswith("["):
            inside = False
        elif inside and _PATH_KEY.match(text):
            return number
    return None


def _safe_path(path: str, rel_file: str, line: int | None) -> str:
    normalized = posixpath.normpath(path) if path else ""
    if (
        not normalized
        or normalized == "."
        or normalized.startswith(("/", "../"))
        or normalized == ".."
    ):
        raise _bad_gitmodules(
            rel_file, line, f"submodule path `{path}` is not inside the repository"
        )
    return normalized


def _bad_gitmodules(rel_file: str, line: int | None, reason: str) -> RlflowError:
    return RlflowError(
        Diagnostic(
            "RF105",
            f"malformed `{rel_file}`: {reason}",
            file=rel_file,
            line=line,
            help="fix it so that `git config -f .gitmodules --list` reads it",
        )
    )
