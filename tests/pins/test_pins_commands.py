"""The commands check-pins suggests work when pasted at the repository root: each test runs them
(with a shell, as a user would) for the nested Megatron-LM, then checks again.

Before issue 11, `git add <nested path>` said "Pathspec is in submodule" and
`git submodule update --init --recursive <nested path>` said "did not match any file(s)".
"""

from __future__ import annotations

import os
import re
import subprocess

from pins_helpers import BRIDGE_PATH, EMO_URL, GIT_ENV, LM_PATH, check_pins, git, root_toml


def suggested(output: str, code: str) -> list[str]:
    """Every `git ...` command in the help line of the first `code` diagnostic."""
    block = output[output.index(f"[{code}]") :]
    help_line = next(line for line in block.splitlines() if line.startswith("help:"))
    return re.findall(r"`(git [^`]+)`", help_line)


def paste(root, command: str) -> None:
    done = subprocess.run(
        command,
        shell=True,
        cwd=root,
        env={**os.environ, **GIT_ENV, "GIT_ALLOW_PROTOCOL": "file"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"`{command}` failed at the root: {done.stderr}"


def test_rf007_nested_update_command(nested):
    layout = nested()
    git(layout.bridge, "submodule", "deinit", "-q", "-f", "3rdparty/Megatron-LM")
    result = check_pins("--repo", layout.root)
    (command,) = suggested(result.out, "RF007")
    assert command == (
        "git -C submodules/Megatron-Bridge submodule update --init --recursive 3rdparty/Megatron-LM"
    )
    paste(layout.root, "git -c protocol.file.allow=always " + command.removeprefix("git "))
    assert check_pins("--repo", layout.root, "--strict").code == 0


def _move_lm_head(layout) -> None:
    (layout.lm / "README").write_text("x\n")
    git(layout.lm, "add", "README")
    git(layout.lm, "commit", "-qm", "local commit")


def test_rf006_nested_add_command(nested):
    layout = nested()
    _move_lm_head(layout)
    result = check_pins("--repo", layout.root)
    update, add = suggested(result.out, "RF006")
    assert add == "git -C submodules/Megatron-Bridge add 3rdparty/Megatron-LM"
    paste(layout.root, add)
    assert "RF006" not in check_pins("--repo", layout.root).out


def test_rf006_nested_update_command(nested):
    layout = nested()
    _move_lm_head(layout)
    update, _ = suggested(check_pins("--repo", layout.root).out, "RF006")
    paste(layout.root, update)
    assert check_pins("--repo", layout.root, "--strict").code == 0


def test_rf008_nested_commands(nested):
    layout = nested()
    path = layout.lm / "pyproject.toml"
    path.write_text(path.read_text() + "\n# local edit\n")
    result = check_pins("--repo", layout.root)
    add, discard = suggested(result.out, "RF008")
    assert add == "git -C submodules/Megatron-Bridge add 3rdparty/Megatron-LM"
    assert discard == f"git -C {LM_PATH} checkout -- pyproject.toml"
    paste(layout.root, discard)
    assert check_pins("--repo", layout.root, "--strict").code == 0


def test_rf002_location_is_printed_once(nested):
    """The warning's arrow is the submodule pin; its note must not repeat the same file:line."""
    root = root_toml().replace(
        f'    "emerging-optimizers @ git+{EMO_URL}@v0.3.0",  # bumped with the submodule\n', ""
    )
    root = root.replace(f'megatron-bridge = {{ path = "{BRIDGE_PATH}", editable = true }}', "")
    result = check_pins("--repo", nested(root=root).root)
    warning = result.out[result.out.index("warning[RF002]") :]
    locations = re.findall(r"pyproject\.toml:\d+", warning.split("\n\n")[0])
    assert len(locations) == len(set(locations)) == 1, warning
