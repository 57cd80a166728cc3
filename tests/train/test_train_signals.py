"""The time-limit warning still reaches rlflow after a library takes the rank's signal handlers.

On GPUs, Triton's first kernel compile installs LLVM's signal handlers in the rank (MLIR's crash
reproducer), and LLVM's SIGUSR1 handler swallows the signal (benchmarks/signal_gpu.md). The same
compile runs on a CPU: Triton compiles for a GPU target without one. Here a user reward that runs
in the trainer (scoring.num_workers: 0) makes that compile during step 1, and records which
library handles each signal at the C level (sigaction, read-only) on every call. The real
trainer, through the console script: after model load, the compile and step 1, rlflow's handlers
are back, and a SIGUSR1 at step 2 saves and exits 75.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = ROOT / ".venv" / "bin" / "rlflow"
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"

REWARD = '''
import json, os, signal

from rlflow.train import sigstate

WATCHED = (signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM)
calls = 0


def owners():
    return {s.name: sigstate.owner(s) for s in WATCHED}


def compile_triton():
    """Triton's first compile (for an H100: no GPU needed); MLIR installs LLVM's handlers."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def twice(src, dst, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i) * 2)

    source = ASTSource(fn=twice, signature={"src": "*fp32", "dst": "*fp32"},
                       constexprs={"BLOCK": 64})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))


def reward(batch):
    global calls
    calls += 1
    record = {"call": calls, "owners": owners()}
    if calls == 1:
        compile_triton()
        record["after_compile"] = owners()
    with open(os.environ["SIGNAL_RECORD"], "a") as out:
        out.write(json.dumps(record) + "\\n")
    return [0.0] * len(batch)
'''

RECIPE = f"""
defaults: {TINY}
rewards: {{format: 0.5, exact_match: 0.5, "owners:reward": 0.1}}
scoring: {{num_workers: 0}}
"""

QUICK = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=4",
    "grpo.val_at_start=false",
    "grpo.val_period=0",
    "warm_start.num_steps=2",
    "warm_start.batch_size=8",
    "checkpointing.save_period=1000",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


def test_a_library_taking_the_handlers_does_not_lose_the_warning(tmp_path):
    (tmp_path / "owners.py").write_text(REWARD)
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    record = tmp_path / "owners.jsonl"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        SIGNAL_RECORD=str(record),
        RLFLOW_TEST_SIGNAL="0:step2:USR1",  # Slurm's warning, sent as step 2 begins
        TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),  # a cache hit would skip the compile
        RLFLOW_SIGNAL_TRACE=str(tmp_path / "trace.jsonl"),
    )
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(RLFLOW), "train", "recipe.yaml", *QUICK, "--run-dir", str(run_dir)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    rlflow_handlers = calls[0]["owners"]  # installed at setup, before the reward's first call
    taken = calls[0]["after_compile"]
    # The stand-in is real: Triton's compile replaced the handlers inside the trainer.
    assert all(taken[name] != rlflow_handlers[name] for name in ("SIGUSR1", "SIGHUP")), calls
    # After step 1 (model loaded, compiled, one step done) they are rlflow's again, at the C level.
    assert calls[1]["owners"] == rlflow_handlers, calls
    assert "had replaced the SIGUSR1 handler at the C level" in result.stderr
    assert result.returncode == 75, result.stderr[-6000:]
    assert "stopping at step 2 on SIGUSR1: checkpoint saved" in result.stderr
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
