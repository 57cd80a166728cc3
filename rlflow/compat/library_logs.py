"""Keep megatron-core / megatron-bridge / transformers chatter out of training logs.

megatron-bridge sets the *root* logger to INFO with its own stdout handler when imported, and
logs import probes (e.g. Transformer Engine's FP8 manager) with full tracebacks; megatron-core's
DDP logs every parameter name. None of it helps a user reading an sbatch log. Warnings and
errors still come through.
"""

from __future__ import annotations

import logging
import warnings

_NOISY = (
    "megatron",
    "megatron.core",
    "megatron.bridge",
    "megatron.training",
    "transformers",
    "torch.distributed",
)
# Notices nobody can act on: "fusion disabled without TE/apex", "GPTModel is deprecated",
# "no CUDA runtime" when torch's extension helpers load on a CPU machine.
_NOTICES = (
    "megatron.bridge.utils.fusions",
    "megatron.core.models.gpt.gpt_model",
    "torch.utils.cpp_extension",
)


def quiet() -> None:
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _NOTICES:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # e.g. megatron-bridge's `torch_dtype is deprecated`
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    # Its optional-import probes log full tracebacks, and the bridge resets logger levels when it
    # is imported: a filter (which survives that) drops them.
    probes = logging.getLogger("megatron.bridge.utils.import_utils")
    if not any(isinstance(f, _DropAll) for f in probes.filters):
        probes.addFilter(_DropAll())
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*cap_pixels_per_frame.*")


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def restore_root() -> None:
    """Undo megatron-bridge's root-logger change after it has been imported."""
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
