"""Property: whatever is in pyproject.toml or .gitmodules, check-pins never ends in a traceback.

Hypothesis mutates the real files of a real nested-submodule repository (character edits,
dropped and duplicated lines) or replaces them with random TOML of the right general shape
(wrong types, odd keys, invalid requirements). Every run must end with exit 0, 1 or 2, and
exit 2 must come with a diagnostic. An uncaught exception fails the test by propagating.
"""

from __future__ import annotations

import json

import pytest
import tomlkit
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from pins_helpers import (
    BRIDGE_PATH,
    LM_PATH,
    Layout,
    add_submodule,
    bridge_toml,
    check_pins,
    lm_toml,
    make_repo,
    root_toml,
)

TARGETS = ["pyproject.toml", f"{BRIDGE_PATH}/pyproject.toml", f"{LM_PATH}/pyproject.toml"]
GITMODULES = [".gitmodules", f"{BRIDGE_PATH}/.gitmodules"]
EDIT_CHARS = st.sampled_from(
    list("[]{}=,.\"'#\n @:+/_-\\\tabcv0123éß\x00\x7f") + ["\r\n", '"""', "]]"]
)
SETTINGS = settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Layout:
    base = tmp_path_factory.mktemp("property")
    policy = '[tool.rlflow.pins]\nlockstep = ["torch"]\nallow = [{ package = "x", reason = "y" }]\n'
    up_lm = make_repo(base / "lm", {"pyproject.toml": lm_toml()})
    up_bridge = make_repo(base / "bridge", {"pyproject.toml": bridge_toml()})
    add_submodule(up_bridge, up_lm, "3rdparty/Megatron-LM")
    root = make_repo(base / "trainer", {"pyproject.toml": root_toml(body=policy)})
    add_submodule(root, up_bridge, BRIDGE_PATH)
    return Layout(root, up_bridge, up_lm)


@st.composite
def mutated(draw, original: str) -> str:
    text = original
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "insert", "drop_line", "duplicate_line"]))
        pos = draw(st.integers(0, len(text)))
        if op == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 30)) :]
        elif op == "insert":
            text = text[:pos] + "".join(draw(st.lists(EDIT_CHARS, max_size=6))) + text[pos:]
        else:
            lines = text.splitlines(keepends=True) or [""]
            i = draw(st.integers(0, len(lines) - 1))
            lines[i : i + 1] = [] if op == "drop_line" else [lines[i], lines[i]]
            text = "".join(lines)
    return text


LEAF = st.one_of(st.text(max_size=20), st.integers(-5, 5), st.booleans(), st.floats(-1, 1))
VALUE = st.recursive(
    LEAF,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(min_size=1, max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
REQUIREMENT = st.one_of(
    st.sampled_from(
        [
            "torch",
            "torch==2.11.0",
            "emerging_optimizers",
            "a[b]>=1;python_version<'4'",
            "x @ git+https://h/x.git@v1",
            "x @ file:///tmp/x",
            "bad ==",
            "y>=1,<",
            "z===q",
        ]
    ),
    st.text(max_size=25),
    VALUE,
)
SOURCE = st.dictionaries(
    st.sampled_from(
        [
            "git",
            "rev",
            "tag",
            "branch",
            "url",
            "path",
            "index",
            "workspace",
            "extra",
            "group",
            "marker",
            "subdirectory",
        ]
    ),
    st.one_of(st.sampled_from(["https://h/x.git", "v1", "../x", "pytorch", "dev"]), LEAF),
    max_size=4,
)
NAMES = st.sampled_from(
    ["torch", "x", "emerging-optimizers", "Emerging_Optimizers", "megatron-core"]
)
DOCUMENT = st.fixed_dictionaries(
    {},
    optional={
        "project": st.fixed_dictionaries(
            {},
            optional={
                "name": st.one_of(NAMES, LEAF),
                "version": st.one_of(st.sampled_from(["1.0", "x.y"]), LEAF),
                "dependencies": st.one_of(st.lists(REQUIREMENT, max_size=4), VALUE),
                "optional-dependencies": st.dictionaries(
                    st.text(max_size=5), st.lists(REQUIREMENT, max_size=3), max_size=2
                ),
            },
        ),
        "dependency-groups": st.dictionaries(
            st.text(max_size=5), st.lists(REQUIREMENT, max_size=3), max_size=2
        ),
        "tool": st.fixed_dictionaries(
            {},
            optional={
                "uv": st.fixed_dictionaries(
                    {},
                    optional={
                        "sources": st.dictionaries(
                            NAMES, st.one_of(SOURCE, st.lists(SOURCE, max_size=2), LEAF), max_size=3
                        ),
                        "index": st.one_of(
                            st.lists(
                                st.dictionaries(
                                    st.sampled_from(["name", "url"]),
                                    st.one_of(st.just("https://i/"), LEAF),
                                ),
                                max_size=2,
                            ),
                            LEAF,
                        ),
                        "constraint-dependencies": st.lists(REQUIREMENT, max_size=3),
                        "override-dependencies": st.lists(REQUIREMENT, max_size=2),
                        "dependency-metadata": st.lists(
                            st.dictionaries(
                                st.sampled_from(["name", "version"]), st.one_of(NAMES, LEAF)
                            ),
                            max_size=2,
                        ),
                        "conflicts": st.one_of(
                            st.lists(
                                st.lists(
                                    st.dictionaries(st.sampled_from(["extra", "group"]), LEAF),
                                    max_size=2,
                                ),
                                max_size=2,
                            ),
                            LEAF,
                        ),
                    },
                ),
                "rlflow": st.fixed_dictionaries(
                    {},
                    optional={
                        "pins": st.dictionaries(
                            st.sampled_from(["lockstep", "allow", "lockstepp"]),
                            st.one_of(
                                st.lists(
                                    st.one_of(
                                        NAMES,
                                        st.dictionaries(
                                            st.sampled_from(
                                                ["package", "reason", "code", "submodule"]
                                            ),
                                            st.one_of(NAMES, LEAF),
                                        ),
                                    )
                                ),
                                LEAF,
                            ),
                        )
                    },
                ),
            },
        ),
    },
)


def _assert_clean_exit(repo: Layout, fmt: str) -> None:
    result = check_pins("--repo", repo.root, "--format", fmt)  # an exception here fails the test
    assert result.code in (0, 1, 2), result
    event(f"exit {result.code}")  # shown by --hypothesis-show-statistics
    assert "Traceback" not in result.out + result.err
    if fmt == "json":
        document = json.loads(result.out)
        if result.code == 2:
            assert document["diagnostics"] and document["diagnostics"][0]["code"].startswith("RF1")
    elif result.code == 2:
        assert "error[RF1" in result.err, result.err


def _with_content(repo: Layout, rel: str, content: str, fmt: str) -> None:
    path = repo.root / rel
    original = path.read_bytes()
    try:
        path.write_text(content, encoding="utf-8", errors="surrogatepass")
        _assert_clean_exit(repo, fmt)
    finally:
        path.write_bytes(original)


@SETTINGS
@given(data=st.data(), target=st.sampled_from(TARGETS), fmt=st.sampled_from(["text", "json"]))
def test_any_pyproject_gives_an_exit_code_not_a_traceback(repo, data, target, fmt):
    original = (repo.root / target).read_text()
    if data.draw(st.booleans()):
        content = data.draw(mutated(original))
    else:
        try:
            content = tomlkit.dumps(data.draw(DOCUMENT))
        except Exception:  # tomlkit cannot write every Python structure; not our input space
            assume(False)
    _with_content(repo, target, content, fmt)


@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), target=st.sampled_from(GITMODULES), fmt=st.sampled_from(["text", "json"]))
def test_any_gitmodules_gives_an_exit_code_not_a_traceback(repo, data, target, fmt):
    original = (repo.root / target).read_text()
    pieces = st.one_of(
        EDIT_CHARS, st.sampled_from(["[submodule ", "path = ", "url = ", BRIDGE_PATH])
    )
    random_file = st.lists(pieces, max_size=40).map("".join)
    content = data.draw(st.one_of(mutated(original), random_file))
    _with_content(repo, target, content, fmt)


# -- issue 11: every new case ------------------------------------------------------------------
# Decorations uv accepts (a BOM, CRLF) and input it rejects (deep nesting) around any document.
@st.composite
def decorated(draw, original: str) -> str:
    text = original
    if draw(st.booleans()):
        text = text.replace("\n", "\r\n")
    if draw(st.booleans()):
        text = "\ufeff" + text
    if draw(st.booleans()):
        depth = draw(st.integers(1, 4000))
        opener = draw(st.sampled_from(["[", "{a = ", "[{a = "]))
        closer = {"[": "]", "{a = ": "}", "[{a = ": "}]"}[opener]
        text += f"\n[tool.nest]\nx = {opener * depth}1{closer * depth}\n"
    if draw(st.booleans()):
        text += "\n# " + "y" * draw(st.integers(0, 300_000)) + "\n"
    return text


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), target=st.sampled_from(TARGETS), fmt=st.sampled_from(["text", "json"]))
def test_bom_crlf_nesting_and_long_lines_never_crash(repo, data, target, fmt):
    original = (repo.root / target).read_text()
    _with_content(repo, target, data.draw(decorated(original)), fmt)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_bom_and_crlf_change_no_finding(repo, data):
    """uv reads a BOM and CRLF as nothing: the findings must be exactly those of the plain file."""
    target = data.draw(st.sampled_from(TARGETS))
    path = repo.root / target
    original = path.read_bytes()
    plain = check_pins("--repo", repo.root, "--format", "json").json["diagnostics"]
    text = original.decode()
    if data.draw(st.booleans()):
        text = text.replace("\n", "\r\n")
    text = ("\ufeff" if data.draw(st.booleans()) else "") + text
    try:
        path.write_bytes(text.encode())
        after = check_pins("--repo", repo.root, "--format", "json").json["diagnostics"]
    finally:
        path.write_bytes(original)
    # RF008 (the submodule's file differs from its commit) is the only expected difference
    assert [d for d in after if d["code"] != "RF008"] == [d for d in plain if d["code"] != "RF008"]


def _valid_set(text: str) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        SpecifierSet(text)
    except InvalidSpecifier:
        return False
    return True


VERSIONS = ["0.9", "1.0", "1.0.0", "1.0.post1", "1.0rc1", "1.1", "1.2", "1.2.7", "2.0"]
OPERATORS = ["==", "!=", ">=", "<=", ">", "<", "~="]
SPEC = st.builds(
    lambda op, v, star: (
        f"{op}{v}.*" if star and op in ("==", "!=") and v[-1].isdigit() else f"{op}{v}"
    ),
    st.sampled_from(OPERATORS),
    st.sampled_from(VERSIONS),
    st.booleans(),
).filter(lambda s: not (s.startswith("~=") and s.count(".") == 0))
SPEC_SET = st.lists(SPEC, min_size=1, max_size=3).map(",".join).filter(_valid_set)
PROBES = VERSIONS + ["1.0.1", "1.2.0", "1.2.99", "1.3", "1.1rc1", "1.0+cu130", "3.0", "0.1"]


@settings(max_examples=400, deadline=None)
@given(a=SPEC_SET, b=SPEC_SET)
def test_disjoint_never_claims_a_satisfiable_pair(a, b):
    """No false alarms, `!=` included: a reported pair has no version satisfying both."""
    from packaging.specifiers import SpecifierSet

    from rlflow.pins.versions import disjoint

    sa, sb = SpecifierSet(a), SpecifierSet(b)
    witness = [v for v in PROBES if sa.contains(v, True) and sb.contains(v, True)]
    if disjoint(a, b):
        assert not witness, (a, b, witness)


@given(v=st.sampled_from(VERSIONS), w=st.sampled_from(VERSIONS))
def test_exact_against_exclusion_is_found(v, w):
    """`==v` vs `!=w` is unsatisfiable exactly when v and w are the same version (uv agrees)."""
    from packaging.version import Version

    from rlflow.pins.versions import disjoint

    assert disjoint(f"=={v}", f"!={w}") is (Version(v) == Version(w))


@given(
    owner=st.text("abcXYZ-", min_size=1, max_size=8),
    name=st.text("abcXYZ-_.", min_size=1, max_size=8).filter(lambda s: s.strip(".")),
    flips=st.lists(st.booleans(), min_size=16, max_size=16),
    host=st.sampled_from(["github.com", "GitHub.com", "gitlab.com", "example.org"]),
)
def test_github_case_is_ignored_and_only_there(owner, name, flips, host):
    from rlflow.pins.urls import normalize_repo

    def flip(text: str) -> str:
        return "".join(c.swapcase() if flips[i % 16] else c for i, c in enumerate(text))

    url, other = f"https://{host}/{owner}/{name}", f"https://{host}/{flip(owner)}/{flip(name)}"
    same = normalize_repo(url) == normalize_repo(other)
    if host.lower() == "github.com":
        assert same
    else:
        assert same is (f"{owner}/{name}" == f"{flip(owner)}/{flip(name)}")


@settings(max_examples=100, deadline=None)
@given(crlf=st.booleans(), bom=st.booleans(), key=st.sampled_from(["rev", "tag", "branch"]))
def test_fix_apply_keeps_line_endings_bom_and_key(crlf, bom, key):
    from rlflow.pins.fix import Change, Edit, apply

    text = (
        '[project]\nname = "x"\n\n[tool.uv.sources]\n'
        f'emo = {{ git = "https://h/emo", {key} = "v0.2.0" }}  # pinned\n'
        '[tool.other]\nmultiline = """\na\nb\n"""\n'
    )
    if crlf:
        text = text.replace("\n", "\r\n")
    if bom:
        text = "\ufeff" + text
    edit = Edit((Change(("tool", "uv", "sources", "emo", key), "v0.3.0"),), "")
    new = apply(text, [edit])
    assert new == text.replace('"v0.2.0"', '"v0.3.0"')


GIT_HOOK_ENV = st.fixed_dictionaries(
    {},
    optional={
        "GIT_INDEX_FILE": st.sampled_from([".git/index", "/nonexistent/index", "index"]),
        "GIT_DIR": st.sampled_from([".git", "/nonexistent"]),
        "GIT_WORK_TREE": st.sampled_from([".", "/nonexistent"]),
        "GIT_PREFIX": st.sampled_from(["docs/", ""]),
        "GIT_COMMON_DIR": st.just(".git"),
        "GIT_OBJECT_DIRECTORY": st.just(".git/objects"),
    },
)


@settings(max_examples=25, deadline=None)
@given(env=GIT_HOOK_ENV)
def test_inherited_git_environment_changes_nothing(repo, env):
    """Whatever a hook (or a user's shell) exports, the findings are those of a clean shell
    (issue 11: GIT_INDEX_FILE made every real commit fail)."""
    import os

    clean = check_pins("--repo", repo.root, "--format", "json")
    saved = {k: os.environ.get(k) for k in env}
    cwd = os.getcwd()
    try:
        os.chdir(repo.root)  # a hook runs at the top level, where relative values point
        os.environ.update(env)
        hooked = check_pins("--repo", repo.root, "--format", "json")
    finally:
        os.chdir(cwd)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert (hooked.code, hooked.json["diagnostics"]) == (clean.code, clean.json["diagnostics"])
