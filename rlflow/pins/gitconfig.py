""".gitmodules read without starting git, when the file keeps to the plain form git writes.

`git submodule add` (and nearly every hand edit) writes only lines like these (a tab indents
the keys):

    [submodule "name"]
        path = some/dir
        url = https://example.com/repo.git

For such a file `plain_records` gives exactly the (key, value) pairs, in order, that
`git config -f FILE -z --list` prints (git's rules: section and key names lowercased, the
subsection kept, blanks around a value dropped, blanks inside it kept), which saves one git
process per repository of the tree. Anything else git's config format allows returns None and
the caller asks git, which also words the error for a malformed file: quotes, backslashes
(escapes, continuation lines), `#`/`;` after a value or a header, a key without `=`, the old
`[section.sub]` form, a key before any section, a BOM, a CR, a tab inside a value or any other
control character.
"""

from __future__ import annotations

import re

_SECTION = re.compile(r'[ \t]*\[([A-Za-z0-9-]+)(?:[ \t]+"([^"\\]*)")?\][ \t]*')
_KEY = re.compile(r"[ \t]*([A-Za-z][A-Za-z0-9-]*)[ \t]*=[ \t]*([^\"\\#;\t]*?)[ \t]*")
_BLANK_OR_COMMENT = re.compile(r"[ \t]*(?:[#;].*)?")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # (a BOM in the class: +0.5 ms to compile)


def plain_records(text: str) -> list[tuple[str, str]] | None:
    """`git config --list`'s (key, value) pairs of `text`, or None when git must read it."""
    if _CONTROL.search(text) or "\ufeff" in text:
        return None  # what only git reads right
    records, section = [], None
    for line in text.split("\n"):
        key = _KEY.fullmatch(line)
        if key is not None:
            if section is None:
                return None  # git's own error for a key outside a section
            records.append((f"{section}.{key.group(1).lower()}", key.group(2)))
        elif (header := _SECTION.fullmatch(line)) is not None:
            name, sub = header.group(1).lower(), header.group(2)
            section = name if sub is None else f"{name}.{sub}"
        elif _BLANK_OR_COMMENT.fullmatch(line) is None:
            return None
    return records
