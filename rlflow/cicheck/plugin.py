"""A pytest plugin check-tests loads into every collection it runs (`-p rlflow.cicheck.plugin`):
writes the collected test ids, as `path-from-the-repository-root::rest`, to the file named by
RLFLOW_CHECK_TESTS_OUT. Output flags (`-q`, `-v`, `-s`, addopts) cannot change what is read,
and a shard run from a subdirectory (or with its own rootdir) is named from the repository
root."""

from __future__ import annotations

import os


def pytest_collection_finish(session) -> None:
    out = os.environ.get("RLFLOW_CHECK_TESTS_OUT")
    root = os.environ.get("RLFLOW_CHECK_TESTS_ROOT")
    if not out or not root:
        return
    with open(out, "w", encoding="utf-8") as stream:
        for item in session.items:
            rest = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
            path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
            stream.write(f"{path}::{rest}\n")
