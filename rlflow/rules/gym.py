"""`environment.kind: gym`: the Gym servers a job starts, read from the recipe's Gym config files
without importing Gym (login node), and the rules on them. `submit --dry-run` prints the plan
(`gym_plan_text`), `rlflow train` runs the same rules at setup; rlflow/train/gym/servers.py
starts what Gym's own parser makes of the same files.

Rule functions here are listed in `RULES` of rlflow/rules/checks.py, like the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from rlflow.errors import Diagnostic
from rlflow.optional import GYM_INSTALL_HELP, gym_root
from rlflow.recipe.load import LoadedRecipe

SERVER_KINDS = ("resources_servers", "responses_api_agents", "responses_api_models")
POLICY_MODEL = "policy_model"  # rlflow adds it: Gym's vllm_model, pointed at rlflow's server


@dataclass(frozen=True)
class PlannedServer:
    name: str  # the instance (a top-level key of the configs)
    kind: str  # one of SERVER_KINDS
    server: str  # the server's folder name (e.g. simple_agent)
    port: int | None  # None: Gym picks a free one at start


def read_configs(paths: list[str], root: Path) -> dict:
    """The configs' top-level keys, merged in order (nested `config_paths` followed), as Gym
    merges them; OSError/yaml.YAMLError/ValueError name the file."""
    merged: dict = {}
    todo, seen = list(paths), set()
    while todo:
        entry = todo.pop(0)
        if entry in seen:
            continue
        seen.add(entry)
        path = Path(entry)
        if not path.is_absolute():
            path = path if path.is_file() else root / path
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a mapping")
        todo += [p for p in data.pop("config_paths", None) or [] if p not in seen]
        merged.update(data)
    return merged


def planned_servers(recipe, root: Path) -> list[PlannedServer]:
    """Every server instance the job starts: the agent, the resources servers, the policy's."""
    cfg = recipe.environment.gym
    found = {}
    for name, value in read_configs(cfg.config_paths, root).items():
        if isinstance(value, dict) and len(value) == 1:
            [(kind, inner)] = value.items()
            if kind in SERVER_KINDS and isinstance(inner, dict) and len(inner) == 1:
                [(server, body)] = inner.items()
                if isinstance(body, dict) and "entrypoint" in body:
                    found[name] = PlannedServer(name, kind, server, body.get("port"))
    found[POLICY_MODEL] = PlannedServer(POLICY_MODEL, "responses_api_models", "vllm_model", None)
    wanted = [cfg.agent, *cfg.resource_servers] if cfg.resource_servers else [cfg.agent]
    if not cfg.resource_servers:
        wanted += [n for n, s in found.items() if s.kind == "resources_servers"]
    return [found.get(n, PlannedServer(n, "", "", None)) for n in dict.fromkeys(wanted)] + [
        found[POLICY_MODEL]
    ]


def _plan(recipe_file: LoadedRecipe) -> tuple[list[PlannedServer] | None, list[Diagnostic]]:
    root = gym_root()
    if recipe_file.recipe.environment.kind != "gym" or root is None:
        return None, []
    try:
        return planned_servers(recipe_file.recipe, root), []
    except (OSError, yaml.YAMLError, ValueError) as exc:
        return None, [
            recipe_file.diagnostic(
                ("environment", "gym", "config_paths"),
                "recipe.gym-config",
                f"a NeMo Gym config of `environment.gym.config_paths` cannot be read: {exc}",
                help="paths are relative to the working directory or to Gym's install, e.g. "
                "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
            )
        ]


def gym_installed(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`environment.kind: gym` needs the `gym` extra where the job runs (asked, not imported)."""
    if loaded.recipe.environment.kind != "gym" or gym_root() is not None:
        return []
    return [
        loaded.diagnostic(
            ("environment", "kind"),
            "recipe.gym-missing",
            "`environment.kind` is gym, but NeMo Gym (nemo_gym) is not installed",
            help=GYM_INSTALL_HELP,
        )
    ]


def gym_servers_defined(loaded: LoadedRecipe) -> list[Diagnostic]:
    """The agent and the resources servers the recipe names exist in its Gym configs."""
    servers, problems = _plan(loaded)
    missing = [s.name for s in servers or [] if not s.kind]
    if problems or not missing:
        return problems
    key = "agent" if loaded.recipe.environment.gym.agent in missing else "resource_servers"
    return [
        loaded.diagnostic(
            ("environment", "gym", key),
            "recipe.gym-server",
            f"NeMo Gym server instance(s) {missing} are not defined by environment.gym.config_paths",
            help="name server instances by the configs' top-level keys, e.g. "
            "example_single_tool_call_simple_agent",
        )
    ]


def gym_ports_distinct(loaded: LoadedRecipe) -> list[Diagnostic]:
    """rlflow's server, Gym's head server and every Gym server with a fixed port: all different
    (port 0 and Gym's unset ports are picked free at start)."""
    recipe = loaded.recipe
    servers, problems = _plan(loaded)
    if servers is None:
        return problems
    taken = [("generation.server.port", recipe.generation.server.port),
             ("environment.gym.head_port", recipe.environment.gym.head_port)]  # fmt: skip
    taken += [(f"Gym server {s.name}", s.port) for s in servers if s.port]
    seen: dict[int, str] = {}
    for owner, port in taken:
        if port and port in seen:
            return [
                loaded.diagnostic(
                    ("environment", "gym", "head_port"),
                    "recipe.gym-ports",
                    f"port {port} is used twice: by {seen[port]} and by {owner}",
                    help="give each server its own port (0 or unset: a free one at start)",
                )
            ]
        seen[port] = owner
    return []


def gym_fits_engine(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Gym's tasks in flight each hold one row of rlflow's server: `concurrency` fits its rows
    (`generation.server.max_rows`) and, when the KV cache is sized, one full-context row each."""
    recipe = loaded.recipe
    cfg, server = recipe.environment.gym, recipe.generation.server
    if recipe.environment.kind != "gym":
        return []
    cache = recipe.generation.kv_cache_tokens
    problem = None
    if cfg.concurrency > server.max_rows:
        problem = f"generation.server.max_rows ({server.max_rows})"
    elif cache and cfg.concurrency * server.context_tokens > cache:
        problem = (
            f"the KV cache: generation.kv_cache_tokens {cache} < {cfg.concurrency} x "
            f"generation.server.context_tokens {server.context_tokens}"
        )
    if problem is None:
        return []
    return [
        loaded.diagnostic(
            ("environment", "gym", "concurrency"),
            "recipe.gym-concurrency",
            f"`environment.gym.concurrency` ({cfg.concurrency}) is above {problem}: tasks would "
            "queue behind each other and time out",
            help="lower environment.gym.concurrency, or raise the server's rows / KV cache",
        )
    ]


def gym_needs_one_engine(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Gym's turns are served by megatron engines: colocated, rank 0's on its whole model (no
    tensor, pipeline or expert parallelism); with `generation.placement: separate`, every
    generation engine's, tensor-parallel or not (its first rank serves, the others follow:
    rlflow/serve/tensor_parallel.py; the trainers may be split any way rlflow trains; that
    other nodes reach the servers is an allocation rule)."""
    recipe = loaded.recipe
    if recipe.environment.kind != "gym":
        return []
    par, gen = recipe.parallelism, recipe.generation
    separate = gen.placement == "separate"
    if separate:
        split = {}
    else:
        split = {
            "parallelism.tensor_parallel_size": par.tensor_parallel_size,
            "parallelism.pipeline_parallel_size": par.pipeline_parallel_size,
            "parallelism.expert_parallel_size": par.expert_parallel_size,
        }
    bad = [f"{k}={v}" for k, v in split.items() if v != 1]
    if gen.backend != "megatron":
        bad.append(f"generation.backend={gen.backend}")
    if not bad:
        return []
    where = (
        "the generation ranks' megatron engines"
        if separate
        else ("rank 0's megatron engine on its whole model")
    )
    fix = (
        "use generation.backend=megatron (the engines and the trainers may use any parallel "
        "sizes rlflow supports)"
        if separate
        else "use generation.backend=megatron and parallel sizes 1 (data parallelism is fine), "
        "or generation.placement=separate: then the generation ranks serve"
    )
    return [
        loaded.diagnostic(
            ("environment", "kind"),
            "recipe.gym-engine",
            f"`environment.kind: gym` serves Gym's turns from {where}; not implemented "
            f"with {', '.join(bad)}",
            help=fix,
        )
    ]


def gym_plan_text(recipe_file: LoadedRecipe) -> str | None:
    """The dry run's lines on Gym: what starts where, on which ports."""
    servers, _ = _plan(recipe_file)
    if servers is None:
        return None
    recipe = recipe_file.recipe
    port = recipe.generation.server.port or "free"
    head = f"Gym's head server on 127.0.0.1:{recipe.environment.gym.head_port}"
    tp = recipe.generation.tensor_parallel_size
    if recipe.generation.placement == "separate":
        who = "every generation rank" if tp == 1 else (
            f"the first rank of every generation engine (tensor-parallel size {tp}: the others "
            "follow its plans)"
        )  # fmt: skip
        lines = [
            f"{who} starts rlflow's server on {recipe.generation.server.host}:"
            f"{port}{' + its local rank' if recipe.generation.server.port else ''}; the first "
            f"generation rank (its node) starts {head}, and:"
        ]
    else:
        lines = [
            f"rank 0 (first node) starts rlflow's server on {recipe.generation.server.host}:"
            f"{port}, {head}, and:"
        ]
    for s in servers:
        lines.append(f"  {s.name} ({s.kind}/{s.server}) on 127.0.0.1:{s.port or 'free'}")
    env = recipe.environment
    lines.append(
        f"  every server answers within {env.gym.ready_timeout_s} s or the job ends; "
        f"{env.gym.concurrency} tasks in flight, each at most {env.task_timeout_s} s; "
        f"a failed task: {env.on_task_failure}"
    )
    return "\n".join(lines)
