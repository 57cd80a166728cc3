"""`[tool.rlflow.pins]` in the root pyproject: what must move in lockstep, what may differ.

    [tool.rlflow.pins]
    lockstep = ["transformer-engine"]        # must be pinned identically everywhere
    submodule-refs = { "submodules/Megatron-Bridge" = "main" }  # gitlink must be on origin/main
    lock-level = true                        # false: no uv.lock checks (RF010/RF011/RF013)
    deployed-locks = ["submodules/Megatron-Bridge"]  # also deployed from its own uv.lock
    allow = [                                # known-harmless differences, each with a reason
      { package = "nemo-run", reason = "only in Megatron-LM's test tooling", code = "RF001",
        submodule = "submodules/Megatron-Bridge/3rdparty/Megatron-LM" },
      { code = "RF013", reason = "CI runs `uv lock --check`" },
    ]

Without `lockstep`, packages pinned by URL or by an exact version on two sides already have to
agree (RF001/RF004). An allow entry needs a `reason` and `package` or `code` (any RF0xx code,
so findings without a package can be allowed too); `submodule` narrows it to findings about
that submodule (or inside it). An entry that matches nothing is reported (RF009), so the list
cannot go stale.
"""

from __future__ import annotations

from rlflow.errors import Diagnostic, RlflowError
from rlflow.pins.model import Finding, Location
from rlflow.pins.pep508 import canonicalize_name
from rlflow.pins.records import factory, record

TABLE = ("tool", "rlflow", "pins")
FINDING_CODES = tuple(f"RF{n:03d}" for n in range(1, 15))
_POLICY_KEYS = ("lockstep", "allow", "submodule-refs", "lock-level", "deployed-locks")
_ALLOW_KEYS = ("package", "reason", "code", "submodule")


@record
class AllowEntry:
    package: str | None
    reason: str
    code: str | None
    submodule: str | None
    location: Location

    def matches(self, finding: Finding) -> bool:
        if self.package is not None and finding.package != self.package:
            return False
        if self.code not in (None, finding.code):
            return False
        if self.submodule is None:
            return True
        prefix = self.submodule.strip("/")
        return any(p == prefix or p.startswith(prefix + "/") for p in _places(finding))

    @property
    def label(self) -> str:
        return f"`{self.package}`" if self.package else f"code {self.code}"


def _places(finding: Finding) -> list[str]:
    """The project directories a finding is about (its pins, its submodule, its file)."""
    import posixpath

    places = list(finding.projects)
    if finding.submodule is not None:
        places.append(finding.submodule.path)
    if finding.location is not None:
        places.append(posixpath.dirname(finding.location.file))
    return places


@record
class Policy:
    lockstep: dict[str, Location]  # package -> where it is listed
    allow: tuple[AllowEntry, ...]
    submodule_refs: dict[str, tuple[str, Location]] = factory(dict)  # path -> ref
    lock_level: bool = True
    deployed_locks: dict[str, Location] = factory(dict)  # submodule -> where


def load_policy(doc) -> Policy:
    """Read and validate the table from the root `parse.Document`; bad shape -> exit 2."""
    table = doc.data
    for key in TABLE:
        table = table.get(key, {}) if isinstance(table, dict) else None
    if not isinstance(table, dict):
        raise _bad(doc, TABLE, "`[tool.rlflow.pins]` must be a table")
    _reject_unknown(doc, table, TABLE, _POLICY_KEYS)
    lockstep = {}
    for i, name in enumerate(_list(doc, table, "lockstep")):
        if not isinstance(name, str) or not name.strip():
            raise _bad(doc, TABLE + ("lockstep", i), "lockstep entries must be package names")
        lockstep[canonicalize_name(name)] = doc.loc(TABLE + ("lockstep",))
    allow = tuple(_allow_entry(doc, entry, i) for i, entry in enumerate(_list(doc, table, "allow")))
    lock_level = table.get("lock-level", True)
    if not isinstance(lock_level, bool):
        raise _bad(doc, TABLE + ("lock-level",), "`lock-level` must be true or false")
    deployed = {}
    for i, sub in enumerate(_list(doc, table, "deployed-locks")):
        if not isinstance(sub, str) or not sub.strip("/ "):
            raise _bad(
                doc,
                TABLE + ("deployed-locks", i),
                'deployed-locks entries must be submodule paths, e.g. "submodules/Megatron-Bridge"',
            )
        deployed[sub.strip().strip("/")] = doc.loc(TABLE + ("deployed-locks",))
    return Policy(lockstep, allow, _submodule_refs(doc, table), lock_level, deployed)


def _submodule_refs(doc, table: dict) -> dict[str, tuple[str, Location]]:
    """`submodule-refs = { "submodules/Megatron-Bridge" = "main" }`: path -> approved ref."""
    value = table.get("submodule-refs", {})
    path = TABLE + ("submodule-refs",)
    if not isinstance(value, dict):
        raise _bad(doc, path, '`submodule-refs` must be a table: { "path/of/submodule" = "main" }')
    refs = {}
    for sub, ref in value.items():
        if not isinstance(ref, str) or not ref.strip() or ref.startswith("-"):
            raise _bad(
                doc,
                path + (sub,),
                f"`submodule-refs` entry `{sub}` must name a branch or tag of the submodule's "
                'remote, e.g. "main"',
            )
        if _bad_ref_name(ref.strip()):
            raise _bad(
                doc,
                path + (sub,),
                f"`submodule-refs` entry `{sub}` = `{ref}` is not one branch or tag name (globs "
                "and revisions are not supported; `git check-ref-format --branch` must accept "
                'it), e.g. "main" or "v0.7.0"',
            )
        refs[sub.strip("/")] = (ref.strip(), doc.loc(path + (sub,)))
    return refs


def _bad_ref_name(ref: str) -> bool:
    """What `git check-ref-format refs/heads/<ref>` refuses (git-check-ref-format(1))."""
    import re

    parts = ref.split("/")
    return bool(
        re.search(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//", ref)
        or ref.endswith((".", "/"))
        or any(not p or p.startswith(".") or p.endswith(".lock") for p in parts)
    )


def apply_allowlist(
    findings: list[Finding], policy: Policy
) -> tuple[list[Finding], list[tuple[Finding, AllowEntry]]]:
    """Split findings into (kept, allowed); every allow entry that matched nothing -> RF009."""
    kept, allowed, used = [], [], set()
    first = [e for e in policy.allow if e.code != "RF009"]
    second = [e for e in policy.allow if e.code == "RF009"]
    _split(findings, first, kept, allowed, used)
    rf009 = [f for f in kept if f.code == "RF009"] + _unused(first, used)
    kept = [f for f in kept if f.code != "RF009"]
    _split(rf009, second, kept, allowed, used)  # RF009 itself can be allowed, once
    kept += _unused(second, used)
    return kept, allowed


def _unused(entries: list, used: set[int]) -> list[Finding]:
    """RF009 for each allow entry that allowed nothing."""
    return [
        Finding(
            "RF009",
            "warning",
            package=entry.package,
            location=entry.location,
            detail=f"allow entry for {entry.label}",
        )
        for entry in entries
        if id(entry) not in used
    ]


def _split(findings, entries, kept, allowed, used) -> None:
    for finding in findings:
        entry = next((e for e in entries if e.matches(finding)), None)
        if entry is None:
            kept.append(finding)
        else:
            allowed.append((finding, entry))
            used.add(id(entry))


def _list(doc, table: dict, key: str) -> list:
    value = table.get(key, [])
    if not isinstance(value, list):
        raise _bad(doc, TABLE + (key,), f"`{key}` must be an array")
    return value


def _allow_entry(doc, entry, i: int) -> AllowEntry:
    path = TABLE + ("allow", i)
    if not isinstance(entry, dict):
        raise _bad(
            doc, path, 'each allow entry must be a table: { package = "...", reason = "..." }'
        )
    _reject_unknown(doc, entry, path, _ALLOW_KEYS)
    needed = ("reason",) if "code" in entry and "package" not in entry else ("package", "reason")
    for key in needed:
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise _bad(
                doc,
                path,
                f"allow entry needs a non-empty `{key}`",
                help="name a `package` or a `code`, and say why the difference is harmless, "
                'e.g. reason = "only in the submodule\'s test group"',
            )
    code = entry.get("code")
    if code is not None and code not in FINDING_CODES:
        raise _bad(
            doc,
            path,
            f"unknown finding code `{code}`",
            help=f"use one of {', '.join(FINDING_CODES)}",
        )
    submodule = entry.get("submodule")
    if submodule is not None and not isinstance(submodule, str):
        raise _bad(doc, path, "`submodule` must be a path relative to the repository root")
    package = entry.get("package")
    return AllowEntry(
        canonicalize_name(package) if package else None,
        entry["reason"],
        code,
        submodule,
        doc.loc(path),
    )


def _reject_unknown(doc, table: dict, path: tuple, known: tuple[str, ...]) -> None:
    for key in table:
        if key not in known:
            import difflib  # ~4-30 ms: only an unknown key pays for the suggestion

            guess = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean `{guess[0]}`?" if guess else f"known keys: {', '.join(known)}"
            raise _bad(
                doc,
                path + (key,),
                f"unknown key `{key}` in [{'.'.join(map(str, path[:3]))}]",
                help=hint,
            )


def _bad(doc, path: tuple, message: str, help: str | None = None) -> RlflowError:
    where = doc.loc(path)
    return RlflowError(
        Diagnostic(
            "RF104", message, file=where.file, line=where.line, column=where.column, help=help
        )
    )
