"""mkdocs hook: docs/ pages may link to any file of the repository, and those links work.

A page links to `../benchmarks/grpo_shaped.md` or `../tests/launch/golden/tiny-8n4g.txt` the way
GitHub resolves it. mkdocs only knows the files under docs/, so this hook adds each linked file
outside docs/ to the site (under `repo/`; Markdown files become pages, whose own links are followed
the same way). mkdocs then resolves and checks every link as usual: a link to a file that does not
exist stays unresolved, which `mkdocs build --strict` reports as a failure.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _targets(markdown: str) -> list[str]:
    """The relative link targets of a page (not inside code), without their #anchors."""
    text = _CODE.sub("", _FENCE.sub("", markdown))
    found = []
    for match in _LINK.finditer(text):
        target = match[1].split("#", 1)[0]
        if target and "://" not in target and not target.startswith(("/", "mailto:")):
            found.append(target)
    return found


def on_files(files: Files, config) -> Files:
    docs = Path(config.docs_dir).resolve()
    root = Path(config.config_file_path).resolve().parent
    pending = list(files.documentation_pages())
    while pending:
        page = pending.pop()
        markdown = Path(page.abs_src_path).read_text(encoding="utf-8")
        for target in _targets(markdown):
            src_uri = posixpath.normpath(posixpath.join(posixpath.dirname(page.src_uri), target))
            path = (docs / src_uri).resolve()
            if not src_uri.startswith("../") or files.get_file_from_path(src_uri):
                continue  # under docs/ (mkdocs checks it) or already added
            if path.is_relative_to(docs) or not path.is_file() or not path.is_relative_to(root):
                continue  # left unresolved: mkdocs reports the broken link
            # where the site puts it: repo/<its path>, as mkdocs would place a file there
            placed = File(
                f"repo/{path.relative_to(root).as_posix()}", None, "", config.use_directory_urls
            )
            added = File(
                src_uri,
                str(docs),
                config.site_dir,
                config.use_directory_urls,
                dest_uri=placed.dest_uri,
                inclusion=InclusionLevel.NOT_IN_NAV,  # reached through links, not the nav
            )
            files.append(added)
            if added.is_documentation_page():
                pending.append(added)
    return files
