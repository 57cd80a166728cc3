"""What a per-node environment holds (the pin set) and where it lives (a folder named by its hash).

The recipe's `generation.vllm` section gives one pin set per device kind (`cpu`, `cuda`); the
node's kind picks one. The folder name carries a hash of everything that shapes the install
(interpreter, packages, removals, the torchvision patch's source), so changing any pin gives a
new folder and an untouched old one: a running job never sees its environment change under it.
Standard library only: `rlflow submit --dry-run` and the trainer's start-up check import this.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

# Bump when the build steps change in a way the pin set does not show (forces a rebuild).
BUILDER_VERSION = 1
MARKER = "rlflow-env.json"  # written last: its presence means the build finished
PATCH_TORCHVISION = Path(__file__).with_name("patch_torchvision.py")


@dataclass(frozen=True)
class EnvSpec:
    name: str  # what the environment is for ("vllm")
    device: str  # "cpu" | "cuda"
    python: str  # interpreter version, e.g. "3.11"
    installer: str  # "pip" (honours PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL) | "uv"
    packages: tuple[str, ...]  # requirement specifiers, pinned
    remove: tuple[str, ...]  # uninstalled after the install (CUDA-only builds on CPU nodes)
    patch_torchvision: bool  # make PyPI's CUDA torchvision importable next to a +cpu torch
    imports: tuple[str, ...] = ()  # modules a finished build must import (its last check)

    @property
    def digest(self) -> str:
        fields = asdict(self)
        fields["builder"] = BUILDER_VERSION
        if self.patch_torchvision:
            fields["patch"] = hashlib.sha256(PATCH_TORCHVISION.read_bytes()).hexdigest()
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def path(self, root: str | Path) -> Path:
        return expand_root(root) / f"{self.name}-{self.device}-{self.digest}"

    def describe(self) -> str:
        return f"{self.name} ({self.device}, Python {self.python}): {' '.join(self.packages)}"


def expand_root(root: str | Path) -> Path:
    """`~` and `$VARS` expanded (e.g. `$SLURM_TMPDIR/rlflow-envs` for node-local disks)."""
    return Path(os.path.expandvars(os.path.expanduser(str(root)))).absolute()


def detect_device() -> str:
    """ "cuda" on a node with an NVIDIA driver, else "cpu" (no torch import: this runs anywhere)."""
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl"):
        return "cuda"
    return "cpu"


def vllm_spec(vllm_cfg, device: str | None = None) -> EnvSpec:
    """The vLLM pin set for this node (recipe `generation.vllm`), by device kind."""
    kind = device or (detect_device() if vllm_cfg.device == "auto" else vllm_cfg.device)
    pins = getattr(vllm_cfg, kind)
    return EnvSpec(
        name="vllm",
        device=kind,
        python=pins.python,
        installer=pins.installer,
        packages=tuple(pins.packages),
        remove=tuple(pins.remove),
        patch_torchvision=pins.patch_torchvision,
        imports=("torch", "vllm"),
    )


def read_marker(env_dir: Path) -> dict | None:
    try:
        return json.loads((env_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def setup_command_hint(spec: EnvSpec) -> str:
    return f"rlflow setup-env {spec.name} RECIPE" + (
        f" --device {spec.device}" if spec.device != detect_device() else ""
    )
