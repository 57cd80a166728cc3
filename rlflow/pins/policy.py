"""`[tool.rlflow.pins]` in the root pyproject: what must move in lockstep, what may differ.

    [tool.rlflow.pins]
    lockstep = ["transformer-engine"]        # must be pinned identically everywhere
    submodule-refs = { "submodules/Megatron-Bridge" = "main" }  # gitlink must be on origin/main
    allow = [                                # known-harmless differences, each with a reason
      { package = "nemo-run", reason = "only in Megatron-LM's test tooling", code = "RF001",
        submodule = "submodules/Megatron-Bridge/3rdparty/Megatron-LM" },
    ]

Without `lockstep`, packages pinned by URL or by an exact version on two sides already have to
agree (RF001/RF004). An allow entry needs `package` and `reason`; `code` and `submodule`
narrow it. An entry that matches nothing is reported (RF009), so the list cannot go stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packaging.utils import canonicalize_name

from rlflow.errors import Diagnostic, RlflowError
from rlflow.pins.model import Finding, Location

TABLE = ("tool", "rlflow", "pins")
FINDING_CODES = tuple(f"RF{n:03d}" for n in range(1, 13))
_POLICY_KEYS = ("lockstep", "allow", "submodule-refs")
_ALLOW_KEYS = ("package", "reason", "code", "submodule")


@dataclass(frozen=True)
class AllowEntry:
    package: str
    reason: str
    code: str | None
    submodule: str | None
    location: Location

    def matches(self, finding: Finding) -> bool:
        if finding.package != self.package or self.code not in (None, finding.code):
            return False
        if self.submodule is None:
            return True
        prefix = self.submodule.strip("/")
        return any(p == prefix or p.startswith(prefix + "/") for p in finding.projects)


@dataclass(frozen=True)
class Policy:
    lockstep: dict[str, Location]  # package -> where it is listed
    allow: tuple[AllowEntry, ...]
    submodule_refs: dict[str, tuple[str, Location]] = field(default_factory=dict)  # path -> ref


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
    return Policy(lockstep, allow, _submodule_refs(doc, table))


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
        refs[sub.strip("/")] = (ref.strip(), doc.loc(path + (sub,)))
    return refs


def apply_allowlist(
    findings: list[Finding], policy: Policy
) -> tuple[list[Finding], list[tuple[Finding, AllowEntry]]]:
    """Split findings into (kept, allowed); every allow entry that matched nothing -> RF009."""
    kept, allowed, used = [], [], set()
    for finding in findings:
        entry = next((e for e in policy.allow if e.matches(finding)), None)
        if entry is None:
            kept.append(finding)
        else:
            allowed.append((finding, entry))
            used.add(id(entry))
    for entry in policy.allow:
        if id(entry) not in used:
            kept.append(
                Finding(
                    "RF009",
                    "warning",
                    package=entry.package,
                    location=entry.location,
                    detail=f"allow entry for `{entry.package}`",
                )
            )
    return kept, allowed


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
    for key in ("package", "reason"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise _bad(
                doc,
                path,
                f"allow entry needs a non-empty `{key}`",
                help='say why the difference is harmless, e.g. reason = "only in the '
                "submodule's test group\"",
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
    return AllowEntry(
        canonicalize_name(entry["package"]), entry["reason"], code, submodule, doc.loc(path)
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
