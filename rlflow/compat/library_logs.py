"""Keep megatron-core / megatron-bridge / transformers chatter out of training logs.

megatron-bridge sets the *root* logger to INFO with its own stdout handler when imported, and
logs import probes (e.g. Transformer Engine's FP8 manager) with full tracebacks; megatron-core's
DDP logs every parameter name; megatron-core's sources warn as Python compiles them. None of it
helps a user reading an sbatch log, and none of it is something a user can act on. Warnings and
errors about the user's own run still come through.
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
    # Python warns while it compiles a source file (so whenever no bytecode is there: a fresh
    # install, PYTHONDONTWRITEBYTECODE); such a warning's module is the file's path.
    # megatron-core 0.19.2's docstrings hold invalid escape sequences ('\-').
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[\\/]megatron[\\/]")
    warnings.filterwarnings("ignore", message=r".*cap_pixels_per_frame.*")


def quiet_loading() -> None:
    """megatron-bridge draws a rich progress bar for every checkpoint it loads (cut to the
    console's 80 columns in a log file, and drawn again for the reference model) and prints each
    model's parameter count: rlflow's loader prints one whole line instead (rlflow/model/
    build.py). Call after importing megatron.bridge."""
    from megatron.bridge.models import model_provider
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    tracking = MegatronModelBridge._with_progress_tracking
    if not getattr(tracking, "rlflow_quiet", False):

        def without_bar(self, tasks, description, show_progress=True):
            return tracking(self, tasks, description, show_progress=False)

        without_bar.rlflow_quiet = True
        MegatronModelBridge._with_progress_tracking = without_bar
    model_provider._print_num_params = _print_nothing


def _print_nothing(*args, **kwargs) -> None:
    pass


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def restore_root() -> None:
    """Undo megatron-bridge's root-logger change after it has been imported."""
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
