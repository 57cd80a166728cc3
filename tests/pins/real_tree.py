"""The real NeMo-RL (7ea279ab) -> Megatron-Bridge (8c46dc42) -> Megatron-LM (14346b65) tree,
rebuilt as real nested git repositories from the vendored files (data/README.md): NeMo-RL's own
.gitmodules (GitHub URLs, as cloned), Bridge nesting Megatron-LM, Gym and Automodel beside it,
and the three real uv.lock files. Gitlinks are this test's commits of those files."""

from __future__ import annotations

import tarfile
from pathlib import Path

from pins_helpers import git, make_repo

DATA = Path(__file__).parent / "data" / "nemo-rl-tree.tar.xz"
BRIDGE = "3rdparty/Megatron-Bridge-workspace/Megatron-Bridge"
LM = f"{BRIDGE}/3rdparty/Megatron-LM"
GYM = "3rdparty/Gym-workspace/Gym"
AUTOMODEL = "3rdparty/Automodel-workspace/Automodel"


def files(base: Path, name: str) -> dict[str, str]:
    root = base / "files" / name
    return {
        p.relative_to(root).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def build(base: Path, locks: bool = True) -> Path:
    with tarfile.open(DATA) as archive:
        archive.extractall(base / "files", filter="data")

    def repo(name: str) -> Path:
        content = files(base, name)
        if not locks:
            content = {k: v for k, v in content.items() if not k.endswith("uv.lock")}
        return make_repo(base / "upstream" / name, content)

    upstream = {name: repo(name) for name in ("lm", "bridge", "gym", "automodel")}
    nest(upstream["bridge"], upstream["lm"], "3rdparty/Megatron-LM")
    git(upstream["bridge"], "commit", "-qm", "Megatron-LM")
    root = repo("rl")
    nest(root, upstream["bridge"], BRIDGE)
    nest(root / BRIDGE, upstream["lm"], "3rdparty/Megatron-LM", stage=False)
    nest(root, upstream["gym"], GYM)
    nest(root, upstream["automodel"], AUTOMODEL)
    git(root, "commit", "-qm", "submodules")
    return root


def nest(parent: Path, upstream: Path, path: str, stage: bool = True) -> None:
    """A clone at `path` recorded as a gitlink; the real .gitmodules already declares it."""
    git(parent, "clone", "-q", str(upstream), path)
    if stage:
        git(parent, "add", path)
