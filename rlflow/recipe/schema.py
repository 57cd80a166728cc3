"""The recipe's types: frozen dataclasses, one per section, no defaults.

Defaults live in `recipes/base.yaml` (every key, with one comment each), not here and not as
`.get(key, default)` in code. `rlflow.recipe.load` turns YAML into these classes and rejects
unknown keys, missing keys and wrongly typed values with the file and line that set them.
Cross-field rules (parallel sizes, video keys, ...) live in `rlflow.recipe.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RunConfig:
    name: str  # job name and run-directory prefix
    output_dir: str  # run directories are created under it (relative to the working directory)
    seed: int


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts models only (rlflow/model/moe.py); null: the checkpoint's config."""

    grouped_experts: bool  # experts as grouped matrix products (false: one matmul per expert)
    router_topk: int | None  # experts per token; None: the checkpoint's num_experts_per_tok
    router_dtype: Literal["float32", "float64"] | None  # router logits' dtype; None: the model's
    aux_loss_coeff: float | None  # load-balancing loss weight; None: router_aux_loss_coef
    z_loss_coeff: float  # router z-loss weight (0: off; HF checkpoints define none)


@dataclass(frozen=True)
class ModelConfig:
    checkpoint: str  # an HF checkpoint directory, or "builtin:tiny-qwen25vl"
    dtype: Literal["float32", "bfloat16"]
    freeze_vision: bool
    tiny_seed: int  # weights seed for builtin:tiny-* checkpoints
    moe: MoEConfig


@dataclass(frozen=True)
class VideoConfig:
    num_frames: int | None  # frames per video after sampling; all three set, or none
    temporal_patch_size: int | None  # frames folded into one vision patch (Qwen2.5-VL: 2)
    fps: float | None  # frame rate reported to the processor (timestamps in mrope)


@dataclass(frozen=True)
class DatasetConfig:
    kind: Literal["clevr", "video", "text", "mixed", "jsonl"]
    num_samples: int
    seed: int
    path: str | None  # jsonl only: a CLEVR-CoGenT / R1-V style file
    image_root: str | None  # jsonl only: image paths are relative to this directory


@dataclass(frozen=True)
class DataConfig:
    train: DatasetConfig
    validation: DatasetConfig
    image_size: int  # synthetic images are image_size x image_size pixels
    max_objects: int  # synthetic scenes hold 1..max_objects objects
    mix: dict[str, float]  # kind=mixed: share of "clevr", "video" and "text" rows
    prompt_suffix: str  # appended to every question (tells the model the answer format)
    prompt_template: str  # jsonl rows: the question, from {question} and any column, e.g. {hint}
    max_prompt_tokens: int
    video: VideoConfig


@dataclass(frozen=True)
class DynamicSamplingConfig:
    enabled: bool  # DAPO: drop groups whose rewards are all equal, generate more to refill
    max_extra_rounds: int  # extra generation rounds per step before the run stops with an error


@dataclass(frozen=True)
class GRPOConfig:
    num_prompts_per_step: int
    num_generations_per_prompt: int
    max_num_steps: int
    num_minibatches: int  # optimizer updates per step; the step's rollouts are split evenly
    normalize_rewards: bool  # divide advantages by the group's std (where std > 0)
    use_leave_one_out_baseline: bool
    val_period: int  # validate every N steps (0: never during training)
    val_at_start: bool
    val_at_end: bool
    max_val_samples: int
    dynamic_sampling: DynamicSamplingConfig


@dataclass(frozen=True)
class OverlongPenaltyConfig:
    enabled: bool  # DAPO's soft overlong punishment, added to the reward
    buffer_tokens: int  # the penalty ramps over the last buffer_tokens before max_new_tokens
    penalty: float  # reward subtracted at max_new_tokens


@dataclass(frozen=True)
class ImportanceSamplingConfig:
    mode: Literal["auto", "off", "tis", "mis"]  # auto: tis for vllm/hf rollouts, off for megatron
    cap: float  # tis: weights truncated at cap; mis: sequences above cap are masked
    mask_below: float  # mis: sequences whose weight is below this are masked too


@dataclass(frozen=True)
class LossConfig:
    ratio_clip_low: float  # ratio clipped to [1 - low, 1 + high]
    ratio_clip_high: float
    kl_penalty: float  # weight of KL(policy || reference); 0 disables the reference forward
    kl_type: Literal["k1", "k3"]
    token_level_loss: (
        bool  # true: mean over all tokens; false: mean per sequence, then over sequences
    )
    ratio_level: Literal["token", "sequence"]  # sequence: GSPO's one ratio per sequence
    overlong_penalty: OverlongPenaltyConfig
    importance_sampling: ImportanceSamplingConfig
    router_replay: bool  # MoE: the trainer routes each token to the experts that generated it


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    max_grad_norm: float  # 0 disables clipping
    micro_batch_size: int  # rollouts per forward/backward pass (max_tokens_per_micro_batch = 0)
    max_tokens_per_micro_batch: int  # > 0: token budget per forward/backward pass instead
    sequence_packing: bool  # micro-batches as one packed sequence of real tokens (no padding)


@dataclass(frozen=True)
class WarmStartConfig:
    num_steps: int  # supervised steps on (prompt, reference answer) before GRPO; 0 skips
    lr: float
    batch_size: int


@dataclass(frozen=True)
class VllmPins:
    python: str  # interpreter version of vLLM's own environment, e.g. "3.11"
    installer: Literal["pip", "uv"]  # pip honours PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL
    packages: list[str]  # pinned requirements (a change builds a new environment)
    remove: list[str]  # uninstalled after the install
    patch_torchvision: bool  # make PyPI's CUDA torchvision importable next to a +cpu torch


@dataclass(frozen=True)
class VllmConfig:
    env_root: str  # per-pin-set environments live in folders under it (`rlflow setup-env vllm`)
    device: Literal[
        "auto", "cpu", "cuda"
    ]  # which pin set a node gets; auto: cuda where a driver is
    cpu: VllmPins
    cuda: VllmPins
    kv_cache_space_gb: int  # CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: (
        float  # CUDA only: share of the GPU vLLM may take (the trainer shares it)
    )
    enforce_eager: bool  # no CUDA graphs / compilation: fast start-up
    startup_timeout_s: int  # the worker must be ready within this
    request_timeout_s: int  # one generate or weight refresh must finish within this


@dataclass(frozen=True)
class GenerationConfig:
    backend: Literal["megatron", "hf", "vllm"]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0 disables top-k
    val_temperature: float  # 0 = greedy validation
    max_batch_size: int  # rollouts per generation pass; 0: from free memory (megatron)
    share_prompts: bool  # megatron backend: one vision pass + prefill per prompt for its samples
    cuda_graphs: bool  # megatron backend on GPUs: replay the decode step as a CUDA graph
    compile_decode: bool  # megatron backend: torch.compile the decode layer (fuses small kernels)
    vllm: VllmConfig


@dataclass(frozen=True)
class ParallelismConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int
    expert_parallel_size: int


@dataclass(frozen=True)
class ClusterConfig:
    """The job's shape: the allocation rules (rlflow.recipe.allocation) read it, in the dry run
    from the flags and in `rlflow train` from the run's recipe.yaml, checked against WORLD_SIZE."""

    num_nodes: int | None  # filled from `submit --nodes`; a recipe value must agree with the flag
    gpus_per_node: int | None  # filled from `submit --gpus`; ranks per node on CPU-only nodes


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool
    save_period: int  # save every N steps
    keep_last: int  # keep the newest k checkpoints
    save_on_signal: bool  # save when Slurm warns (SIGUSR1) or terminates (SIGTERM)


@dataclass(frozen=True)
class WatchdogConfig:
    enabled: bool  # the node launcher ends a job whose rank stops making progress
    startup_timeout_s: int  # rank start -> recipe read, torch imported, process group up
    preflight_timeout_s: int  # the in-job node checks and their all-reduce
    model_load_timeout_s: int  # building or loading the policy and reference
    checkpoint_timeout_s: int  # one checkpoint save
    phase_timeout_s: int  # any other phase of a step (generation, logprobs, training, ...)
    collective_timeout_s: int  # torch.distributed's own timeout for one collective


@dataclass(frozen=True)
class PreflightConfig:
    enabled: bool  # check every node before any model is loaded
    gemm_size: int  # n of the n x n matrix product compared with the CPU (GPU nodes)
    gemm_tolerance: float  # largest relative difference accepted
    allreduce_mb: int  # size of the all-reduce whose bandwidth is logged
    min_free_disk_gb: float  # free space the run directory needs besides a checkpoint's size
    required_env: list[str]  # variables every node must have set (e.g. ["HF_HOME"])


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool  # log to Weights & Biases too (the optional extra rlflow[wandb])
    project: str
    entity: str | None  # team or user; None: W&B's default entity
    group: str | None  # groups runs in the W&B UI (e.g. one sweep)
    tags: list[str]
    mode: Literal["online", "offline", "disabled"]  # offline: files only, `wandb sync` later


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool
    progress_bar: bool
    wandb: WandbConfig


@dataclass(frozen=True)
class ContainerConfig:
    runtime: Literal["pyxis", "apptainer", "none"]  # how ranks run in slurm.container_image
    apptainer_command: str  # apptainer: the executable on the nodes (apptainer or singularity)
    apptainer_args: list[str]  # apptainer: more `exec` options, e.g. ["--cleanenv"]


@dataclass(frozen=True)
class SlurmConfig:
    partition: str | None
    account: str | None
    qos: str | None
    time_limit: str  # D-HH:MM:SS, HH:MM:SS or MM
    cpus_per_task: int | None
    mem: str | None  # e.g. "64G"; None lets the site default apply
    container_image: str | None  # pyxis/enroot image; None runs on the host
    container_mounts: list[str]  # src:dst[:flags]
    container: ContainerConfig  # the runtime (pyxis, apptainer) that runs container_image
    extra_sbatch_args: list[str]  # e.g. ["--exclusive", "--constraint=h100"]
    env: dict[str, str]  # exported in the job before every step
    setup_command: str | None  # run once per node before training (e.g. build a venv)
    signal_grace_seconds: int  # Slurm sends SIGUSR1 this long before the time limit
    max_requeues: int  # requeue after a time-limit warning at most this many times
    max_failure_retries: (
        int  # requeue after a node failure (hang, preflight, lost node), excluding it
    )
    max_gpu_hours: float | None  # worst-case GPU-hours one submission may use; None: no cap
    stop_signal: Literal["USR1", "HUP"]  # the time-limit warning (USR2 is the stack-dump signal)
    rlflow_command: (
        str  # how the nodes run rlflow, e.g. "uv run --frozen rlflow" or ".venv/bin/rlflow"
    )
    request_gpus: bool  # false on CPU-only clusters: no GPU request; --gpus is then ranks per node


@dataclass(frozen=True)
class ScoringConfig:
    accuracy: str  # the reward (or reward/component) whose mean is reported as accuracy
    num_workers: int  # processes that run rewards from user code; 0 runs them in the trainer
    timeout_s: float  # one call of a user reward on one batch must return within this


@dataclass(frozen=True)
class Recipe:
    run: RunConfig
    model: ModelConfig
    data: DataConfig
    rewards: dict[str, float]  # registered name or package.module:function -> weight
    scoring: ScoringConfig
    grpo: GRPOConfig
    loss: LossConfig
    optimizer: OptimizerConfig
    warm_start: WarmStartConfig
    generation: GenerationConfig
    parallelism: ParallelismConfig
    cluster: ClusterConfig
    checkpointing: CheckpointConfig
    logging: LoggingConfig
    watchdog: WatchdogConfig
    preflight: PreflightConfig
    slurm: SlurmConfig
