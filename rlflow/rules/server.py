"""The rule of the server inside a job (`generation.server.enabled`, rlflow/serve/job.py):
combinations it cannot serve are refused before the job starts. Listed in `RULES` of
rlflow/rules/checks.py, so the dry run and `rlflow train` both run it."""

from __future__ import annotations

from rlflow.errors import Diagnostic
from rlflow.recipe.load import LoadedRecipe

_HIGHEST_PORT = 65535
_RANKS_PER_NODE_UNKNOWN = 8  # cluster.gpus_per_node null: `rlflow submit` fills it later


def server_in_job(loaded: LoadedRecipe) -> list[Diagnostic]:
    """The server runs on one rank's whole model with rlflow's megatron engine: a tensor- or
    expert-parallel engine, or another backend, has no server; each rank of a node listens on
    port + its local rank, so those ports must exist."""
    recipe = loaded.recipe
    gen, par = recipe.generation, recipe.parallelism
    server = gen.server
    if not server.enabled:
        return []
    where = ("generation", "server", "enabled")
    fix = "or set generation.server.enabled=false"

    def refuse(message: str, help: str) -> Diagnostic:  # noqa: A002 (Diagnostic's name)
        return loaded.diagnostic(where, "recipe.server-in-job", message, f"{help}, {fix}")

    problems = []
    if gen.backend != "megatron":
        problems.append(
            refuse(
                f"`generation.server.enabled` serves rlflow's megatron engine; backend "
                f"`{gen.backend}` has none to serve",
                "set generation.backend=megatron",
            )
        )
    separate = gen.placement == "separate"
    tp = gen.tensor_parallel_size if separate else par.tensor_parallel_size
    tp_key = "generation.tensor_parallel_size" if separate else "parallelism.tensor_parallel_size"
    if tp > 1:
        problems.append(
            refuse(
                f"the server runs one rank's whole model; `{tp_key}` is {tp} (a tensor-parallel "
                "engine has no server yet)",
                f"set {tp_key}=1",
            )
        )
    if not separate and par.expert_parallel_size > 1:
        problems.append(
            refuse(
                "the server runs one rank's whole model; `parallelism.expert_parallel_size` is "
                f"{par.expert_parallel_size} (an expert-parallel engine has no server yet)",
                "set parallelism.expert_parallel_size=1, or generation.placement=separate",
            )
        )
    ranks = recipe.cluster.gpus_per_node or _RANKS_PER_NODE_UNKNOWN
    if server.port and server.port + ranks - 1 > _HIGHEST_PORT:
        problems.append(
            loaded.diagnostic(
                ("generation", "server", "port"),
                "recipe.server-in-job",
                f"`generation.server.port: {server.port}`: the ranks of a node listen on port + "
                f"local rank, up to {server.port + ranks - 1}, past the last port "
                f"{_HIGHEST_PORT}",
                help=f"set generation.server.port to at most {_HIGHEST_PORT - ranks + 1}, or 0 "
                "(each rank picks a free port)",
            )
        )
    return problems
