"""`rlflow bump SUBMODULE REF`: move a submodule and every pin that must follow it, in one commit.

    1. refuse a dirty tree (the commit must contain the bump and nothing else)
    2. fetch the submodule's remote with the .gitmodules URL (never a fork that origin may be);
       REF is a branch of it (`<remote>/REF`), a tag or a commit
    3. check it out, and its nested submodules at the commits it records
    4. mirror into the root pyproject every pin that now disagrees (what `check-pins --fix`
       would move: lockstep pins, git revs, exact versions, index URLs), tomlkit keeping layout
    5. `uv lock` when the root has a uv.lock (the real uv)
    6. check-pins on the result; then one commit whose message lists every pin moved

Anything that fails (Ctrl-C too) puts the submodule, the pyproject and the lock back as they
were: the branch or detached HEAD, refs and FETCH_HEAD of the submodule and of every nested one,
and nested ones it had to initialize de-initialized. `--dry-run` does steps 2-4 to learn the
plan, prints it, and puts everything back the same way.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError
from rlflow.pins import gitcmd
from rlflow.pins.bump_state import TreeState, restore, snapshot


@dataclass(frozen=True)
class Move:
    path: str
    old: str | None
    new: str | None


@dataclass(frozen=True)
class PinMove:
    package: str
    old: str
    new: str
    where: str
    description: str

    def line(self) -> str:
        return f"{self.package}: {self.old} -> {self.new} ({self.where})"


@click.command("bump")
@click.argument("submodule")
@click.argument("ref")
@click.option(
    "--repo",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("."),
    help="The repository (or any directory inside it).  [default: .]",
)
@click.option("--dry-run", is_flag=True, help="Show the plan; change nothing.")
@click.pass_context
def bump(ctx: click.Context, submodule: str, ref: str, repo: Path, dry_run: bool) -> None:
    """Move SUBMODULE to REF and the root pins that follow it, in one commit.

    \b
    REF is a branch of the submodule's remote with its .gitmodules URL (fetched first),
    a tag, or a commit.
    Nested submodules move to the commits REF records. Root pins that would disagree with
    the submodule afterwards (lockstep pins, git revs, exact versions) are moved in
    pyproject.toml with its layout kept; uv.lock is re-locked with `uv lock` if there is one;
    check-pins must pass; then one commit lists every pin moved. A dirty tree is refused.

    \b
    Examples:
      rlflow bump submodules/Megatron-Bridge main --dry-run
      rlflow bump submodules/Megatron-Bridge v0.7.0
    """
    ctx.exit(run_bump(repo, submodule, ref, dry_run))


def run_bump(repo: Path, submodule: str, ref: str, dry_run: bool) -> int:
    """SIGTERM and SIGHUP (a CI job's timeout, a closed terminal) end a bump like Ctrl-C does:
    through the restore, not past it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _run_bump(repo, submodule, ref, dry_run)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    saved = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run_bump(repo, submodule, ref, dry_run)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _run_bump(repo: Path, submodule: str, ref: str, dry_run: bool) -> int:
    from rlflow.pins.walk import find_root, walk

    root = find_root(repo)
    path = submodule.strip("/").removeprefix("./")
    _refuse_dirty(root)
    checkout = walk(root)
    sub = next((s for s in checkout.submodules if s.path == path), None)
    if sub is None:  # a path relative to the current directory, as git takes it
        import os

        here = Path(os.path.abspath(submodule))
        if here.is_relative_to(root.resolve()) or here.is_relative_to(root):
            base = root.resolve() if here.is_relative_to(root.resolve()) else root
            path = here.relative_to(base).as_posix()
            sub = next((s for s in checkout.submodules if s.path == path), None)
    if sub is None or sub.declared_at.file != ".gitmodules":
        known = ", ".join(
            s.path for s in checkout.submodules if s.declared_at.file == ".gitmodules"
        )
        raise _usage(
            f"`{submodule}` is not a submodule of the repository root",
            f"bump one of: {known or '(none)'}; a nested submodule moves with its parent",
        )
    if not sub.initialized:
        raise _usage(
            f"submodule `{path}` is not initialized",
            f"run `git submodule update --init --recursive {path}` first",
        )
    sub_dir = root / path
    # Refs, FETCH_HEAD, branch or detached HEAD of the submodule and of every nested one, and
    # which nested ones were not initialized: what a dry run or a failure puts back.
    state = TreeState.of(root, checkout, path)
    try:
        target, label = _resolve(sub_dir, ref, _declared_url(root, sub), path)
    except BaseException:  # a bad REF, an unreachable remote, Ctrl-C during the fetch
        state.restore()
        raise
    before = _gitlinks_below(root, checkout, path)
    files = snapshot(root)
    moved_submodule = False
    if target == sub.head:
        try:
            plan = _plan(root, path, before)
        except BaseException:  # a pin that needs a decision, Ctrl-C: the fetch is undone too
            state.restore()
            raise
        if not plan.pins and plan.new_text == plan.old_text:
            if dry_run:
                state.restore()
            print(f"nothing to do: {path} is already at {label} ({target[:12]}) and the pins agree")
            return 0
    try:
        moved_submodule = True  # from here on, a failure puts the submodule back
        _checkout(sub_dir, target, path)
        plan = _plan(root, path, before)
        if dry_run:
            _print_plan(path, label, plan, root, dry_run=True)
            return 0
        _apply(root, path, plan)
        _print_plan(path, label, plan, root, dry_run=False)
        message = _message(path, label, target, plan)
        gitcmd.run(root, "add", "--", path, "pyproject.toml", *_lock_files(root))
        done = subprocess.run(
            ["git", "commit", "-q", "-F", "-"],
            cwd=root,
            input=message,
            text=True,
            env=gitcmd.clean_env(),
            capture_output=True,
        )
        if done.returncode != 0 and "nothing to commit" in (done.stdout + done.stderr):
            print(f"nothing to do: {path} at {label} ({target[:12]}) is what the root records")
            return 0
        if done.returncode != 0:
            raise RlflowError(
                Diagnostic(
                    "RF108",
                    f"`git commit` refused the bump: {(done.stderr or done.stdout).strip()}",
                    help="nothing was committed; the tree was put back as it was",
                ),
                exit_code=EXIT_FINDINGS,
            )
        print(f"committed: {message.splitlines()[0]}")
        moved_submodule = False  # committed: keep it
        return 0
    finally:
        if moved_submodule:
            restore(root, path, sub.head, files)
        if moved_submodule or dry_run:
            state.restore()


# -- steps ------------------------------------------------------------------------------------
def _refuse_dirty(root: Path) -> None:
    # Changes to tracked files, submodules included; untracked files never get into the commit.
    status = gitcmd.run(
        root, "status", "--porcelain", "--untracked-files=no", "--ignore-submodules=untracked"
    )
    dirty = [line for line in status.splitlines() if line.strip()]
    if dirty:
        shown = "\n".join(f"  {line}" for line in dirty[:10])
        raise _usage(
            f"the working tree has uncommitted changes:\n{shown}",
            "commit or stash them first: the bump commit must contain the bump and nothing else",
        )


def _declared_url(root: Path, sub) -> str | None:
    from rlflow.pins.refs import declared_url

    return declared_url(root, sub)


def _resolve(
    sub_dir: Path, ref: str, url: str | None = None, path: str | None = None
) -> tuple[str, str]:
    """REF -> (commit, how it was named), after fetching the submodule's remote: the remote
    whose URL is the .gitmodules one (what a fresh clone fetches from), never a fork."""
    from rlflow.pins import refs

    config = refs.remote_config(sub_dir)
    remotes = list(config.urls)
    if url:
        matching = refs.matching_remotes(config, url)
        if not matching:
            name = next(
                (n for n in ("upstream", "approved", "rlflow-bump") if n not in config.urls),
                "declared",
            )
            shown = ", ".join(f"`{r}` = {config.urls[r]}" for r in remotes) or "none"
            raise _usage(
                f"no remote of `{sub_dir.name}` has the URL its .gitmodules declares, `{url}` "
                f"(its remotes: {shown}): a commit fetched from elsewhere (a fork) is one that a "
                "fresh clone cannot fetch",
                f"add it: `git -C {shlex.quote(path or str(sub_dir))} remote add {name} "
                f"{shlex.quote(url)}`, then bump again",
            )
        remote = matching[0]
    else:
        remote = "origin" if "origin" in remotes or not remotes else remotes[0]
    if remotes:
        done = gitcmd.run_raw(sub_dir, "fetch", "-q", "--tags", remote)
        if done.returncode != 0:
            raise _usage(
                f"cannot fetch `{remote}` in `{sub_dir.name}`: {done.stderr.strip()}",
                "check the network and the submodule's remote URL",
            )
    for candidate, label in (
        (f"refs/remotes/{remote}/{ref}", f"{remote}/{ref}"),
        (f"refs/tags/{ref}", ref),
        (ref, ref),
    ):
        done = gitcmd.run_raw(sub_dir, "rev-parse", "--verify", "--quiet", candidate + "^{commit}")
        if done.returncode == 0 and not ref.startswith("-"):
            return done.stdout.strip(), label
    raise _usage(
        f"`{ref}` is not a branch of `{remote}`, a tag or a commit of `{sub_dir.name}`",
        f"list them: `git -C {sub_dir.name} branch -r` / `git -C {sub_dir.name} tag`",
    )


def _checkout(sub_dir: Path, commit: str, path: str) -> None:
    for args in (
        ("checkout", "-q", "--detach", commit),
        ("submodule", "update", "-q", "--init", "--recursive"),
    ):
        done = gitcmd.run_raw(sub_dir, *args)
        if done.returncode != 0:  # git's own words name the files (untracked ones in the way)
            said = [line.strip() for line in done.stderr.strip().splitlines() if line.strip()]
            raise RlflowError(
                Diagnostic(
                    "RF108",
                    f"`git {' '.join(args[:2])}` of {commit[:12]} failed in `{path}`: "
                    + (said[0] if said else "no output"),
                    notes=tuple(said[1:20]),
                    help=f"nothing was changed; fix what git says (`git -C {shlex.quote(path)} "
                    "status` shows untracked files in the way), then bump again",
                )
            )


def _gitlinks_below(root: Path, checkout, path: str) -> dict[str, str | None]:
    return {
        s.path: s.head
        for s in checkout.submodules
        if s.path == path or s.path.startswith(path + "/")
    }


@dataclass(frozen=True)
class Plan:
    moves: tuple[Move, ...]
    pins: tuple[PinMove, ...]
    new_text: str
    old_text: str
    relock: bool
    analysis: object


def _plan(root: Path, path: str, before: dict[str, str | None]) -> Plan:
    from rlflow.pins import fix
    from rlflow.pins.check import _read_root, analyse
    from rlflow.pins.walk import walk

    checkout = walk(root)
    after = _gitlinks_below(root, checkout, path)
    moves = tuple(
        Move(p, before.get(p), after.get(p))
        for p in sorted(set(before) | set(after))
        if before.get(p) != after.get(p)
    )
    text = _read_root(root)
    analysis = analyse(checkout, text, strict=False)
    plans = [(f, fix.plan(f, analysis.findings)) for f in analysis.findings]
    refused = [(f, p) for f, p in plans if isinstance(p, fix.Refusal)]
    if refused:
        reasons = "; ".join(f"[{f.code}] `{f.package}`: {p.reason}" for f, p in refused)
        raise RlflowError(
            Diagnostic(
                "RF108",
                f"cannot move the root pins with the submodule: {reasons}",
                help="nothing was changed; decide these pins by hand, commit, then bump again",
            ),
            exit_code=EXIT_FINDINGS,
        )
    from rlflow.pins.report import short_value

    pins = tuple(
        PinMove(
            f.package,
            short_value(f.ours, f.theirs[0]),
            short_value(f.theirs[0], f.ours),
            str(f.ours.location),
            p.description,
        )
        for f, p in plans
        if isinstance(p, fix.Edit)
    )
    edits = [p for _, p in plans if isinstance(p, fix.Edit)]
    new_text = fix.apply(text, edits) if edits else text
    return Plan(moves, pins, new_text, text, (root / "uv.lock").is_file(), analysis)


def _apply(root: Path, path: str, plan: Plan) -> None:
    from rlflow.pins import fix
    from rlflow.pins.check import _read_root, analyse
    from rlflow.pins.report import print_text
    from rlflow.pins.walk import walk

    if plan.new_text != plan.old_text:
        fix.write_atomically(root / "pyproject.toml", plan.new_text, plan.old_text)
    if plan.relock:
        _uv_lock(root)
    gitcmd.run(root, "add", "--", path)  # the gitlink the commit will record
    analysis = analyse(walk(root), _read_root(root), strict=False)
    if analysis.exit_code != 0:
        print_text(analysis.findings, analysis.allowed, analysis.checked, root, stream=sys.stderr)
        raise RlflowError(
            Diagnostic(
                "RF108",
                "check-pins fails after the bump (above); nothing was committed",
                help="the tree was put back as it was; fix the pins by hand and bump again",
            ),
            exit_code=EXIT_FINDINGS,
        )


def _uv_lock(root: Path) -> None:
    beside = Path(sys.executable).parent / "uv"  # the uv installed with rlflow, then PATH's
    uv = str(beside) if beside.is_file() else (shutil.which("uv") or "uv")
    try:
        done = subprocess.run(
            [uv, "lock"], cwd=root, capture_output=True, text=True, env=gitcmd.clean_env()
        )
    except FileNotFoundError:
        raise _usage("the project has a uv.lock but `uv` is not installed", "install uv") from None
    if done.returncode != 0:
        raise RlflowError(
            Diagnostic(
                "RF108",
                "`uv lock` failed after the bump: " + done.stderr.strip().splitlines()[-1]
                if done.stderr.strip()
                else "`uv lock` failed after the bump",
                notes=tuple(done.stderr.strip().splitlines()[:20]),
                help="nothing was committed; the tree was put back as it was",
            ),
            exit_code=EXIT_FINDINGS,
        )


def _lock_files(root: Path) -> list[str]:
    return ["uv.lock"] if (root / "uv.lock").is_file() else []


def _print_plan(path: str, label: str, plan: Plan, root: Path, dry_run: bool) -> None:
    head = "plan (--dry-run: nothing changed)" if dry_run else "bump"
    lines = [f"{head}: {path} -> {label}"]
    for move in plan.moves:
        lines.append(f"  move {move.path}: {_short(move.old)} -> {_short(move.new)}")
    moved = "pins a bump would move" if dry_run else "pins moved"
    if plan.pins:
        lines.append(f"{moved} in pyproject.toml:")
        lines += [f"  {p.line()}: {p.description}" for p in plan.pins]
    else:
        lines.append(f"{moved} in pyproject.toml: none")
    relock = "a bump would re-lock it with `uv lock`" if dry_run else "re-locked with `uv lock`"
    lines.append(f"uv.lock: {relock}" if plan.relock else "uv.lock: none")
    print("\n".join(lines))


def _message(path: str, label: str, commit: str, plan: Plan) -> str:
    title = f"Bump {path} to {label} ({commit[:12]})"
    body = [f"{m.path}: {_short(m.old)} -> {_short(m.new)}" for m in plan.moves]
    body.append("")
    if plan.pins:
        body.append("Pins moved in pyproject.toml:")
        body += [f"- {p.line()}" for p in plan.pins]
    else:
        body.append("Pins moved in pyproject.toml: none")
    if plan.relock:
        body.append("uv.lock re-locked with `uv lock`.")
    return title + "\n\n" + "\n".join(body) + "\n"


def _short(commit: str | None) -> str:
    return commit[:12] if commit else "(none)"


def _usage(message: str, help: str) -> RlflowError:
    return RlflowError(Diagnostic("RF108", message, help=help))
