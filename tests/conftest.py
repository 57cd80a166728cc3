"""Session-wide fixtures: one single-rank megatron-core parallel state, a tiny checkpoint, the
vLLM CPU environment (built once per machine, shared by tests/generation and tests/envs) and the
Slurm cluster (one per session, shared by tests/launch and tests/job)."""

from __future__ import annotations

from dataclasses import replace

import pytest

# Fixtures every test folder sees: the session's cluster, and the per-test checked view of it.
from tests.slurm.cluster import slurm_cluster, slurm_session  # noqa: F401


@pytest.fixture(scope="session")
def single_rank():
    """torch.distributed (gloo, world 1) + megatron parallel state, once per test process."""
    from rlflow.compat import library_logs
    from tests.tiny import init_single_rank

    library_logs.quiet()
    return init_single_rank()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from tests.tiny import tiny_checkpoint

    return tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def family_ckpt(tmp_path_factory):
    """builtin name -> that family's tiny checkpoint, written once per session (lm_head scaled
    x8 so greedy decoding has no near-ties), e.g. family_ckpt("tiny-qwen3vl")."""
    from rlflow.model import family

    written = {}

    def get(name: str):
        if name not in written:
            folder = tmp_path_factory.mktemp(name)
            written[name] = family.by_builtin(name).write_tiny(
                folder, name, seed=0, lm_head_scale=8.0
            )
        return written[name]

    return get


@pytest.fixture(scope="session")
def tiny_policy(single_rank, tiny_ckpt):
    """The tiny checkpoint as a frozen Megatron policy (fp32)."""
    from rlflow.model.build import load_policy
    from tests.tiny import FP32, SINGLE

    return load_policy(tiny_ckpt, FP32, SINGLE, trainable=False)


@pytest.fixture(scope="session")
def hybrid_policy(single_rank, family_ckpt):
    """(policy, tokenizer, checkpoint) of the tiny Nemotron-H (Mamba-2 + attention + MLP), fp32,
    frozen: the generation engine's and the server's hybrid tests share it."""
    from tests.tiny import frozen_policy

    path = family_ckpt("tiny-nemotron-h")
    return (*frozen_policy(path), path)


@pytest.fixture(scope="session")
def tiny_processor(tiny_ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_ckpt))


@pytest.fixture(scope="session")
def vllm_gen_cfg():
    """The tiny CPU recipe's generation section with backend=vllm, on the CPU pin set."""
    from rlflow.rules import load_checked
    from tests.tiny import TINY_CPU_RECIPE

    gen = load_checked(TINY_CPU_RECIPE, ["generation.backend=vllm"]).recipe.generation
    return replace(gen, vllm=replace(gen.vllm, device="cpu"))


@pytest.fixture(scope="session")
def vllm_env(vllm_gen_cfg):
    from rlflow.envs.build import ensure_env
    from rlflow.envs.spec import vllm_spec

    cfg = vllm_gen_cfg.vllm
    return ensure_env(vllm_spec(cfg), cfg.env_root)


# --- the fast tier: `uv run pytest -m "not slow"` (README: "Set up") -----------------------------
# Slow: a test that starts the Slurm cluster, loads a megatron-core model, trains, or runs vLLM.
# Marked here, by what a test uses, so a new test of that kind is slow without remembering to
# say so. CI runs everything (`uv run pytest`).
SLOW_FIXTURES = {
    "slurm_cluster",
    "single_rank",
    "tiny_ckpt",
    "tiny_policy",
    "tiny_processor",
    "family_ckpt",
    "hybrid_policy",
}
SLOW_PATHS = (
    "tests/model/",  # megatron-core models against HF
    "tests/generation/",  # megatron, HF and vLLM generation
    "tests/envs/",  # real venvs built with pip and uv, and the vLLM environment
    "tests/train/test_train_runs.py",  # end-to-end GRPO runs
    "tests/train/test_train_async.py",  # multi-rank runs with generation ranks of their own
    "tests/train/test_train_user_task.py",
    "tests/train/test_train_gym.py",  # real NeMo Gym servers, GRPO runs through them
    "tests/train/test_train_signals.py",  # the real trainer stopped by a signal
    "tests/train/test_train_reward_failures.py",  # 2 ranks, a reward worker dies
    "tests/train/test_train_checkpoint_resume.py",
    "tests/train/test_train_grpo_update.py",
    "tests/train/test_train_packing.py",
    "tests/train/test_train_wandb_log.py",  # a GRPO run logged to W&B (offline) and resumed
    "tests/job/test_job_local_resume.py",  # 2 real ranks stopped by signals, resumed
    "tests/launch/test_launch_slurm.py",  # the Slurm cluster (also through fixtures)
    "tests/job/test_job_recovery.py",
    "tests/job/test_job_watchdog.py",  # real stuck, stopped and killed rank processes
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.relative_to(config.rootpath).as_posix()
        if SLOW_FIXTURES & set(item.fixturenames) or path.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
