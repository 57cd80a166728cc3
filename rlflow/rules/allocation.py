"""Rules that need the job's shape (nodes x GPUs per node), stated once for both sides.

`rlflow submit --dry-run` runs them with --nodes/--gpus before anything reaches Slurm;
`rlflow train` runs the same function at setup, before torch.distributed or any model, with the
shape from the recipe's `cluster` section (which submit fills from the flags) checked against
the ranks it really has (WORLD_SIZE). So a recipe the allocation would refuse is refused on the
login node, with the same code and message.

Pure: no torch, no Slurm; only the recipe, two numbers and the checkpoint's config.json (the
expert count of a mixture-of-experts model).
"""

from __future__ import annotations

from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.load import LoadedRecipe
from rlflow.recipe.placement import Placement, splits_sequence
from rlflow.recipe.schema import Recipe

LOOPBACK = ("127.0.0.1", "localhost", "::1")  # a server there answers its own node only
PARALLEL_AXES = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
)


def placement_of(recipe: Recipe, nodes: int, gpus: int) -> Placement:
    """The ranks of a `nodes` x `gpus` job by role. Expects `placement_diagnostics` to pass.

    gpus_per_node g: the last g ranks of every node generate. num_nodes m: the ranks of the
    last m nodes generate. Ranks are numbered node by node (node n holds n*gpus .. n*gpus+gpus-1).
    """
    gen = recipe.generation
    ranks = range(nodes * gpus)
    if gen.placement != "separate":
        return Placement(tuple(ranks), ())
    if gen.gpus_per_node:
        generates = [r for r in ranks if r % gpus >= gpus - gen.gpus_per_node]
    else:
        generates = [r for r in ranks if r // gpus >= nodes - gen.num_nodes]
    return Placement(tuple(r for r in ranks if r not in generates), tuple(generates))


def allocation_diagnostics(
    loaded: LoadedRecipe, nodes: int, gpus: int, *, trains: bool = True
) -> list[Diagnostic]:
    """Every rule between the recipe and a job of `nodes` x `gpus` ranks, in the order a user
    would fix them. Expects a recipe that passed `check_recipe` (sizes of at least 1). Sizes
    rlflow does not implement (`UNIMPLEMENTED`) are refused whatever the shape.
    `trains=False` (`submit --command`: the ranks run something else) keeps only the parallel
    sizes: the trainer's batch rules do not apply to a smoke test."""
    shape = f"{nodes} node{'s' * (nodes != 1)} x {gpus} GPU{'s' * (gpus != 1)}"
    problems = [p for rule in UNIMPLEMENTED for p in rule(loaded)]
    problems += _experts(loaded, trains)
    placed = trains and not placement_diagnostics(loaded, nodes, gpus)
    placement = placement_of(loaded.recipe, nodes, gpus) if placed else None
    world_size = len(placement.training) if placement is not None else nodes * gpus
    if placement is not None and placement.separate:  # the trainers' sizes divide their ranks
        shape = f"the {world_size} training ranks of {shape}"
    if problems or not trains:
        return problems + _parallel_sizes(loaded, world_size, shape)
    problems = placement_diagnostics(loaded, nodes, gpus)
    if problems:
        return problems
    problems = _parallel_sizes(loaded, world_size, shape)
    if problems:
        return problems  # (the data-parallel size is not a whole number)
    return _data_parallel(loaded, world_size, shape) + _generation_parallel(loaded, placement, gpus)


# --- parallelism rlflow does not implement: refused, never passed to megatron-core -------------


def _pipeline_parallel_unimplemented(loaded: LoadedRecipe) -> list[Diagnostic]:
    if loaded.recipe.parallelism.pipeline_parallel_size == 1:
        return []
    return [
        loaded.diagnostic(
            ("parallelism", "pipeline_parallel_size"),
            "recipe.pipeline-parallel",
            "rlflow's trainer runs with pipeline_parallel_size=1 for now",
            help="use tensor_parallel_size (and data parallelism) to spread the model",
        )
    ]


def _context_parallel_unimplemented(loaded: LoadedRecipe) -> list[Diagnostic]:
    """megatron-core would build context-parallel groups, but rlflow's packed attention, decoder
    and logprob path run each sequence whole on every rank: CP > 1 would split nothing."""
    size = loaded.recipe.parallelism.context_parallel_size
    if size == 1:
        return []
    return [
        loaded.diagnostic(
            ("parallelism", "context_parallel_size"),
            "recipe.context-parallel",
            f"rlflow does not implement context parallelism: `parallelism.context_parallel_size` "
            f"must be 1 (it is {size})",
            help="each rank runs whole sequences; for long sequences lower "
            "optimizer.max_tokens_per_micro_batch or generation.max_batch_size, or spread the "
            "model with tensor_parallel_size",
        )
    ]


UNIMPLEMENTED = (
    _pipeline_parallel_unimplemented,
    _context_parallel_unimplemented,
)


def job_shape(loaded: LoadedRecipe, world_size: int) -> tuple[int, int, list[Diagnostic]]:
    """(nodes, GPUs per node) of a running job with `world_size` ranks, from `cluster`.

    Under `rlflow submit` the run's recipe.yaml has `cluster` filled from --nodes/--gpus, so
    train checks exactly the shape the dry run checked. Run directly (`rlflow train --nproc N`)
    with `cluster` unset, the job is one machine of N ranks. A `cluster` the job does not match
    is an error: the recipe asserts a shape this job does not have.
    """
    cluster = loaded.recipe.cluster
    nodes, gpus = cluster.num_nodes, cluster.gpus_per_node
    if nodes is None and gpus is None:
        return 1, world_size, []
    if nodes is None:
        nodes = world_size // gpus if world_size % gpus == 0 else None
    elif gpus is None:
        gpus = world_size // nodes if world_size % nodes == 0 else None
    if nodes is not None and gpus is not None and nodes * gpus == world_size:
        return nodes, gpus, []
    said = " x ".join(
        f"{key} {value}"
        for key, value in (
            ("num_nodes", cluster.num_nodes),
            ("gpus_per_node", cluster.gpus_per_node),
        )
        if value is not None
    )
    problem = loaded.diagnostic(
        ("cluster",),
        "allocation.cluster",
        f"the recipe's `cluster` says {said}, but this job has {world_size} "
        f"rank{'s' * (world_size != 1)} (WORLD_SIZE)",
        help="`rlflow submit --nodes N --gpus G` fills `cluster` for the job it submits; remove "
        "`cluster` from a recipe you run with `rlflow train`, or start as many ranks as it says",
    )
    return nodes or 1, gpus or world_size, [problem]


def check_allocation(loaded: LoadedRecipe, world_size: int) -> Placement:
    """`rlflow train`'s check at setup (before any process group or model): raise every
    problem; return which ranks train and which generate."""
    nodes, gpus, problems = job_shape(loaded, world_size)
    problems = problems or allocation_diagnostics(loaded, nodes, gpus)
    if problems:
        raise RlflowError(problems)
    return placement_of(loaded.recipe, nodes, gpus)


def expert_layout(loaded: LoadedRecipe, world_size: int) -> str | None:
    """How a mixture-of-experts model's experts spread over `world_size` training ranks (the
    dry run prints it), or None for a dense model or one whose config.json is not there."""
    from rlflow.model.moe.experts import recipe_experts

    experts = recipe_experts(loaded.recipe.model.checkpoint)
    if not experts:
        return None
    par = loaded.recipe.parallelism
    ep, tp = par.expert_parallel_size, par.tensor_parallel_size
    split = f", each split over tensor parallel {tp}" if tp > 1 else ""
    return (
        f"{experts} per layer over expert parallel {ep} ({experts // ep} per rank{split}); "
        f"tensor {tp} x data {data_parallel_size(loaded, world_size)}"
    )


def data_parallel_size(loaded: LoadedRecipe, world_size: int) -> int:
    """megatron-core's data-parallel size: the ranks left after tensor x pipeline x context."""
    par = loaded.recipe.parallelism
    return world_size // (
        par.tensor_parallel_size * par.pipeline_parallel_size * par.context_parallel_size
    )


def _parallel_sizes(loaded: LoadedRecipe, world_size: int, shape: str) -> list[Diagnostic]:
    """tensor x pipeline x context x expert must divide the number of ranks; say which does not."""
    par = loaded.recipe.parallelism
    sizes = {axis: getattr(par, axis) for axis in PARALLEL_AXES}
    product = 1
    for size in sizes.values():
        product *= size
    if world_size % product == 0:
        return []
    offenders = [f"{axis}={size}" for axis, size in sizes.items() if size > 1 and world_size % size]
    detail = (
        ", ".join(offenders)
        if offenders
        else " x ".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
    )
    axis = next((a for a, s in sizes.items() if s > 1 and world_size % s), None) or next(
        (a for a, s in sizes.items() if s > 1), PARALLEL_AXES[0]
    )
    return [
        loaded.diagnostic(
            ("parallelism", axis),
            "allocation.parallel-sizes",
            f"parallel sizes multiply to {product}, which does not divide the world size "
            f"{world_size} ({detail})",
            help=f"choose sizes whose product divides {world_size} ({shape}), "
            f"or change --nodes/--gpus",
        )
    ]


def _experts(loaded: LoadedRecipe, trains: bool) -> list[Diagnostic]:
    """Expert parallelism splits a mixture-of-experts model's experts evenly over EP ranks; a
    dense model has none to split. Router replay needs the megatron backend (the one that records
    the experts). The expert count comes from the checkpoint's config.json or the built-in family
    (rlflow.model.moe.experts.recipe_experts: no torch)."""
    from rlflow.model.moe.experts import recipe_experts

    recipe = loaded.recipe
    ep = recipe.parallelism.expert_parallel_size
    experts = recipe_experts(recipe.model.checkpoint)
    if experts is None:  # no config.json: the model rules report it
        return []
    problems = []
    where = f"`model.checkpoint` ({recipe.model.checkpoint})"
    if ep > 1 and experts == 0:
        problems.append(
            loaded.diagnostic(
                ("parallelism", "expert_parallel_size"),
                "allocation.expert-parallel-dense",
                f"`parallelism.expert_parallel_size` is {ep}, but {where} is a dense model "
                "(it has no experts to split)",
                help="set expert_parallel_size to 1, or train a mixture-of-experts checkpoint",
            )
        )
    elif ep > 1 and experts % ep:
        problems.append(
            loaded.diagnostic(
                ("parallelism", "expert_parallel_size"),
                "allocation.expert-parallel-experts",
                f"`parallelism.expert_parallel_size` ({ep}) does not divide the {experts} "
                f"experts of {where}",
                help="each expert-parallel rank holds an equal share of the experts: choose a "
                f"divisor of {experts}",
            )
        )
    par = recipe.parallelism
    if trains and experts and splits_sequence(par):
        said = par.sequence_parallel
        if said == "auto":
            said = f"auto (on: tensor_parallel_size is {par.tensor_parallel_size})"
        problems.append(
            loaded.diagnostic(
                ("parallelism", "sequence_parallel"),
                "allocation.moe-sequence-parallel",
                f"`parallelism.sequence_parallel` is {said}, but sequence parallelism is not "
                f"implemented for mixture-of-experts models ({where} has {experts} experts): "
                "each TP rank's router would see only its slice of the tokens, which the "
                "whole-sequence routes of router replay do not match",
                help="set parallelism.sequence_parallel: off (rlflow's MoE layer then splits the "
                "tokens over the TP ranks itself)",
            )
        )
    elif trains and splits_sequence(par) and _hybrid(recipe.model.checkpoint):
        problems.append(
            loaded.diagnostic(
                ("parallelism", "sequence_parallel"),
                "allocation.hybrid-sequence-parallel",
                f"`parallelism.sequence_parallel` is on (or auto with tensor_parallel_size "
                f"{par.tensor_parallel_size}), but {where} is a hybrid model whose Mamba layers "
                "scan the whole sequence: sequence parallelism is not built for them",
                help="set parallelism.sequence_parallel: off (docs/hybrid-kernels.md)",
            )
        )
    backend = recipe.generation.backend
    if trains and experts and recipe.loss.router_replay and backend != "megatron":
        problems.append(
            loaded.diagnostic(
                ("loss", "router_replay"),
                "allocation.router-replay-backend",
                f"`loss.router_replay` needs the experts each token was generated with, which "
                f"only the megatron backend records (`generation.backend` is {backend}), and "
                f"{where} is a mixture-of-experts model",
                help="set generation.backend: megatron, or loss.router_replay: false (the trainer "
                "then routes every token itself; moe/routing_agreement shows how often it differs)",
            )
        )
    return problems


def _hybrid(checkpoint: str) -> bool:
    """Whether `model.checkpoint` has recurrent (Mamba) layers beside attention (no torch)."""
    from rlflow.model.shape import recipe_shape

    shape = recipe_shape(checkpoint)
    return shape is not None and shape.kv_layers >= 0


def _data_parallel(loaded: LoadedRecipe, world_size: int, shape: str) -> list[Diagnostic]:
    """Each data-parallel rank takes an equal share of the prompts, and splits its rollouts
    into `num_minibatches` equal updates."""
    recipe = loaded.recipe
    grpo, warm = recipe.grpo, recipe.warm_start
    dp = data_parallel_size(loaded, world_size)
    par = recipe.parallelism
    where = (
        f"the data-parallel size {dp} ({shape} = {world_size} ranks over tensor "
        f"{par.tensor_parallel_size} x pipeline {par.pipeline_parallel_size} x context "
        f"{par.context_parallel_size})"
    )
    problems = []
    if grpo.num_prompts_per_step % dp:
        problems.append(
            loaded.diagnostic(
                ("grpo", "num_prompts_per_step"),
                "allocation.data-parallel",
                f"`grpo.num_prompts_per_step` ({grpo.num_prompts_per_step}) is not a multiple of "
                f"{where}",
                help=f"each data-parallel rank takes an equal share of the prompts: use a "
                f"multiple of {dp}, or change --nodes/--gpus or the parallel sizes",
            )
        )
    else:
        rollouts = grpo.num_prompts_per_step // dp * grpo.num_generations_per_prompt
        if rollouts % grpo.num_minibatches:
            problems.append(
                loaded.diagnostic(
                    ("grpo", "num_minibatches"),
                    "allocation.minibatches",
                    f"`grpo.num_minibatches` ({grpo.num_minibatches}) does not divide the "
                    f"{rollouts} rollouts each data-parallel rank trains on per step "
                    f"(num_prompts_per_step / {dp} x num_generations_per_prompt)",
                    help="each update takes an equal share of a rank's rollouts: choose "
                    f"num_minibatches dividing {rollouts}",
                )
            )
    if warm.num_steps > 0 and warm.batch_size % dp:
        problems.append(
            loaded.diagnostic(
                ("warm_start", "batch_size"),
                "allocation.data-parallel",
                f"`warm_start.batch_size` ({warm.batch_size}) is not a multiple of {where}",
                help=f"each data-parallel rank takes an equal share of the warm-start batch: use "
                f"a multiple of {dp}",
            )
        )
    return problems


# ---------------------------------------------------------------- generation.placement


def placement_diagnostics(loaded: LoadedRecipe, nodes: int, gpus: int) -> list[Diagnostic]:
    """generation.placement and async_grpo against the job: what rlflow implements, and a
    split that leaves ranks on both sides. Settings rlflow does not implement are refused."""
    gen = loaded.recipe.generation
    if gen.placement == "colocated":
        return _colocated_problems(loaded)
    problems = _separate_unsupported(loaded)
    if problems:
        return problems

    def problem(key: str, message: str, fix: str) -> list[Diagnostic]:
        return [loaded.diagnostic(("generation", key), "allocation.placement", message, help=fix)]

    g, m = gen.gpus_per_node, gen.num_nodes  # (not negative: their bounds in the schema)
    if (g > 0) == (m > 0):
        said = f"gpus_per_node {g} and num_nodes {m}"
        return problem(
            "gpus_per_node",
            f"generation.placement is separate, with generation.{said}: set exactly one of "
            "them above 0",
            "gpus_per_node: that many ranks of every node generate; num_nodes: the last "
            "nodes of the job generate",
        )
    if g and g >= gpus:
        return problem(
            "gpus_per_node",
            f"`generation.gpus_per_node` ({g}) leaves no training rank on a node of {gpus}",
            f"use at most {gpus - 1}, or more GPUs per node (--gpus)",
        )
    if m and m >= nodes:
        return problem(
            "num_nodes",
            f"`generation.num_nodes` ({m}) leaves no training node in a job of {nodes}",
            f"use at most {nodes - 1}, or more nodes (--nodes)",
        )
    return []


def _colocated_problems(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Keys that only mean something with separate placement must keep their defaults."""
    recipe = loaded.recipe
    gen = recipe.generation
    set_keys = [
        (("generation", key), value)
        for key, value in (
            ("gpus_per_node", gen.gpus_per_node),
            ("num_nodes", gen.num_nodes),
            ("tensor_parallel_size", gen.tensor_parallel_size - 1),
        )
        if value
    ]
    if recipe.async_grpo.max_staleness:
        set_keys.append((("async_grpo", "max_staleness"), recipe.async_grpo.max_staleness))
    if recipe.async_grpo.on_stale_turn != "stop":  # the trainer of separate placement checks
        set_keys.append((("async_grpo", "on_stale_turn"), recipe.async_grpo.on_stale_turn))
    return [
        loaded.diagnostic(
            path,
            "allocation.placement",
            f"`{'.'.join(path)}` is set, but generation.placement is colocated: it applies "
            "only to generation ranks of their own",
            help="set generation.placement=separate with generation.gpus_per_node (or "
            "num_nodes); asynchronous GRPO needs generation ranks of their own",
        )
        for path, _ in set_keys
    ]


def _separate_unsupported(loaded: LoadedRecipe) -> list[Diagnostic]:
    recipe = loaded.recipe
    gen = recipe.generation
    refused = []
    if gen.backend != "megatron":
        refused.append(
            (("generation", "backend"), f"generation.backend {gen.backend}", "use backend megatron")
        )
    return [
        loaded.diagnostic(
            path,
            "allocation.placement",
            f"generation.placement separate does not support {what}",
            help=fix,
        )
        for path, what, fix in refused
    ]


def _generation_parallel(loaded: LoadedRecipe, placement: Placement, gpus: int) -> list[Diagnostic]:
    """The generation ranks' own tensor-parallel groups stay inside a node, and their
    data-parallel replicas share the step's prompts evenly."""
    if not placement.separate:
        return []
    recipe = loaded.recipe
    gen = recipe.generation
    per_node = gen.gpus_per_node or gpus
    tp = gen.tensor_parallel_size
    if per_node % tp:
        return [
            loaded.diagnostic(
                ("generation", "tensor_parallel_size"),
                "allocation.placement",
                f"`generation.tensor_parallel_size` ({tp}) does not divide the {per_node} "
                "generation ranks of a node",
                help="a tensor-parallel group stays inside one node: choose a divisor of "
                f"{per_node}",
            )
        ]
    nodes = {r // gpus for r in placement.generation}
    host = gen.server.host
    if recipe.environment.kind == "gym" and len(nodes) > 1 and host in LOOPBACK:
        return [
            loaded.diagnostic(
                ("generation", "server", "host"),
                "allocation.placement",
                f"`environment.kind: gym`: Gym's vllm_model, on the first generation node, "
                f"sends turns to the servers of all {len(placement.generation)} generation "
                f"ranks on {len(nodes)} nodes, but they listen on {host} (this node only)",
                help="set generation.server.host=0.0.0.0 (the servers listen on every "
                "interface; each is reached by its node's name)",
            )
        ]
    replicas = len(placement.generation) // tp
    prompts = recipe.grpo.num_prompts_per_step
    if prompts % replicas:
        return [
            loaded.diagnostic(
                ("grpo", "num_prompts_per_step"),
                "allocation.placement",
                f"`grpo.num_prompts_per_step` ({prompts}) is not a multiple of the {replicas} "
                f"generation replicas ({len(placement.generation)} generation ranks over "
                f"tensor {tp})",
                help=f"each generation replica takes an equal share of the prompts: use a "
                f"multiple of {replicas}",
            )
        ]
    return []
