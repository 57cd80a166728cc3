"""`check-pins --fix`: root pins move to the submodules' values, comments and layout stay,
nothing is written when the right value is ambiguous or anything goes wrong."""

from __future__ import annotations

import pytest
from pins_helpers import EMO_URL, bridge_toml, check_pins, lm_toml, root_toml

from rlflow.pins.fix import write_atomically


def test_fix_round_trip_keeps_comments_and_passes(nested):
    layout = nested(root=root_toml(emo="v0.2.0"))
    path = layout.root / "pyproject.toml"
    before = path.read_text()
    result = check_pins("--repo", layout.root, "--fix")
    assert result.code == 0, result.out
    after = path.read_text()
    assert after == before.replace("@v0.2.0", "@v0.3.0")  # one value changed, nothing else
    assert "# Keep in sync with Megatron-LM's [tool.uv.sources]" in after
    assert "# bumped with the submodule" in after
    assert "--- a/pyproject.toml\n+++ b/pyproject.toml" in result.out
    assert "fixed 1 pin in pyproject.toml" in result.out
    assert check_pins("--repo", layout.root).code == 0


def test_fix_source_table_switches_tag_to_rev(nested):
    body = f'emerging-optimizers = {{ git = "{EMO_URL}", tag = "v0.2.0" }}  # pinned\n'
    root = root_toml(body=body).replace(
        f'"emerging-optimizers @ git+{EMO_URL}@v0.3.0",', '"emerging-optimizers",'
    )
    layout = nested(root=root, lm=lm_toml(emo="9f1c2d3"))  # the submodule pins a commit
    assert check_pins("--repo", layout.root, "--fix").code == 0
    text = (layout.root / "pyproject.toml").read_text()
    assert f'emerging-optimizers = {{ git = "{EMO_URL}", rev = "9f1c2d3" }}  # pinned' in text


def test_fix_exact_version_in_a_multi_item_extra(nested):
    root = root_toml().replace(
        'mcore = ["megatron-bridge"]',
        "mcore = ['megatron-bridge', 'flashinfer-python==0.6.8.post1', 'einops']",
    )
    bridge = bridge_toml(deps='"megatron-core[dev]", "flashinfer-python==0.6.18.post1"')
    layout = nested(root=root, bridge=bridge)
    assert check_pins("--repo", layout.root, "--fix").code == 0
    text = (layout.root / "pyproject.toml").read_text()
    assert "mcore = ['megatron-bridge', 'flashinfer-python==0.6.18.post1', 'einops']" in text


def test_fix_index_url_and_dependency_metadata_version(nested):
    root = root_toml(
        body='[[tool.uv.index]]\nname = "flashinfer"\nurl = "https://flashinfer.ai/whl"\n\n'
        '[[tool.uv.dependency-metadata]]\nname = "megatron-bridge"\nversion = "0.6.1"\n'
    )
    bridge = bridge_toml(
        body='[[tool.uv.index]]\nname = "flashinfer"\nurl = "https://flashinfer.ai/whl/"\n'
    )
    layout = nested(root=root, bridge=bridge)
    before = check_pins("--repo", layout.root, "--format", "json")
    assert sorted(before.codes()) == ["RF003", "RF004"]  # 0.6.1 (metadata) vs bridge's own 0.6.2
    result = check_pins("--repo", layout.root, "--fix", "--format", "json")
    assert result.code == 0 and result.json["fix"]["applied"]
    text = (layout.root / "pyproject.toml").read_text()
    assert 'url = "https://flashinfer.ai/whl/"' in text and 'version = "0.6.2"' in text


def test_fix_refuses_when_submodules_disagree(nested):
    bridge = bridge_toml(
        deps='"megatron-core[dev]", "emerging-optimizers"',
        body=f'emerging-optimizers = {{ git = "{EMO_URL}", rev = "v0.4.0" }}\n',
    )
    layout = nested(root=root_toml(emo="v0.2.0"), bridge=bridge, lm=lm_toml(emo="v0.3.0"))
    path = layout.root / "pyproject.toml"
    before = path.read_bytes()
    result = check_pins("--repo", layout.root, "--fix")
    assert result.code == 1
    assert "--fix refused; pyproject.toml left untouched" in result.out
    assert (
        "not fixed [RF001] `emerging-optimizers`: the submodules pin different values" in result.out
    )
    assert path.read_bytes() == before


def test_fix_refuses_a_range_where_the_root_pins_one_version(nested):
    root = root_toml().replace(
        'mcore = ["megatron-bridge"]',
        'mcore = ["megatron-bridge", "flashinfer-python==0.6.8.post1"]',
    )
    bridge = bridge_toml(deps='"megatron-core[dev]", "flashinfer-python>=0.6.18"')
    layout = nested(root=root, bridge=bridge)
    before = (layout.root / "pyproject.toml").read_bytes()
    result = check_pins("--repo", layout.root, "--fix")
    assert result.code == 1
    assert "the submodule allows a range (`>=0.6.18`), not one version" in result.out
    assert (layout.root / "pyproject.toml").read_bytes() == before


def test_fix_with_nothing_to_fix_writes_nothing(nested):
    layout = nested()
    before = (layout.root / "pyproject.toml").read_bytes()
    result = check_pins("--repo", layout.root, "--fix")
    assert result.code == 0 and "---" not in result.out
    assert (layout.root / "pyproject.toml").read_bytes() == before


def test_atomic_write_refuses_a_file_changed_since_it_was_read(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text("edited by someone else meanwhile\n")
    with pytest.raises(OSError, match="changed while check-pins was fixing it"):
        write_atomically(path, "new text\n", expected_old="what check-pins read\n")
    assert path.read_text() == "edited by someone else meanwhile\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pyproject.toml"]  # no temp file left


def test_fix_keeps_tag_key_and_crlf_line_endings(nested):
    """A CRLF file stays CRLF (the diff shows one line) and `tag` stays `tag`."""
    body = f'emerging-optimizers = {{ git = "{EMO_URL}", tag = "v0.2.0" }}  # pinned\n'
    root = root_toml(body=body).replace(
        f'"emerging-optimizers @ git+{EMO_URL}@v0.3.0",', '"emerging-optimizers",'
    )
    layout = nested(root=root.replace("\n", "\r\n"))
    path = layout.root / "pyproject.toml"
    before = path.read_bytes()
    result = check_pins("--repo", layout.root, "--fix")
    assert result.code == 0, result.out
    after = path.read_bytes()
    assert after == before.replace(b'tag = "v0.2.0"', b'tag = "v0.3.0"')
    changed = [line for line in result.out.split("\n") if line.startswith(("-", "+"))]
    assert len(changed) == 4, result.out  # ---, +++, one line out, one line in


def test_fix_keeps_a_bom(nested):
    layout = nested(root="\ufeff" + root_toml(emo="v0.2.0"))
    path = layout.root / "pyproject.toml"
    before = path.read_text(encoding="utf-8")
    assert check_pins("--repo", layout.root, "--fix").code == 0
    assert path.read_text(encoding="utf-8") == before.replace("@v0.2.0", "@v0.3.0")
