"""URL normalization, so that only real differences are reported.

uv treats `git+https://host/org/repo.git@v1`, `https://host/org/repo@v1` (as `git = ...` in
`[tool.uv.sources]`) and `https://host/org/repo/@v1` as the same repository and ref, and so is
`https://github.com/NVIDIA/Megatron-LM` vs `.../nvidia/megatron-lm` (uv lowercases GitHub
paths); a
different ref, host, path or subdirectory is a conflict. Index URLs are NOT normalized here:
uv compares them verbatim, and a trailing slash alone makes "conflicting indexes".
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlsplit

from rlflow.pins.records import record

_ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".tgz", ".zip", ".tar.bz2", ".tar.xz")


@record
class DirectUrl:
    kind: str  # "git" | "url" | "path"
    key: str  # what is compared
    repo: str | None = None
    ref: str | None = None
    subdirectory: str | None = None


def normalize_repo(url: str) -> str:
    """`git+https://User@Host/org/repo.git/` -> `https://host/org/repo` (credentials dropped)."""
    url = url.strip()
    if url.startswith("git+"):
        url = url[len("git+") :]
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    path = parts.path.rstrip("/")
    if path.endswith(".git"):
        path = path[: -len(".git")].rstrip("/")
    if not parts.scheme:  # scp-like `git@host:org/repo`: keep it, minus the decorations above
        return path
    host = host.lower()
    if host == "github.com":  # GitHub paths are case-insensitive; uv (like cargo) lowercases them
        path = path.lower()
    return f"{parts.scheme.lower()}://{host}{path}"


def git_key(repo: str, ref: str | None, subdirectory: str | None) -> str:
    key = f"git+{repo}"
    if ref:
        key += f"@{ref}"
    if subdirectory:
        key += f"#subdirectory={subdirectory.strip('/')}"
    return key


def path_key(path: str, base_dir: str) -> str:
    """A path source, resolved against the directory of the pyproject that declares it."""
    return "path:" + os.path.normpath(os.path.join(base_dir, path))


def parse_direct_url(url: str, base_dir: str) -> DirectUrl:
    """Classify and normalize the URL of a `name @ URL` requirement."""
    text = url.strip()
    base, _, fragment = text.partition("#")
    subdirectory = _fragment_subdirectory(fragment)
    if text.startswith("git+"):
        parts = urlsplit(base[len("git+") :])
        path, ref = parts.path, None
        if "@" in path:
            path, ref = path.rsplit("@", 1)
        repo = normalize_repo(parts._replace(path=path, query="", fragment="").geturl())
        return DirectUrl("git", git_key(repo, ref, subdirectory), repo, ref, subdirectory)
    parts = urlsplit(base)
    if parts.scheme == "file" and not base.endswith(_ARCHIVE_SUFFIXES):
        return DirectUrl("path", path_key(unquote(parts.path), base_dir))
    normalized = parts._replace(scheme=parts.scheme.lower(), netloc=parts.netloc.lower()).geturl()
    return DirectUrl("url", normalized + (f"#{fragment}" if fragment else ""))


def _fragment_subdirectory(fragment: str) -> str | None:
    values = parse_qs(fragment).get("subdirectory")
    return values[0] if values else None
