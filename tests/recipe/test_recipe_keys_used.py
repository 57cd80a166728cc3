"""No setting is accepted and then ignored: every schema key is read by the code that acts on it,
or its unimplemented values are refused by the dry run and by `rlflow train` at setup.

"Read" is checked honestly but cheaply: `READ_BY` names, for every key, the module that acts on
it and the expression there that reads it (as `ast.unparse` writes it); the test parses the
module and finds that expression. A new key without an entry fails here, so whoever adds it says
where it takes effect; a refactor that moves the read updates the entry. Reads in
rlflow/recipe/ (the rules) do not count, except the allocation rules for `cluster`, which is the
job's shape those rules act on. The keys rlflow does not implement beyond one value are refused
(`REFUSED`), and tested for real below: console-script dry run, and train's setup check.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import subprocess
import typing
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.recipe import schema
from rlflow.rules import load_checked
from rlflow.rules.allocation import check_allocation

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"

# key -> (module that acts on it, the expression there that reads it)
READ_BY = {
    "run.name": ("rlflow/launch/plan.py", "recipe.run.name"),
    "run.output_dir": ("rlflow/launch/plan.py", "recipe.run.output_dir"),
    "run.seed": ("rlflow/train/setup.py", "recipe.run.seed"),
    "model.checkpoint": ("rlflow/train/setup.py", "recipe.model.checkpoint"),
    "model.dtype": ("rlflow/model/build.py", "model_cfg.dtype"),
    "model.freeze_vision": ("rlflow/train/setup.py", "recipe.model.freeze_vision"),
    "model.tiny_seed": ("rlflow/model/build.py", "model_cfg.tiny_seed"),
    **{
        f"model.moe.{key}": ("rlflow/model/moe/experts.py", f"cfg.{key}")
        for key in ("grouped_experts", "router_dtype")
    },
    **{  # configure_router: the router settings every MoE family shares
        f"model.moe.{key}": ("rlflow/model/moe/experts.py", f"moe_cfg.{key}")
        for key in ("router_topk", "aux_loss_coeff", "z_loss_coeff")
    },
    "loss.router_replay": ("rlflow/train/update.py", "loss_cfg.router_replay"),
    "loss.stop_on_mult_prob_error": (
        "rlflow/train/loop.py",
        "t.recipe.loss.stop_on_mult_prob_error",
    ),
    "data.train.kind": ("rlflow/data/dataset.py", "split_cfg.kind"),
    "data.train.num_samples": ("rlflow/data/dataset.py", "split_cfg.num_samples"),
    "data.train.seed": ("rlflow/data/dataset.py", "split_cfg.seed"),
    "data.train.path": ("rlflow/data/dataset.py", "split_cfg.path"),
    "data.train.image_root": ("rlflow/data/dataset.py", "split_cfg.image_root"),
    "data.image_size": ("rlflow/data/dataset.py", "data_cfg.image_size"),
    "data.max_objects": ("rlflow/data/dataset.py", "data_cfg.max_objects"),
    "data.mix": ("rlflow/data/dataset.py", "data_cfg.mix"),
    "data.prompt_suffix": ("rlflow/train/collect.py", "t.recipe.data.prompt_suffix"),
    "data.prompt_template": ("rlflow/data/dataset.py", "data_cfg.prompt_template"),
    "data.max_prompt_tokens": ("rlflow/train/setup.py", "recipe.data.max_prompt_tokens"),
    "data.video.num_frames": ("rlflow/data/dataset.py", "data_cfg.video.num_frames"),
    # the processor folds the checkpoint's own number of frames: the key must equal it
    "data.video.temporal_patch_size": ("rlflow/rules/checks.py", "video.temporal_patch_size"),
    "data.video.fps": ("rlflow/model/processor.py", "self.data_cfg.video.fps"),
    "rewards": ("rlflow/train/setup.py", "recipe.rewards"),
    "scoring.accuracy": ("rlflow/train/setup.py", "scoring.accuracy"),
    "scoring.num_workers": ("rlflow/train/setup.py", "scoring.num_workers"),
    "scoring.timeout_s": ("rlflow/train/setup.py", "scoring.timeout_s"),
    "grpo.num_prompts_per_step": ("rlflow/train/collect.py", "cfg.num_prompts_per_step"),
    "grpo.num_generations_per_prompt": (
        "rlflow/train/collect.py",
        "recipe.grpo.num_generations_per_prompt",
    ),
    "grpo.max_num_steps": ("rlflow/train/loop.py", "recipe.grpo.max_num_steps"),
    "grpo.num_minibatches": ("rlflow/train/loop.py", "recipe.grpo.num_minibatches"),
    "grpo.normalize_rewards": ("rlflow/train/collect.py", "cfg.normalize_rewards"),
    "grpo.use_leave_one_out_baseline": (
        "rlflow/train/collect.py",
        "cfg.use_leave_one_out_baseline",
    ),
    "grpo.val_period": ("rlflow/train/loop.py", "cfg.val_period"),
    "grpo.val_at_start": ("rlflow/train/loop.py", "recipe.grpo.val_at_start"),
    "grpo.val_at_end": ("rlflow/train/loop.py", "cfg.val_at_end"),
    "grpo.max_val_samples": ("rlflow/train/loop.py", "recipe.grpo.max_val_samples"),
    "grpo.dynamic_sampling.enabled": ("rlflow/train/collect.py", "dynamic.enabled"),
    "grpo.dynamic_sampling.max_extra_rounds": (
        "rlflow/train/collect.py",
        "dynamic.max_extra_rounds",
    ),
    "loss.ratio_clip_low": ("rlflow/train/update.py", "loss_cfg.ratio_clip_low"),
    "loss.ratio_clip_high": ("rlflow/train/update.py", "loss_cfg.ratio_clip_high"),
    "loss.kl_penalty": ("rlflow/train/update.py", "loss_cfg.kl_penalty"),
    "loss.kl_type": ("rlflow/train/update.py", "loss_cfg.kl_type"),
    "loss.token_level_loss": ("rlflow/train/update.py", "loss_cfg.token_level_loss"),
    "loss.ratio_level": ("rlflow/train/update.py", "loss_cfg.ratio_level"),
    "loss.overlong_penalty.enabled": ("rlflow/train/collect.py", "cfg.enabled"),
    "loss.overlong_penalty.buffer_tokens": ("rlflow/train/collect.py", "cfg.buffer_tokens"),
    "loss.overlong_penalty.penalty": ("rlflow/train/collect.py", "cfg.penalty"),
    "loss.importance_sampling.mode": ("rlflow/train/update.py", "cfg.mode"),
    "loss.importance_sampling.cap": ("rlflow/train/update.py", "cfg.cap"),
    "loss.importance_sampling.mask_below": ("rlflow/train/update.py", "cfg.mask_below"),
    "optimizer.lr": ("rlflow/train/update.py", "cfg.lr"),
    "optimizer.weight_decay": ("rlflow/train/update.py", "cfg.weight_decay"),
    "optimizer.adam_beta1": ("rlflow/train/update.py", "cfg.adam_beta1"),
    "optimizer.adam_beta2": ("rlflow/train/update.py", "cfg.adam_beta2"),
    "optimizer.adam_eps": ("rlflow/train/update.py", "cfg.adam_eps"),
    "optimizer.max_grad_norm": ("rlflow/train/update.py", "cfg.max_grad_norm"),
    "optimizer.micro_batch_size": ("rlflow/train/update.py", "cfg.micro_batch_size"),
    "optimizer.max_tokens_per_micro_batch": (
        "rlflow/train/update.py",
        "cfg.max_tokens_per_micro_batch",
    ),
    "optimizer.sequence_packing": ("rlflow/train/update.py", "cfg.sequence_packing"),
    "warm_start.num_steps": ("rlflow/train/loop.py", "t.recipe.warm_start.num_steps"),
    "warm_start.lr": ("rlflow/train/loop.py", "cfg.lr"),
    "warm_start.batch_size": ("rlflow/train/loop.py", "cfg.batch_size"),
    "generation.backend": ("rlflow/generation/factory.py", "gen_cfg.backend"),
    "generation.max_new_tokens": ("rlflow/train/collect.py", "recipe.generation.max_new_tokens"),
    "generation.temperature": ("rlflow/train/collect.py", "recipe.generation.temperature"),
    "generation.top_p": ("rlflow/train/collect.py", "gen.top_p"),
    "generation.top_k": ("rlflow/train/collect.py", "gen.top_k"),
    "generation.val_temperature": ("rlflow/train/loop.py", "recipe.generation.val_temperature"),
    "generation.max_batch_size": ("rlflow/generation/factory.py", "gen_cfg.max_batch_size"),
    "generation.share_prompts": ("rlflow/generation/factory.py", "gen_cfg.share_prompts"),
    "generation.cuda_graphs": ("rlflow/generation/factory.py", "gen_cfg.cuda_graphs"),
    "generation.compile_decode": ("rlflow/generation/factory.py", "gen_cfg.compile_decode"),
    "generation.fp8": ("rlflow/generation/factory.py", "gen_cfg.fp8"),
    "generation.release_cache": ("rlflow/generation/factory.py", "gen_cfg.release_cache"),
    "generation.kv_cache_tokens": ("rlflow/generation/factory.py", "gen_cfg.kv_cache_tokens"),
    "generation.vllm.env_root": ("rlflow/generation/factory.py", "gen_cfg.vllm.env_root"),
    "generation.partial_rollouts.enabled": (
        "rlflow/train/setup.py",
        "recipe.generation.partial_rollouts.enabled",
    ),
    "generation.partial_rollouts.budget_steps": ("rlflow/train/partial.py", "cfg.budget_steps"),
    "generation.partial_rollouts.finished_fraction": (
        "rlflow/train/partial.py",
        "cfg.finished_fraction",
    ),
    "generation.partial_rollouts.max_staleness_steps": (
        "rlflow/train/partial.py",
        "cfg.max_staleness_steps",
    ),
    "generation.server.max_rows": ("rlflow/serve/runner.py", "server.max_rows"),
    "generation.server.context_tokens": ("rlflow/serve/runner.py", "server.context_tokens"),
    "generation.server.on_weight_update": ("rlflow/serve/runner.py", "server.on_weight_update"),
    "generation.server.max_prefill_tokens": (
        "rlflow/serve/runner.py",
        "server.max_prefill_tokens",
    ),
    "generation.server.enabled": ("rlflow/serve/job.py", "recipe.generation.server.enabled"),
    "generation.server.ready_timeout_s": (
        "rlflow/serve/job.py",
        "recipe.generation.server.ready_timeout_s",
    ),
    "generation.server.host": ("rlflow/serve/start.py", "server_cfg.host"),
    "generation.server.port": ("rlflow/serve/start.py", "server_cfg.port"),
    "generation.server.max_connections": ("rlflow/serve/start.py", "server_cfg.max_connections"),
    "generation.server.idle_timeout_s": ("rlflow/serve/start.py", "server_cfg.idle_timeout_s"),
    "environment.gym.config_paths": ("rlflow/train/gym/servers.py", "cfg.config_paths"),
    "environment.gym.agent": ("rlflow/train/gym/servers.py", "cfg.agent"),
    "environment.gym.resource_servers": ("rlflow/train/gym/servers.py", "cfg.resource_servers"),
    "environment.gym.head_port": ("rlflow/train/gym/servers.py", "cfg.head_port"),
    "environment.gym.tasks": ("rlflow/train/gym/tasks.py", "cfg.tasks"),
    "environment.gym.concurrency": ("rlflow/train/gym/episodes.py", "self.env.gym.concurrency"),
    "environment.gym.ready_timeout_s": ("rlflow/train/gym/source.py", "self.cfg.ready_timeout_s"),
    "generation.vllm.device": ("rlflow/envs/spec.py", "vllm_cfg.device"),
    # the cpu and cuda pin sets: vllm_spec picks one by device and reads all five of its keys
    **{
        f"generation.vllm.{device}.{key}": ("rlflow/envs/spec.py", f"pins.{key}")
        for device in ("cpu", "cuda")
        for key in ("python", "installer", "packages", "remove", "patch_torchvision")
    },
    "generation.vllm.kv_cache_space_gb": (
        "rlflow/generation/vllm/client.py",
        "self.cfg.kv_cache_space_gb",
    ),
    "generation.vllm.gpu_memory_utilization": (
        "rlflow/generation/vllm/client.py",
        "self.cfg.gpu_memory_utilization",
    ),
    "generation.vllm.enforce_eager": ("rlflow/generation/vllm/client.py", "self.cfg.enforce_eager"),
    "generation.vllm.startup_timeout_s": (
        "rlflow/generation/vllm/client.py",
        "self.cfg.startup_timeout_s",
    ),
    "generation.vllm.request_timeout_s": (
        "rlflow/generation/vllm/client.py",
        "self.cfg.request_timeout_s",
    ),
    # Which ranks generate: the allocation rules compute the split (Placement), which
    # parallel.py and setup act on; the dry run prints it.
    "generation.placement": ("rlflow/rules/allocation.py", "gen.placement"),
    "generation.gpus_per_node": ("rlflow/rules/allocation.py", "gen.gpus_per_node"),
    "generation.num_nodes": ("rlflow/rules/allocation.py", "gen.num_nodes"),
    "generation.tensor_parallel_size": (
        "rlflow/train/setup.py",
        "recipe.generation.tensor_parallel_size",
    ),
    "generation.sync_bucket_mb": (
        "rlflow/train/generation_role/remote.py",
        "recipe.generation.sync_bucket_mb",
    ),
    "async_grpo.max_staleness": (
        "rlflow/train/generation_role/remote.py",
        "self.recipe.async_grpo.max_staleness",
    ),
    "parallelism.tensor_parallel_size": ("rlflow/parallel.py", "cfg.tensor_parallel_size"),
    "parallelism.pipeline_parallel_size": ("rlflow/parallel.py", "cfg.pipeline_parallel_size"),
    "parallelism.context_parallel_size": ("rlflow/parallel.py", "cfg.context_parallel_size"),
    "parallelism.expert_parallel_size": ("rlflow/parallel.py", "cfg.expert_parallel_size"),
    "parallelism.sequence_parallel": ("rlflow/rules/allocation.py", "par.sequence_parallel"),
    "cluster.num_nodes": ("rlflow/rules/allocation.py", "cluster.num_nodes"),
    "cluster.gpus_per_node": ("rlflow/rules/allocation.py", "cluster.gpus_per_node"),
    "checkpointing.enabled": ("rlflow/train/checkpoint.py", "cfg.enabled"),
    "checkpointing.save_period": ("rlflow/train/checkpoint.py", "cfg.save_period"),
    "checkpointing.keep_last": ("rlflow/train/setup.py", "recipe.checkpointing.keep_last"),
    "checkpointing.hf_export_period": ("rlflow/train/hf_export.py", "cfg.hf_export_period"),
    "checkpointing.hf_export_keep_last": ("rlflow/train/hf_export.py", "cfg.hf_export_keep_last"),
    "checkpointing.save_on_signal": (
        "rlflow/train/setup.py",
        "recipe.checkpointing.save_on_signal",
    ),
    "logging.tensorboard": ("rlflow/train/setup.py", "recipe.logging.tensorboard"),
    "logging.progress_bar": ("rlflow/train/setup.py", "recipe.logging.progress_bar"),
    "logging.rollout_dump_period": ("rlflow/train/loop.py", "recipe.logging.rollout_dump_period"),
    "environment.kind": ("rlflow/environment/factory.py", "cfg.kind"),
    "environment.max_turns": ("rlflow/environment/factory.py", "cfg.max_turns"),
    "async_grpo.on_stale_turn": ("rlflow/train/generation_role/remote.py", "cfg.on_stale_turn"),
    "environment.task_timeout_s": ("rlflow/environment/factory.py", "cfg.task_timeout_s"),
    "environment.on_task_failure": (
        "rlflow/train/collect.py",
        "recipe.environment.on_task_failure",
    ),
    "environment.tool_call_format": ("rlflow/environment/factory.py", "cfg.tool_call_format"),
    "logging.wandb.enabled": ("rlflow/train/metrics.py", "wandb.enabled"),
    "logging.wandb.project": ("rlflow/train/wandb_log.py", "cfg.project"),
    "logging.wandb.entity": ("rlflow/train/wandb_log.py", "cfg.entity"),
    "logging.wandb.group": ("rlflow/train/wandb_log.py", "cfg.group"),
    "logging.wandb.tags": ("rlflow/train/wandb_log.py", "cfg.tags"),
    "logging.wandb.mode": ("rlflow/train/wandb_log.py", "cfg.mode"),
    "watchdog.enabled": ("rlflow/train/watchdog.py", "cfg.enabled"),
    "watchdog.startup_timeout_s": ("rlflow/launch/plan.py", "recipe.watchdog.startup_timeout_s"),
    # LONG_PHASES maps phases to their keys; the watchdog reads each with getattr(cfg, key)
    "watchdog.preflight_timeout_s": ("rlflow/train/watchdog.py", "'preflight_timeout_s'"),
    "watchdog.model_load_timeout_s": ("rlflow/train/watchdog.py", "'model_load_timeout_s'"),
    "watchdog.checkpoint_timeout_s": ("rlflow/train/watchdog.py", "'checkpoint_timeout_s'"),
    "watchdog.phase_timeout_s": ("rlflow/train/watchdog.py", "cfg.phase_timeout_s"),
    "watchdog.collective_timeout_s": (
        "rlflow/train/setup.py",
        "recipe.watchdog.collective_timeout_s",
    ),
    "preflight.enabled": ("rlflow/train/setup.py", "recipe.preflight.enabled"),
    "preflight.gemm_size": ("rlflow/job/preflight.py", "cfg.gemm_size"),
    "preflight.gemm_tolerance": ("rlflow/job/preflight.py", "cfg.gemm_tolerance"),
    "preflight.allreduce_mb": ("rlflow/job/preflight.py", "cfg.allreduce_mb"),
    "preflight.min_free_disk_gb": ("rlflow/job/preflight.py", "cfg.min_free_disk_gb"),
    "preflight.required_env": ("rlflow/job/preflight.py", "cfg.required_env"),
    **{
        f"slurm.{key}": ("rlflow/launch/plan.py", f"slurm.{key}")
        for key in (
            "partition",
            "time_limit",
            "cpus_per_task",
            "container_image",
            "container_mounts",
            "container.runtime",
            "container.apptainer_command",
            "container.apptainer_args",
            "extra_sbatch_args",
            "env",
            "setup_command",
            "signal_grace_seconds",
            "max_requeues",
            "max_failure_retries",
            "stop_signal",
            "rlflow_command",
            "request_gpus",
        )
    },
    # #SBATCH options the recipe passes through: their row in plan.SBATCH_OPTIONS names the key,
    # and plan.sbatch_options() reads every row's key into the #SBATCH lines
    **{
        f"slurm.{key}": ("rlflow/launch/plan.py", f"'slurm.{key}'")
        for key in ("account", "qos", "mem")
    },
    "slurm.max_gpu_hours": ("rlflow/launch/cost.py", "loaded.recipe.slurm.max_gpu_hours"),
}
for _key, _read in list(READ_BY.items()):  # the two splits read through the same DatasetConfig
    if _key.startswith("data.train."):
        READ_BY[_key.replace("train", "validation", 1)] = _read

# Keys whose values beyond one are refused (rlflow does not implement them): key -> (a value
# the dry run and setup refuse, the diagnostic code). megatron-core still gets the size 1.
REFUSED = {
    "parallelism.pipeline_parallel_size": (2, "recipe.pipeline-parallel"),
    "parallelism.context_parallel_size": (2, "recipe.context-parallel"),
}


def schema_keys(cls=schema.Recipe, path=()):
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from schema_keys(hints[field.name], (*path, field.name))
        else:
            yield ".".join((*path, field.name))


@functools.cache
def expressions(module: str) -> frozenset[str]:
    """Every attribute access and string constant in `module`, as ast.unparse writes it."""
    tree = ast.parse((ROOT / module).read_text())
    return frozenset(
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        or (isinstance(node, ast.Constant) and isinstance(node.value, str))
    )


def test_every_schema_key_says_where_it_takes_effect():
    keys = set(schema_keys())
    assert keys - set(READ_BY) == set(), "add the new key to READ_BY (or REFUSED)"
    assert set(READ_BY) - keys == set(), "READ_BY names a key the schema no longer has"


@pytest.mark.parametrize("key", sorted(READ_BY))
def test_the_named_module_reads_the_key(key):
    module, expression = READ_BY[key]
    assert (
        not module.startswith("rlflow/recipe/")
        or key.startswith("cluster.")
        or key
        in {
            "data.video.temporal_patch_size",
            "generation.placement",
            "generation.gpus_per_node",
            "generation.num_nodes",
            "parallelism.sequence_parallel",  # placement.splits_sequence: parallel.py acts on it
        }
    ), f"{key}: a rule is not the code that acts on it"
    assert expression in expressions(module), f"{module} does not read {expression} ({key})"


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_unimplemented_values_are_refused_by_the_dry_run_and_by_setup(key, tmp_path):
    value, code = REFUSED[key]
    override = f"{key}={value}"
    dry = subprocess.run(
        [RLFLOW, "submit", str(TINY), override, "--nodes", "1", "--gpus", "4"]
        + ["--dry-run", "--skip-pin-check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert dry.returncode == 2, dry.stderr
    assert f"error[{code}]: " in dry.stderr and f"command line `{override}`" in dry.stderr
    assert "Traceback" not in dry.stderr and not list(tmp_path.iterdir())
    with pytest.raises(RlflowError) as caught:  # train's setup path (rlflow.train.setup)
        check_allocation(load_checked(TINY, [override]), 4)
    (problem,) = caught.value.diagnostics
    assert problem.code == code and f"error[{code}]: {problem.message}\n" in dry.stderr


def test_a_video_patch_the_checkpoint_does_not_fold_is_refused(tmp_path):
    """The processor folds the checkpoint's temporal_patch_size frames, whatever the recipe
    says: a different value is refused where the checkpoint can be read (dry run and train)."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "video_preprocessor_config.json").write_text(
        json.dumps({"temporal_patch_size": 2})
    )
    video = ["data.video.num_frames=4", "data.video.fps=2.0", f"model.checkpoint={checkpoint}"]
    load_checked(TINY, [*video, "data.video.temporal_patch_size=2"])
    with pytest.raises(RlflowError) as caught:
        load_checked(TINY, [*video, "data.video.temporal_patch_size=4"])
    (problem,) = caught.value.diagnostics
    assert problem.code == "recipe.video-patch"
    assert problem.message.startswith(
        "`data.video.temporal_patch_size` is 4, but the checkpoint's video processor folds 2 "
        "frames into a patch"
    )
    assert problem.help == "set data.video.temporal_patch_size: 2 (and num_frames a multiple of it)"
