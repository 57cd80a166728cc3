"""The recipe's types: frozen dataclasses, one per section, no defaults.

Defaults live in `recipes/base.yaml` (every key, with one comment each), not here and not as
`.get(key, default)` in code. `rlflow.recipe.load` turns YAML into these classes and rejects
unknown keys, missing keys and wrongly typed values with the file and line that set them.

What one key may hold beyond its type is declared beside it, `field(metadata=bound(ge=1))`
(rlflow.recipe.bounds; one rule reports them all); rules between keys are `rlflow.rules.checks`.
"""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from rlflow.frozen import frozen
from rlflow.recipe import scalars
from rlflow.recipe.bounds import ENV_NAMES, Bound, bound, command_line
from rlflow.recipe.environment_schema import EnvironmentConfig
from rlflow.recipe.partial_schema import PartialRolloutsConfig
from rlflow.recipe.serve_schema import ServerConfig

MAX_TIMEOUT_S, DAYS = 30 * 86400, "30 days is longer than any job runs"  # past any time limit
TIMEOUT = bound(
    ge=1, le=MAX_TIMEOUT_S, help=f"{DAYS}; to turn the watchdog off, set watchdog.enabled: false"
)
VLLM_TIMEOUT = bound(ge=1, le=MAX_TIMEOUT_S, help=DAYS)
MAX_TOKENS = 2**20  # more positions than any model reads (elsewhere.generation_fits_model)
TOKENS = bound(ge=1, le=MAX_TOKENS, help="a prompt and its generation fit the model's positions")
IMAGE_HELP = "Qwen2.5-VL needs at least one 2x2 block of 14-pixel patches; 4096 is plenty"
BETA = bound(ge=0, lt=1, help="Adam's running averages decay by this much each step")
COEFF = bound(ge=0, help="0 turns the loss term off; a negative weight would reward imbalance")


def slurm_name(help: str) -> dict[str, Bound]:
    """A partition, account or QOS: no blanks (sbatch reads an empty one as a missing value)."""
    return bound(
        pattern=r"\S+",
        code="recipe.slurm-value",
        says="is {value}: a Slurm name cannot be empty or hold spaces",
        help=help,
    )


@frozen
class RunConfig:
    name: str  # job name and run-directory prefix
    output_dir: str  # run directories are created under it (relative to the working directory)
    seed: int


@frozen
class MoEConfig:
    """Mixture-of-experts models only (rlflow/model/moe/experts.py); null: the checkpoint's config."""

    grouped_experts: bool  # experts as grouped matrix products (false: one matmul per expert)
    # experts per token; None: the checkpoint's num_experts_per_tok
    router_topk: int | None = field(metadata=bound(ge=1, help="null: num_experts_per_tok"))
    router_dtype: Literal["float32", "float64"] | None  # router logits' dtype; None: the model's
    # load-balancing loss weight; None: router_aux_loss_coef
    aux_loss_coeff: float | None = field(metadata=COEFF)
    z_loss_coeff: float = field(metadata=COEFF)  # router z-loss weight (0: off; HF define none)


@frozen
class ModelConfig:
    checkpoint: str  # an HF checkpoint directory, or "builtin:tiny-qwen25vl"
    dtype: Literal["float32", "bfloat16"]
    freeze_vision: bool
    tiny_seed: int  # weights seed for builtin:tiny-* checkpoints
    moe: MoEConfig


@frozen
class VideoConfig:
    # frames per video after sampling; all three set, or none
    num_frames: int | None = field(metadata=bound(ge=1))
    # frames folded into one vision patch (Qwen2.5-VL: 2)
    temporal_patch_size: int | None = field(metadata=bound(ge=1))
    # frame rate reported to the processor (timestamps in mrope)
    fps: float | None = field(metadata=bound(gt=0))


@frozen
class DatasetConfig:
    kind: Literal["clevr", "video", "text", "mixed", "jsonl"]
    num_samples: int = field(metadata=bound(ge=1))
    seed: int
    path: str | None  # jsonl only: a CLEVR-CoGenT / R1-V style file
    image_root: str | None  # jsonl only: image paths are relative to this directory


@frozen
class DataConfig:
    train: DatasetConfig
    validation: DatasetConfig
    # synthetic images are image_size x image_size pixels
    image_size: int = field(metadata=bound(ge=28, le=4096, help=IMAGE_HELP))
    max_objects: int = field(metadata=bound(ge=1))  # synthetic scenes hold 1..max_objects objects
    # kind=mixed: share of "clevr", "video" and "text" rows
    mix: dict[str, float] = field(metadata=bound(ge=0))
    prompt_suffix: str  # appended to every question (tells the model the answer format)
    prompt_template: str  # jsonl rows: the question, from {question} and any column, e.g. {hint}
    max_prompt_tokens: int = field(metadata=TOKENS)
    video: VideoConfig


@frozen
class DynamicSamplingConfig:
    enabled: bool  # DAPO: drop groups whose rewards are all equal, generate more to refill
    # extra generation rounds per step before the run stops with an error
    max_extra_rounds: int = field(metadata=bound(ge=0))


@frozen
class GRPOConfig:
    num_prompts_per_step: int = field(metadata=bound(ge=1, le=MAX_TOKENS))
    num_generations_per_prompt: int = field(
        metadata=bound(
            ge=2,
            le=4096,
            help="GRPO compares generations of the same prompt; one generation has no baseline",
        )
    )
    max_num_steps: int = field(
        metadata=bound(
            ge=1,
            le=10_000_000,
            help="more steps than a run reaches: 10,000,000 take 116 days at one step a second",
        )
    )
    # optimizer updates per step; the step's rollouts are split evenly
    num_minibatches: int = field(metadata=bound(ge=1))
    normalize_rewards: bool  # divide advantages by the group's std (where std > 0)
    use_leave_one_out_baseline: bool
    # validate every N steps (0: never during training)
    val_period: int = field(metadata=bound(ge=0))
    val_at_start: bool
    val_at_end: bool
    max_val_samples: int = field(metadata=bound(ge=1))
    dynamic_sampling: DynamicSamplingConfig


@frozen
class OverlongPenaltyConfig:
    enabled: bool  # DAPO's soft overlong punishment, added to the reward
    buffer_tokens: int  # the penalty ramps over the last buffer_tokens before max_new_tokens
    penalty: float = field(metadata=bound(ge=0))  # reward subtracted at max_new_tokens


@frozen
class ImportanceSamplingConfig:
    mode: Literal["auto", "off", "tis", "mis"]  # auto: tis for vllm/hf rollouts, off for megatron
    # tis: weights truncated at cap; mis: sequences above cap are masked
    cap: float = field(metadata=bound(gt=0))
    mask_below: float  # mis: sequences whose weight is below this are masked too


@frozen
class LossConfig:
    # ratio clipped to [1 - low, 1 + high]
    ratio_clip_low: float = field(
        metadata=bound(ge=0, lt=1, help="the ratio is clipped to [1 - low, 1 + high]")
    )
    ratio_clip_high: float = field(metadata=bound(ge=0))
    kl_penalty: float = field(metadata=bound(ge=0))  # KL(policy || reference); 0: no reference
    kl_type: Literal["k1", "k3"]
    token_level_loss: bool  # true: mean over all tokens; false: per sequence, then over them
    ratio_level: Literal["token", "sequence"]  # sequence: GSPO's one ratio per sequence
    overlong_penalty: OverlongPenaltyConfig
    importance_sampling: ImportanceSamplingConfig
    router_replay: bool  # MoE: the trainer routes each token to the experts that generated it
    # train/token_mult_prob_error above this on rollouts of the step's own weights: stop
    stop_on_mult_prob_error: float | None = field(metadata=bound(gt=1, help="null: never"))


@frozen
class OptimizerConfig:
    lr: float = field(metadata=bound(gt=0))
    weight_decay: float = field(metadata=bound(ge=0))
    adam_beta1: float = field(metadata=BETA)
    adam_beta2: float = field(metadata=BETA)
    adam_eps: float = field(metadata=bound(gt=0))
    max_grad_norm: float = field(metadata=bound(ge=0))  # 0 disables clipping
    # rollouts per forward/backward pass (max_tokens_per_micro_batch = 0)
    micro_batch_size: int = field(metadata=bound(ge=1))
    # > 0: token budget per forward/backward pass instead
    max_tokens_per_micro_batch: int = field(metadata=bound(ge=0))
    sequence_packing: bool  # micro-batches as one packed sequence of real tokens (no padding)


@frozen
class WarmStartConfig:
    # supervised steps on (prompt, reference answer) before GRPO; 0 skips
    num_steps: int = field(metadata=bound(ge=0))
    lr: float = field(metadata=bound(gt=0))
    batch_size: int = field(metadata=bound(ge=1, le=MAX_TOKENS))


@frozen
class VllmPins:
    # interpreter version of vLLM's own environment, e.g. "3.11"
    python: str = field(
        metadata=bound(
            pattern=r"3\.(8|9|[1-9]\d)",
            code="recipe.vllm-python",
            says="is {value}, not a Python 3.8+ version",
            help='write it as a quoted string, e.g. "3.11" (YAML reads 3.10 as 3.1)',
        )
    )
    installer: Literal["pip", "uv"]  # pip honours PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL
    # pinned requirements (a change builds a new environment)
    packages: list[str] = field(
        metadata=bound(
            nonempty=True,
            help='the environment would hold no vLLM: list pinned requirements, e.g. ["vllm==0.32.0"]',
        )
    )
    remove: list[str]  # uninstalled after the install
    patch_torchvision: bool  # make PyPI's CUDA torchvision importable next to a +cpu torch


@frozen
class VllmConfig:
    env_root: str  # per-pin-set environments live in folders under it (`rlflow setup-env vllm`)
    device: Literal[
        "auto", "cpu", "cuda"
    ]  # which pin set a node gets; auto: cuda where a driver is
    cpu: VllmPins
    cuda: VllmPins
    # CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE)
    kv_cache_space_gb: int = field(metadata=bound(ge=1, le=4096))
    # CUDA only: share of the GPU vLLM may take (the trainer shares it)
    gpu_memory_utilization: float = field(
        metadata=bound(
            gt=0,
            le=1,
            help="the share of the GPU vLLM may take; the trainer shares the GPU, so leave it room",
        )
    )
    enforce_eager: bool  # no CUDA graphs / compilation: fast start-up
    # the worker must be ready within this
    startup_timeout_s: int = field(metadata=VLLM_TIMEOUT)
    # one generate or weight refresh must finish within this
    request_timeout_s: int = field(metadata=VLLM_TIMEOUT)


@frozen
class GenerationConfig:
    backend: Literal["megatron", "hf", "vllm"]
    max_new_tokens: int = field(metadata=TOKENS)
    temperature: float = field(metadata=bound(ge=0, help="0 means greedy decoding"))
    top_p: float = field(metadata=bound(gt=0, le=1))
    top_k: int = field(metadata=bound(ge=0, help="0 disables top-k"))  # 0 disables top-k
    # 0 = greedy validation
    val_temperature: float = field(metadata=bound(ge=0, help="0 means greedy decoding"))
    # rollouts per generation pass; 0: from free memory (megatron)
    max_batch_size: int = field(metadata=bound(ge=0, le=MAX_TOKENS, help="0: from free memory"))
    share_prompts: bool  # megatron backend: one vision pass + prefill per prompt for its samples
    cuda_graphs: bool  # megatron backend on GPUs: replay the decode step as a CUDA graph
    compile_decode: bool  # megatron backend: torch.compile the decode layer (fuses small kernels)
    fp8: bool  # megatron backend: decode matmuls in FP8 (refused where the GPU has none)
    release_cache: bool  # megatron, the trainer's engine: free the KV cache after each rollout
    # megatron backend: KV cache tokens per rank; 0: from free GPU memory (CPU: worst case)
    kv_cache_tokens: int = field(metadata=bound(ge=0, help="0 sizes it from free GPU memory"))
    vllm: VllmConfig
    placement: Literal["colocated", "separate"]  # separate: generation on ranks of its own
    gpus_per_node: int = field(metadata=bound(ge=0))  # separate: ranks of a node that generate
    num_nodes: int = field(metadata=bound(ge=0))  # separate: whole nodes that only generate
    # separate: the generation engine's own tensor-parallel size
    tensor_parallel_size: int = field(metadata=bound(ge=1))
    # separate: weights reach the generation ranks in broadcasts of at most this many MiB
    sync_bucket_mb: int = field(metadata=bound(ge=1, le=65536))
    server: ServerConfig  # the OpenAI-compatible server on the engine (`rlflow serve`)
    partial_rollouts: PartialRolloutsConfig  # a per-step budget; unfinished rows continue


@frozen
class AsyncConfig:
    # rollouts at most this many steps older than the weights they train
    max_staleness: int = field(
        metadata=bound(ge=0, help="0: synchronous; 1: one-step-off; N: up to N steps stale")
    )
    on_stale_turn: Literal["stop", "drop"]  # a turn past max_staleness: end the run | mask it out


@frozen
class ParallelismConfig:
    tensor_parallel_size: int = field(metadata=bound(ge=1))
    pipeline_parallel_size: int = field(metadata=bound(ge=1))
    context_parallel_size: int = field(metadata=bound(ge=1))
    expert_parallel_size: int = field(metadata=bound(ge=1))
    # auto: on when tensor_parallel_size > 1; "on" needs tensor_parallel_size > 1
    sequence_parallel: Literal["auto", "on", "off"]


@frozen
class ClusterConfig:
    """The job's shape: the allocation rules (rlflow.rules.allocation) read it, in the dry run
    from the flags and in `rlflow train` from the run's recipe.yaml, checked against WORLD_SIZE."""

    # filled from `submit --nodes`; a recipe value must agree with the flag
    num_nodes: int | None = field(metadata=bound(ge=1, help="or null: `rlflow submit` fills it"))
    # filled from `submit --gpus`; ranks per node on CPU-only nodes
    gpus_per_node: int | None = field(metadata=bound(ge=1, help="or null: submit fills it"))


@frozen
class CheckpointConfig:
    enabled: bool
    save_period: int = field(metadata=bound(ge=1))  # save every N steps
    keep_last: int = field(metadata=bound(ge=1))  # keep the newest k checkpoints
    save_on_signal: bool  # save when Slurm warns (SIGUSR1) or terminates (SIGTERM)
    hf_export_period: int = field(metadata=bound(ge=0))  # RUN_DIR/hf/step_N every N steps; 0: never
    hf_export_keep_last: int = field(metadata=bound(ge=1))  # keep the newest k HF exports


@frozen
class WatchdogConfig:
    enabled: bool  # the node launcher ends a job whose rank stops making progress
    # rank start -> recipe read, torch imported, process group up
    startup_timeout_s: int = field(metadata=TIMEOUT)
    # the in-job node checks and their all-reduce
    preflight_timeout_s: int = field(metadata=TIMEOUT)
    # building or loading the policy and reference
    model_load_timeout_s: int = field(metadata=TIMEOUT)
    # one checkpoint save
    checkpoint_timeout_s: int = field(metadata=TIMEOUT)
    # any other phase of a step (generation, logprobs, training, ...)
    phase_timeout_s: int = field(metadata=TIMEOUT)
    # torch.distributed's own timeout for one collective
    collective_timeout_s: int = field(metadata=TIMEOUT)


@frozen
class PreflightConfig:
    enabled: bool  # check every node before any model is loaded
    # n of the n x n matrix product compared with the CPU (GPU nodes)
    gemm_size: int = field(
        metadata=bound(ge=1, le=16384, help="an n x n float32 matrix per GPU: 16384 is 1 GiB")
    )
    gemm_tolerance: float = field(metadata=bound(gt=0))  # largest relative difference accepted
    # size of the all-reduce whose bandwidth is logged
    allreduce_mb: int = field(
        metadata=bound(
            ge=0,
            le=4096,
            help="the buffer is allocated on every rank; 64 MB measures the bandwidth",
        )
    )
    # free space the run directory needs besides a checkpoint's size
    min_free_disk_gb: float = field(metadata=bound(ge=0))
    # variables every node must have set (e.g. ["HF_HOME"])
    required_env: list[str] = field(
        metadata=bound(
            **ENV_NAMES, says="is {value}, which is not a valid environment variable name"
        )
    )


@frozen
class WandbConfig:
    enabled: bool  # log to Weights & Biases too (the optional extra rlflow[wandb])
    project: str = field(metadata=bound(quote_numbers=True))
    entity: str | None = field(  # team or user; None: W&B's default entity
        metadata=bound(nonempty=True, quote_numbers=True, help="a team or user name, or null")
    )
    group: str | None = field(  # groups runs in the W&B UI (e.g. one sweep)
        metadata=bound(nonempty=True, quote_numbers=True, help="a group name, or null")
    )
    tags: list[str]
    mode: Literal["online", "offline", "disabled"]  # offline: files only, `wandb sync` later


@frozen
class LoggingConfig:
    tensorboard: bool
    progress_bar: bool
    rollout_dump_period: int = field(metadata=bound(ge=0))  # RUN_DIR/rollouts/ every N steps
    wandb: WandbConfig


@frozen
class ContainerConfig:
    runtime: Literal["pyxis", "apptainer", "none"]  # how ranks run in slurm.container_image
    # apptainer: the executable on the nodes (apptainer or singularity)
    apptainer_command: str = field(
        metadata=command_line(
            "recipe.apptainer-command",
            'balance the quotes, e.g. apptainer or "/opt/my apptainer/bin/apptainer"',
        )
    )
    apptainer_args: list[str]  # apptainer: more `exec` options, e.g. ["--cleanenv"]


@frozen
class SlurmConfig:
    partition: str | None = field(
        metadata=slurm_name(
            "name a partition (sinfo lists them), or null for the cluster's default"
        )
    )
    account: str | None = field(metadata=slurm_name("name the account, or null for your default"))
    qos: str | None = field(metadata=slurm_name("name the QOS, or null for the default"))
    # D-HH:MM:SS, HH:MM:SS or MM
    time_limit: str = field(
        metadata=bound(
            parse=scalars.slurm_seconds,
            code="recipe.time-limit",
            says="is {value}, which Slurm does not read as a time: {reason}",
            help='use D-HH:MM:SS, HH:MM:SS, MM:SS or minutes, e.g. "04:00:00"',
        )
    )
    cpus_per_task: int | None = field(metadata=bound(ge=1, help="or null for the site default"))
    # e.g. "64G"; None lets the site default apply
    mem: str | None = field(
        metadata=bound(
            pattern=r"[0-9]+[KMGTkmgt]?",
            code="recipe.slurm-value",
            says="is {value}, which Slurm does not read as a memory size",
            help='megabytes, or a number with K, M, G or T, e.g. "64G"; null keeps the site default',
        )
    )
    # pyxis/enroot image; None runs on the host
    container_image: str | None = field(
        metadata=bound(
            nonempty=True, code="submit.container", help="set an image, or null to run on the host"
        )
    )
    # src:dst[:flags]
    container_mounts: list[str] = field(
        metadata=bound(
            pattern=r"[^,]*[^,\s][^,]*",
            code="submit.container",
            says="is {value}: pyxis and apptainer separate mounts with commas, so one mount "
            "cannot contain a comma or be empty",
            help="write one src:dst[:flags] mount per list item",
        )
    )
    container: ContainerConfig  # the runtime (pyxis, apptainer) that runs container_image
    extra_sbatch_args: list[str]  # e.g. ["--exclusive", "--constraint=h100"]
    env: dict[str, str] = field(  # exported in the job before every step
        metadata=bound(keys=Bound(**ENV_NAMES, says="is not a valid environment variable name"))
    )
    setup_command: str | None  # run once per node before training (e.g. build a venv)
    # Slurm sends SIGUSR1 this long before the time limit
    signal_grace_seconds: int = field(metadata=bound(ge=1, le=65535))
    # requeue after a time-limit warning at most this many times
    max_requeues: int = field(metadata=bound(ge=0))
    # requeue after a node failure (hang, preflight, lost node), excluding it
    max_failure_retries: int = field(metadata=bound(ge=0))
    # worst-case GPU-hours one submission may use; None: no cap
    max_gpu_hours: float | None = field(
        metadata=bound(ge=0, help="the most GPU-hours one submission may use, or null for no cap")
    )
    stop_signal: Literal["USR1", "HUP"]  # the time-limit warning (USR2 is the stack-dump signal)
    # how the nodes run rlflow, e.g. "uv run --frozen rlflow" or ".venv/bin/rlflow"
    rlflow_command: str = field(
        metadata=command_line(
            "recipe.rlflow-command",
            "how the nodes run rlflow; balance the quotes, e.g. uv run --frozen rlflow",
            nonempty=True,
        )
    )
    request_gpus: bool  # false on CPU-only clusters: no GPU request; --gpus is then ranks per node


@frozen
class ScoringConfig:
    accuracy: str  # the reward (or reward/component) whose mean is reported as accuracy
    # processes that run rewards from user code; 0 runs them in the trainer
    num_workers: int = field(metadata=bound(ge=0, le=1024))
    # one call of a user reward on one batch must return within this
    timeout_s: float = field(
        metadata=bound(gt=0, le=86400, help="a call longer than a day is a hung reward")
    )


@frozen
class Recipe:
    run: RunConfig
    model: ModelConfig
    data: DataConfig
    rewards: dict[str, float]  # registered name or package.module:function -> weight
    scoring: ScoringConfig
    environment: EnvironmentConfig  # how a rollout is made: one turn, or tool calls
    grpo: GRPOConfig
    loss: LossConfig
    optimizer: OptimizerConfig
    warm_start: WarmStartConfig
    generation: GenerationConfig
    environment: EnvironmentConfig
    async_grpo: AsyncConfig
    parallelism: ParallelismConfig
    cluster: ClusterConfig
    checkpointing: CheckpointConfig
    logging: LoggingConfig
    watchdog: WatchdogConfig
    preflight: PreflightConfig
    slurm: SlurmConfig
