"""A pyproject.toml -> the record uv writes of it in uv.lock (what `uv lock --check` compares).

uv "lowers" each requirement before locking it: `[tool.uv.sources]` replace its source (a list
of sources split by markers becomes one entry per source, plus one for the markers none of them
covers), optional dependencies get `extra == '...'`, `{ workspace = true }` becomes the member's
directory, `{ include-group = ... }` is expanded, and paths are made absolute. The entries here
are that record in comparable form:

    Entry = (name, extras, source, marker tree)
    source = ("registry", specifier, index URL or None) | ("git", repo, ref kind, ref, subdir, lfs)
           | ("url", url, subdirectory) | ("path", editable|directory|path|virtual, absolute path)

Both sides of the comparison (this module for the pyproject, uvlock.py for the lock) produce
Entries; markers are compared by meaning (markers.py). Pure apart from looking at the paths
that sources name; reading pyproject.toml files and finding workspace members is workspace.py's.
"""

from __future__ import annotations

import os
import re
from functools import cache
from urllib.parse import parse_qs, unquote, urlsplit

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from rlflow.pins import markers, pep508, records
from rlflow.pins.pep508 import canonicalize_name
from rlflow.pins.workspace import Project, Undecidable


# -- the record of one project ----------------------------------------------------------------
@records.record
class Record:
    version: str | None  # None: dynamic
    requires_dist: list
    provides_extras: frozenset[str]
    requires_dev: dict[str, list]


def record(project: Project) -> Record:
    """What uv writes under [package.metadata] for this local project."""
    table = project.table
    dynamic = table.get("dynamic", []) if isinstance(table.get("dynamic"), list) else []
    for key in ("dependencies", "optional-dependencies"):
        if key in dynamic:
            raise Undecidable(
                f"`{project.directory}/pyproject.toml` computes `{key}` at build time "
                "(`dynamic`): only a build can tell what uv would record"
            )
    version = None if "version" in dynamic else table.get("version")
    dist = []
    for text in _strings(table.get("dependencies")):
        dist += lower(text, project)
    extras = table.get("optional-dependencies", {})
    extras = extras if isinstance(extras, dict) else {}
    for extra, items in extras.items():
        name = canonicalize_name(extra)
        for text in _strings(items):
            dist += lower(text, project, extra=name)
    return Record(
        version if isinstance(version, str) else None,
        dist,
        frozenset(canonicalize_name(e) for e in extras),
        groups(project),
    )


def groups(project: Project) -> dict[str, list]:
    """Dependency groups, `include-group` expanded, legacy dev-dependencies as `dev`; empty
    groups included."""
    raw = project.data.get("dependency-groups", {})
    raw = {canonicalize_name(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}
    legacy = project.uv.get("dev-dependencies")
    out: dict[str, list] = {}

    def expand(group: str, seen: tuple) -> list[str]:
        texts = []
        for item in raw.get(group, []) if isinstance(raw.get(group), list) else []:
            if isinstance(item, str):
                texts.append(item)
            elif (
                isinstance(item, dict)
                and set(item) == {"include-group"}
                and isinstance(item["include-group"], str)
            ):
                included = canonicalize_name(item["include-group"])
                if included in seen:
                    raise _malformed(
                        f"a cycle: {' -> '.join(f'`{g}`' for g in seen + (included,))}"
                    )
                if included not in raw:
                    raise _malformed(f"`{group}` includes `{included}`, which does not exist")
                texts += expand(included, seen + (included,))
            else:
                raise _malformed(f"`{group}` has the entry `{item!r}`")
        return texts

    def _malformed(what: str) -> Undecidable:
        where = os.path.join(project.directory, "pyproject.toml")
        return Undecidable(
            f"`{where}` [dependency-groups] is malformed ({what}); uv refuses it "
            "(`uv lock --check` exits 2)"
        )

    for group in raw:
        out[group] = [
            e for text in expand(group, (group,)) for e in lower(text, project, group=group)
        ]
    if isinstance(legacy, list):
        out.setdefault("dev", [])
        out["dev"] += [e for text in _strings(legacy) for e in lower(text, project, group="dev")]
    return out  # empty groups too: a lock of revision 1 or later records them (`dev = []`)


def lower(text: str, project: Project, extra: str | None = None, group: str | None = None) -> list:
    """One requirement string -> the entries uv records for it."""
    req = parse_requirement(text)
    name = canonicalize_name(req.name)
    extras = tuple(sorted(canonicalize_name(e) for e in req.extras))
    marker = markers.parse(str(req.marker)) if req.marker else markers.TRUE
    if extra:
        marker = markers.both(marker, markers.parse(f"extra == '{extra}'"))
    sources = project.sources.get(name)
    if sources is None:
        sources = project.workspace_sources.get(name)
    if project.no_sources:  # uv then locks every requirement as written, sources ignored
        sources = None
    if sources is not None:
        sources = [
            s
            for s in sources
            if (s.get("extra") is None or canonicalize_name(str(s["extra"])) == extra)
            and (s.get("group") is None or canonicalize_name(str(s["group"])) == group)
        ]
    if not sources:
        return [(name, extras, requirement_source(req, project.directory), marker)]
    out = []
    covered = []
    for source in sources:
        source_marker = markers.parse(source.get("marker"))
        covered.append(source_marker)
        out.append(
            (name, extras, source_key(source, req, project), markers.both(source_marker, marker))
        )
    remaining = markers.both(markers.negate(markers.either(covered)), marker)
    out.append((name, extras, requirement_source(req, project.directory), remaining))
    return [e for e in out if markers.satisfiable(e[3])]


def parse_requirement(text: str) -> pep508.Parsed:
    """PEP 508, plus what uv also accepts: `name @ URL; marker` without the space before `;`."""
    if not pep508.rejects_url_marker(text):  # else packaging refuses it: skip asking it
        try:
            return pep508.parse(text)
        except pep508.InvalidRequirement:
            pass
    try:
        return pep508.parse(re.sub(r"(\S);", r"\1 ;", text, count=1))
    except pep508.InvalidRequirement:
        raise Undecidable(f"cannot read the requirement `{text}`") from None


def requirement_source(req: pep508.Parsed, directory: str) -> tuple:
    if not req.url:
        return ("registry", spec_key(str(req.specifier)), None)
    return url_source(req.url, directory)


def url_source(url: str, directory: str) -> tuple:
    if url.startswith("git+"):
        base, _, fragment = url[4:].partition("#")
        parts = urlsplit(base)
        path, ref = parts.path, None
        if "@" in path:
            path, ref = path.rsplit("@", 1)
        sub = parse_qs(fragment).get("subdirectory", [None])[0]
        repo = lock_repo(parts._replace(path=path, query="").geturl())
        lfs = parse_qs(fragment).get("lfs", [""])[0].lower() == "true"
        return ("git", repo, "rev" if ref else None, ref, sub, lfs)
    base, _, fragment = url.partition("#")
    if base.startswith("file:"):
        path = os.path.normpath(os.path.join(directory, unquote(urlsplit(base).path)))
        return ("path", "directory" if os.path.isdir(path) else "path", path)
    return ("url", base, parse_qs(fragment).get("subdirectory", [None])[0])


def source_key(source: dict, req: pep508.Parsed, project: Project) -> tuple:
    if "git" in source:
        ref_kind = next((k for k in ("rev", "tag", "branch") if k in source), None)
        return (
            "git",
            lock_repo(str(source["git"])),
            ref_kind,
            source.get(ref_kind) if ref_kind else None,
            source.get("subdirectory"),
            source.get("lfs") is True,  # uv locks `lfs = true` too (adding it is stale)
        )
    if "url" in source:
        if "#" in str(source["url"]):
            raise Undecidable(
                f"`{req.name}`'s `url` source `{source['url']}` has a fragment, which uv refuses "
                "(`Fragments are not allowed in URLs`): drop it (`subdirectory = ...` is a key)"
            )
        return ("url", str(source["url"]), source.get("subdirectory"))
    if "path" in source:
        path = os.path.normpath(os.path.join(project.directory, str(source["path"])))
        if not os.path.exists(path):
            raise Undecidable(
                f"`{req.name}` comes from path `{source['path']}`, which is not there "
                "(a submodule not checked out?)"
            )
        if not os.path.isdir(path):
            return ("path", "path", path)
        if source.get("package") is False:
            return ("path", "virtual", path)
        return ("path", "editable" if source.get("editable") else "directory", path)
    if source.get("workspace"):
        directory = project.members.get(canonicalize_name(req.name))
        if directory is None:
            raise Undecidable(f"`{req.name}` is a workspace source but not a workspace member")
        return ("path", "directory" if source.get("editable") is False else "editable", directory)
    if "index" in source:
        name = source["index"]
        url = project.indexes.get(name, project.workspace_indexes.get(name))
        if url is None:
            raise Undecidable(f"`{req.name}` comes from index `{name}`, which no project defines")
        if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", url):  # a local directory: uv locks
            url = "file://" + os.path.normpath(os.path.join(project.directory, url))  # its URL
        return ("registry", spec_key(str(req.specifier)), index_url(url))
    return requirement_source(req, project.directory)


# -- normal forms -----------------------------------------------------------------------------
def lock_repo(url: str) -> str:
    """A git repository URL as `uv lock --check` compares it (uv-resolver normalize_requirement:
    credentials, query and fragment dropped, the rest verbatim): unlike a pin comparison
    (urls.normalize_repo), a `.git` suffix or a trailing slash added since locking makes the lock
    stale (measured with uv 0.13.9)."""
    url = url.strip().removeprefix("git+")
    parts = urlsplit(url)
    if not parts.scheme:
        return url
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return f"{parts.scheme.lower()}://{host.lower()}{parts.path or '/'}"


@cache
def spec_key(text: str) -> tuple:
    try:
        specs = SpecifierSet(text)
    except InvalidSpecifier:
        return (text,)
    out = []
    for spec in specs:
        version = spec.version
        try:
            value = version if version.endswith(".*") else Version(version)
        except InvalidVersion:
            value = version
        out.append((spec.operator, str(value) if isinstance(value, Version) else value))
    return tuple(sorted(out))


def index_url(url: str) -> str:
    return url.rstrip("/")


def same_version(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def _strings(value) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def compare_entries(have: list, want: list, python: str | None) -> tuple[list, list] | None:
    """None when the two records are the same set; else (missing from the lock, extra in it)."""

    def grouped(entries):
        out: dict[tuple, list] = {}
        for name, extras, source, marker in entries:
            out.setdefault((name, extras, source), []).append(marker)
        return out

    a, b = grouped(have), grouped(want)
    added = [k for k in b if k not in a]
    removed = [k for k in a if k not in b]
    added, removed, unsure = _same_meaning(added, removed, a, b, python)
    for key in set(a) & set(b):
        if a[key] == b[key]:
            continue  # the same trees: the same truth tables
        verdict = markers.equivalent_sets(a[key], b[key], python)
        if verdict is False or (
            verdict is None and sorted(map(repr, a[key])) != sorted(map(repr, b[key]))
        ):
            added.append(key)
    for name in sorted({k[0] for k in added + removed}):
        same = _same_merged(
            [e for e in have if e[0] == name], [e for e in want if e[0] == name], python
        )
        if same is False:
            continue
        unsure = unsure or (None if same else f"`{name}`'s declarations, merged as uv merges them,")
        added = [k for k in added if k[0] != name]
        removed = [k for k in removed if k[0] != name]
    if not added and not removed:
        if unsure:
            raise Undecidable(
                f"{unsure} differ only in the precision of a version: uv stores the two alike "
                "but they allow different versions, so uv re-resolves and only the result "
                "tells; run `uv lock --check`"
            )
        return None
    return sorted(added, key=repr), sorted(removed, key=repr)


def _same_merged(have: list, want: list, python) -> bool | None:
    """uv 0.13 merges the declarations of one package (uv-configuration `normalize`): where
    their markers overlap, extras are unioned and specifiers intersected, so `leaf>=0.1` plus
    `leaf<0.4` is `leaf>=0.1,<0.4`, and `leaf; sys_platform == 'linux'` plus `leaf;
    sys_platform != 'linux'` is `leaf`. Compared in every environment that tells the markers
    apart: True the same, False not (or too many environments to tell), None alike but for
    precision (same_specifiers)."""
    grid = markers._grid([e[3] for e in have + want], python)
    if grid is None or not have or not want:
        return False
    # uv keeps a declaration whose marker never holds (an override may replace the marker):
    # such a declaration is matched by the strict comparison only
    if not all(any(markers._eval(e[3], env) for env in grid) for e in have + want):
        return False
    unsure = False
    for env in grid:
        effective = []
        for entries in (have, want):
            active = [e for e in entries if markers._eval(e[3], env)]
            registry = [e[2] for e in active if e[2][0] == "registry"]
            if any(len(p) != 2 for r in registry for p in r[1]):
                return False  # a specifier rlflow cannot read: only equal text is the same
            effective.append(
                (
                    frozenset(x for e in active for x in e[1]),
                    frozenset(e[2] for e in active if e[2][0] != "registry"),
                    frozenset(r[2] for r in registry),
                    tuple(sorted(p for r in registry for p in r[1])),
                    bool(active),
                )
            )
        (h_extras, h_other, h_index, h_spec, h_any), (w_extras, w_other, w_index, w_spec, w_any) = (
            effective
        )
        if (h_extras, h_other, h_index, h_any) != (w_extras, w_other, w_index, w_any):
            return False
        same = same_specifiers(h_spec, w_spec)
        if same is False:
            return False
        unsure = unsure or same is None
    return None if unsure else True


def _same_meaning(added: list, removed: list, a: dict, b: dict, python) -> tuple:
    """Pair a pyproject entry with a lock entry whose registry specifiers differ in spelling only
    (`>=0.2` / `>=0.2.0`, `<1,>=0.2` / `>=0.2,<1,>=0.1`): uv 0.13 compares them by the versions
    they allow (and by prerelease opt-in and a lone `==` pin), so they are the same."""
    unsure = None
    for key in list(added):
        name, extras, source = key
        if source[0] != "registry":
            continue
        for old in removed:
            if old[:2] != (name, extras) or old[2][0] != "registry" or old[2][2] != source[2]:
                continue
            same = same_specifiers(old[2][1], source[1])
            if same is False:
                continue
            if a[old] != b[key] and markers.equivalent_sets(a[old], b[key], python) is not True:
                continue
            added.remove(key)
            removed.remove(old)
            if same is None:
                unsure = unsure or (
                    f"`{name}`, `{_spec_text(old[2][1])}` in the lock and "
                    f"`{_spec_text(source[1])}` now,"
                )
            break
    return added, removed, unsure


def _spec_text(key: tuple) -> str:
    return ",".join(op + v for op, v in key) if key and len(key[0]) == 2 else "".join(key)


def same_specifiers(left: tuple, right: tuple) -> bool | None:
    """Two spec_key tuples: True when uv 0.13's `uv lock --check` takes them for the same
    requirement, False when not, None when uv stores them alike (its version equality ignores
    trailing zeros: `~=0.3` and `~=0.3.0`) but they allow different versions, where uv
    re-resolves and the answer depends on the resolution (measured: `==0.3.*` -> `==0.3.0.*`
    passes, `~=0.3` -> `~=0.3.0` fails)."""
    if left == right:
        return True
    if not all(len(k) == 2 for k in (*left, *right)):
        return False
    if any(op == "===" for op, _ in left) != any(op == "===" for op, _ in right):
        return False  # `==0.3.0` is not `===0.3.0` to uv; `===0.3.0` is `===0.3` (measured)
    left = tuple(("==" if op == "===" else op, v) for op, v in left)
    right = tuple(("==" if op == "===" else op, v) for op, v in right)
    try:
        lv = [(op, Version(v.removesuffix(".*")), v.endswith(".*")) for op, v in left]
        rv = [(op, Version(v.removesuffix(".*")), v.endswith(".*")) for op, v in right]
    except InvalidVersion:
        return False
    pin = lambda specs: len(specs) == 1 and specs[0][0] == "==" and not specs[0][2]  # noqa: E731
    pre = lambda specs: any(v.is_prerelease for _, v, _ in specs)  # noqa: E731
    if pin(lv) == pin(rv) and pre(lv) == pre(rv):
        lset = SpecifierSet(_spec_text(left))
        rset = SpecifierSet(_spec_text(right))
        if all(
            lset.contains(p, prereleases=True) == rset.contains(p, prereleases=True)
            for p in _probes([v for _, v, _ in lv + rv])
        ):
            return True
    alike = len(lv) == len(rv) and all(x in rv for x in lv) and all(y in lv for y in rv)
    return None if alike else False  # Version's == ignores trailing zeros, as uv's does


def _probes(versions: list) -> list[Version]:
    """Versions on each side of every bound: where two specifier sets can differ."""
    out = set()
    for version in versions:
        release = version.release
        bases = {release, (0,), (999,)}
        for i in range(1, len(release) + 2):
            head = (release + (0,) * i)[:i]
            bases |= {head, head[:-1] + (head[-1] + 1,), head + (0,), head + (1,)}
            if head[-1] > 0:
                bases.add(head[:-1] + (head[-1] - 1,) + (99,))
        prefix = f"{version.epoch}!" if version.epoch else ""
        for base in bases:
            text = prefix + ".".join(map(str, base))
            for suffix in (
                "",
                ".dev0",
                "a0",
                "a1",
                "rc1",
                ".post0",
                ".post1",
                ".post1.dev0",
                "+local",
            ):
                out.add(Version(text + suffix))
        out.add(version)
        out.add(Version(f"{version}+local") if not version.local else version)
    return sorted(out)
