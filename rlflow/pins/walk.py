"""Nested git submodules -> pyproject.toml files and the state of each submodule.

The gitlink is read from the parent's index (what the next commit records), not from HEAD, so
a staged submodule bump checks clean in a pre-commit hook; inside a hook, the root reads the
index that git is committing (`commit -a` and `commit <paths>` use a temporary one). Every git
call runs with a clean environment (gitcmd.py). Each level costs one `git ls-files` in the
parent and one `git status` per initialized submodule; a .gitmodules is read the way git reads
it, by gitconfig.py where it keeps to git's plain form, else by `git config`. All of it is
linear in the number of submodules. A level's calls, and every submodule's `git status` and
its own level's calls, start together before any is read (they are independent), so the
processes overlap instead of running one after another.

Anything that hides submodules from the check is unusable input (exit 2), never a silent "ok":
a .gitmodules git cannot read, a gitlink with no .gitmodules entry, a submodule pyproject.toml
that is a directory, a device or a symlink loop.
"""

from __future__ import annotations

import errno
import posixpath
import re
import stat
import subprocess
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError, file_error
from rlflow.pins import gitcmd, gitconfig, records
from rlflow.pins.model import Checkout, Location, Submodule

_SECTION = re.compile(r'^\s*\[\s*submodule\s+"(?P<name>(?:[^"\\]|\\.)*)"\s*\]', re.IGNORECASE)
_PATH_KEY = re.compile(r"^\s*path\s*=", re.IGNORECASE)
_BAD_LINE = re.compile(r"bad config line (\d+)")
WINDOW = 16  # submodules whose git calls run at once


@records.record
class _Declared:
    name: str
    path: str  # relative to the parent repository
    location: Location
    url: str | None = None


def walk(start: Path) -> Checkout:
    """The repository containing `start`, its root pyproject and every submodule below it."""
    root = find_root(start)
    kind = _file_kind(root / "pyproject.toml")
    if kind == "missing":
        raise _unchecked(
            "RF101",
            f"no pyproject.toml at the repository root `{root}`",
            "check-pins compares submodule pins with the root pyproject.toml; run it in "
            "(or pass --repo) a uv project",
        )
    if kind != "file":
        raise RlflowError(
            Diagnostic(
                "RF102",
                f"cannot read pyproject.toml: it is {kind}",
                file="pyproject.toml",
                help="the root pyproject.toml must be a regular file",
            )
        )
    pyprojects, submodules = [""], []
    index = _hook_index(root)
    try:
        _walk_level(root, "", pyprojects, submodules, seen=set(), index_file=index)
    finally:
        gitcmd.reap()
    return Checkout(root, tuple(pyprojects), tuple(submodules))


def find_root(start: Path) -> Path:
    """The working tree root above `start`, like `git rev-parse --show-toplevel`."""
    start = start.expanduser()
    if not start.is_dir():
        raise _unchecked(
            "RF100", f"`{start}` is not a directory", "pass --repo the path of a git checkout"
        )
    separate = _separate_git_dir(start.resolve())
    if separate is not None:
        return separate
    for directory in [start.resolve(), *start.resolve().parents]:
        marker = directory / ".git"
        if (marker / "HEAD").is_file() or (marker.is_file() and _gitdir_of(marker)):
            return directory
    raise _unchecked(
        "RF100",
        f"`{start}` is not inside a git repository",
        "check-pins reads submodules through git: run it in a clone (`git init` for a new project)",
    )


def _unchecked(code: str, message: str, fix: str) -> RlflowError:
    """No checkout to compare (a missing root or pyproject): the check did not run, which is
    not a finding."""
    return RlflowError(Diagnostic(code, message, help=fix, category="pins-unchecked"))


def _separate_git_dir(start: Path) -> Path | None:
    """A work tree whose repository lives elsewhere, as git itself finds it from `GIT_DIR` (git
    sets it for the hooks of such a setup) with `GIT_WORK_TREE` or the repository's
    `core.worktree`, when `start` is in that work tree and it has no `.git` of its own."""
    import os

    if not os.environ.get("GIT_DIR"):
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_INDEX_FILE", "GIT_PREFIX")}
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--path-format=absolute", "--show-toplevel", "--git-dir"],
            cwd=start,
            env=env,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        return None
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 2:
        return None
    top, git_dir = Path(lines[0]).resolve(), Path(lines[1]).resolve()
    if (top / ".git").exists() or not (start == top or start.is_relative_to(top)):
        return None
    gitcmd.SEPARATE_GIT_DIRS[str(top)] = str(git_dir)
    return top


def _gitdir_of(marker: Path) -> Path | None:
    """The directory a `.git` file points to (`gitdir: ...`), else None."""
    try:
        text = marker.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    if not text.startswith("gitdir:"):
        return None
    return (marker.parent / text[len("gitdir:") :].strip()).resolve()


def _hook_index(root: Path) -> str | None:
    """The index a running `git commit` of this repository is about to record, if any."""
    index = gitcmd.hook_index_file()
    if index is None:
        return None
    marker = root / ".git"
    separate = gitcmd.SEPARATE_GIT_DIRS.get(str(root.resolve()))
    git_dir = (
        Path(separate)
        if separate
        else (marker.resolve() if marker.is_dir() else _gitdir_of(marker))
    )
    if git_dir is None or not Path(index).resolve().is_relative_to(git_dir):
        return None  # another repository's hook: not ours to read
    return index


def _walk_level(
    root: Path,
    parent_rel: str,
    pyprojects: list[str],
    submodules: list[Submodule],
    seen: set[Path],
    index_file: str | None = None,
    begun: tuple | None = None,
) -> None:
    parent_abs = root / parent_rel
    if parent_abs.resolve() in seen:
        return
    seen.add(parent_abs.resolve())
    config, ls_files = begun or _begin_level(root, parent_rel, index_file)
    declared = read_gitmodules(root, parent_rel, config)
    gitlinks = _gitlinks(parent_abs, ls_files)
    by_path = {d.path: d for d in declared}
    rel_file = posixpath.join(parent_rel, ".gitmodules") if parent_rel else ".gitmodules"
    for path in gitlinks:
        if path not in by_path:
            raise _unlisted_gitlink(root, rel_file, path, gitlinks[path])
    entries = [e for e in declared if e.path in gitlinks]  # else git ignores the entry too
    listed = (
        gitcmd.start(parent_abs, "ls-tree", "-z", "HEAD", "--", *gitlinks)
        if parent_rel and gitlinks
        else None
    )
    committed = None
    for first in range(0, len(entries), WINDOW):
        # These submodules' `git status` and their own levels' calls start now, before any is
        # read; WINDOW at a time, so a tree of thousands of submodules stays within fd limits.
        started = [
            (entry, *_begin_submodule(root, parent_rel, entry))
            for entry in entries[first : first + WINDOW]
        ]
        if committed is None:
            committed = _committed_gitlinks(listed) if listed is not None else {}
        _read_submodules(
            root, parent_rel, started, gitlinks, committed, pyprojects, submodules, seen
        )


def _read_submodules(root, parent_rel, started, gitlinks, committed, pyprojects, submodules, seen):
    for entry, rel, status, below in started:
        submodule = _inspect(root, rel, entry, gitlinks[entry.path], status)
        if parent_rel:  # what the parent submodule's own commit records (the hook compares)
            submodule = records.replace(submodule, committed=committed.get(entry.path, ""))
        submodules.append(submodule)
        if not submodule.initialized:
            continue
        if _submodule_pyproject(root, rel, entry):
            pyprojects.append(rel)
        _walk_level(root, rel, pyprojects, submodules, seen, begun=below)


def _begin_level(root: Path, rel: str, index_file: str | None = None) -> tuple:
    """The git calls that read one repository of the tree, begun together (gitcmd.start):
    its .gitmodules (None when it has none; its records when gitconfig.py reads it, else
    `git config` begun) and `git ls-files` of its index."""
    path = root / (posixpath.join(rel, ".gitmodules") if rel else ".gitmodules")
    config = _begin_config(root, path) if _file_kind(path) == "file" else None
    return config, gitcmd.start(root / rel, "ls-files", "--stage", "-z", index_file=index_file)


def _begin_config(root: Path, path: Path) -> list | subprocess.Popen | None:
    try:
        records = gitconfig.plain_records(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None  # read_gitmodules says why
    return records if records is not None else _start_config(root, path)


def _start_config(root: Path, path: Path) -> subprocess.Popen:
    return gitcmd.start(root, "config", "-f", str(path), "-z", "--list")


def _begin_submodule(root: Path, parent_rel: str, entry: _Declared):
    """(rel, its `git status`, its level) started; (rel, None, None) when not initialized."""
    rel = posixpath.join(parent_rel, entry.path) if parent_rel else entry.path
    if not (root / rel / ".git").exists():
        return rel, None, None
    status = gitcmd.start(
        root / rel, "status", "--porcelain=v2", "--branch", "--", "pyproject.toml"
    )
    return rel, status, _begin_level(root, rel)


def _inspect(
    root: Path, rel: str, entry: _Declared, gitlink: str, status: subprocess.Popen | None
) -> Submodule:
    if status is None:
        return Submodule(rel, entry.location, gitlink, head=None, url=entry.url)
    done = gitcmd.finish(status)
    if done.returncode != 0:
        raise RlflowError(
            Diagnostic(
                "RF106",
                f"`{rel}` has a .git but git cannot read it: {_last_line(done.stderr)}",
                file=entry.location.file,
                line=entry.location.line,
                help=f"re-create it: `git submodule deinit -f {rel} && "
                f"git submodule update --init --recursive {rel}`",
            )
        )
    head, dirty = None, False
    for line in done.stdout.splitlines():
        if line.startswith("# branch.oid "):
            oid = line.split()[-1]
            head = oid if oid != "(initial)" else "(no commit)"
        elif line and not line.startswith("#"):
            dirty = True
    return Submodule(rel, entry.location, gitlink, head=head, pyproject_dirty=dirty, url=entry.url)


def _committed_gitlinks(listed: subprocess.Popen) -> dict[str, str]:
    """path -> commit that the repository's HEAD records for each gitlink path (`git ls-tree`)."""
    done = gitcmd.finish(listed)
    links = {}
    for record in done.stdout.split("\0") if done.returncode == 0 else []:
        meta, _, path = record.partition("\t")
        if meta.startswith("160000 "):
            links[path] = meta.split()[2]
    return links


def _gitlinks(repo: Path, ls_files: subprocess.Popen) -> dict[str, str]:
    """path -> commit for every path the repository's index records as a submodule."""
    done = gitcmd.finish(ls_files)
    if done.returncode != 0:
        raise gitcmd.failed(repo, ("ls-files", "--stage"), done.stderr)
    links = {}
    for record in done.stdout.split("\0"):
        if record.startswith("160000 "):
            meta, _, path = record.partition("\t")
            links[path] = meta.split()[1]
    return links


def _file_kind(path: Path) -> str:
    """ "file", "missing", or what it is instead ("a directory", "a symlink loop", ...)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "a dangling symlink" if path.is_symlink() else "missing"
    except OSError as err:
        return "a symlink loop" if err.errno == errno.ELOOP else f"unreadable ({err.strerror})"
    if stat.S_ISREG(mode):
        return "file"
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, pipe or socket)"


def _submodule_pyproject(root: Path, rel: str, entry: _Declared) -> bool:
    kind = _file_kind(root / rel / "pyproject.toml")
    if kind in ("file", "missing"):
        return kind == "file"
    where = entry.location
    raise RlflowError(
        Diagnostic(
            "RF102",
            f"cannot read `{rel}/pyproject.toml`: it is {kind}, so the pins of submodule "
            f"`{rel}` cannot be checked",
            file=where.file,
            line=where.line,
            notes=(f"submodule `{rel}` is declared here",),
            help=f"make `{rel}/pyproject.toml` a regular file (or remove it) in the submodule",
        )
    )


def read_gitmodules(
    root: Path, parent_rel: str, config: list | subprocess.Popen | None = None
) -> list[_Declared]:
    """The submodules a .gitmodules declares, with the line of each `path =`; bad file -> exit 2.

    Values are git's: read by gitconfig.py when the file keeps to git's plain form (`config`
    may hold those records already), else by git itself (`git config -f`, begun as `config`
    or here), so quoting, escapes and case rules are git's; the line numbers come from one pass
    over the text.
    """
    rel_file = posixpath.join(parent_rel, ".gitmodules") if parent_rel else ".gitmodules"
    path = root / rel_file
    kind = _file_kind(path)
    if kind == "missing":
        return []
    if kind != "file":
        raise _bad_gitmodules(rel_file, None, f"it is {kind}")
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise _bad_gitmodules(rel_file, None, str(err)) from None
    records = config if isinstance(config, list) else gitconfig.plain_records(text)
    if records is None:
        records = _git_config(config or _start_config(root, path), rel_file)
    paths: dict[str, str] = {}
    urls: dict[str, str] = {}
    for key, value in records:
        if key.startswith("submodule.") and key.endswith(".path"):
            paths[key[len("submodule.") : -len(".path")]] = value
        elif key.startswith("submodule.") and key.endswith(".url"):
            urls[key[len("submodule.") : -len(".url")]] = value.strip()
    lines = _path_lines(text)
    out = []
    for name, value in paths.items():
        line = lines.get(name)
        out.append(
            _Declared(
                name,
                _safe_path(value.strip(), rel_file, line),
                Location(rel_file, line),
                urls.get(name),
            )
        )
    return out


def _git_config(config: subprocess.Popen, rel_file: str) -> list[tuple[str, str]]:
    """The (key, value) records `git config -z --list` printed; its error -> exit 2."""
    done = gitcmd.finish(config)
    if done.returncode != 0:
        match = _BAD_LINE.search(done.stderr)
        line = int(match.group(1)) if match else None
        raise _bad_gitmodules(rel_file, line, _last_line(done.stderr).removeprefix("fatal: "))
    return [tuple(record.partition("\n")[::2]) for record in done.stdout.split("\0")]


def _path_lines(text: str) -> dict[str, int]:
    """Submodule name -> line of its (last) `path =`, in one pass."""
    found, name = {}, None
    for number, line in enumerate(text.split("\n"), start=1):
        section = _SECTION.match(line)
        if section:
            name = re.sub(r"\\(.)", r"\1", section.group("name"))
        elif line.lstrip().startswith("["):
            name = None
        elif name is not None and _PATH_KEY.match(line):
            found[name] = number
    return found


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


def _unlisted_gitlink(root: Path, rel_file: str, path: str, commit: str) -> RlflowError:
    exists = _file_kind(root / rel_file) == "file"
    line = None
    if exists:
        line = max(len((root / rel_file).read_bytes().split(b"\n")), 1)
    return RlflowError(
        Diagnostic(
            "RF105",
            f"`{path}` is a submodule in git's index (commit {commit[:12]}) but "
            f"`{rel_file}` {'has no entry for it' if exists else 'does not exist'}: its pins "
            "cannot be checked, and `git submodule update` cannot clone it",
            file=rel_file,
            line=line,
            help=f"declare it: `git config -f {rel_file} submodule.{path}.path {path}` and "
            f"`git config -f {rel_file} submodule.{path}.url <url>`, or remove it from the "
            f"index: `git rm --cached {path}`",
        )
    )


def _bad_gitmodules(rel_file: str, line: int | None, reason: str) -> RlflowError:
    fix = "fix it so that `git config -f .gitmodules --list` reads it"
    return file_error("RF105", f"malformed `{rel_file}`: {reason}", rel_file, line, fix)


def _last_line(text: str) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1].strip() if lines else "no output"
