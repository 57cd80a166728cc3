"""NeMo Gym's servers for one run: Gym's global config, the server processes, their readiness.

Rank 0 builds Gym's global config the way `ng_run` does (Gym's own parser: the recipe's
`environment.gym.config_paths`, plus Gym's `vllm_model` pointed at rlflow's server), starts one
child process per server instance (rlflow/compat/gym_server.py, in the server's folder) and
waits, at most `ready_timeout_s`, until every one answers HTTP; one that exits or never answers
ends the run naming it. `stop()` ends them again (SIGTERM, then SIGKILL), also on a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError

POLICY_MODEL = "policy_model"  # the name Gym's agent configs give the policy's model server
VLLM_MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"


@dataclass(frozen=True)
class GymServer:
    name: str  # the config's top-level key (Gym's server instance name)
    kind: str  # resources_servers, responses_api_agents, responses_api_models
    folder: Path
    entrypoint: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def gym_config(cfg, policy_urls: list[str], model_name: str):
    """Gym's global config (an OmegaConf DictConfig), parsed by Gym, ports assigned; also set as
    this process's (Gym's head server, started by GymServers, serves it to Gym's clients).
    Gym's vllm_model spreads its sessions over `policy_urls` (each rlflow's server)."""
    bases = [f"{url}/v1" for url in policy_urls]
    from nemo_gym.global_config import (
        GlobalConfigDictParserConfig,
        get_global_config_dict,
        set_global_config_dict,
    )
    from omegaconf import OmegaConf

    initial = {
        "config_paths": [*cfg.config_paths, VLLM_MODEL_CONFIG],
        "policy_base_url": bases[0] if len(bases) == 1 else bases,
        "policy_api_key": "unused",
        "policy_model_name": model_name,
        "head_server": {"host": "127.0.0.1", "port": cfg.head_port},
        # rlflow serves no reasoning parser: the policy's text is the message
        POLICY_MODEL: {"responses_api_models": {"vllm_model": {
            "return_token_id_information": True, "uses_reasoning_parser": False,
        }}},
    }  # fmt: skip
    try:
        set_global_config_dict(  # Gym's process-wide config: its head server serves it
            GlobalConfigDictParserConfig(
                dotenv_path=None, initial_global_config_dict=OmegaConf.create(initial),
                skip_load_from_cli=True, skip_load_from_dotenv=True,
            )
        )  # fmt: skip
        config = get_global_config_dict()
    except Exception as exc:  # Gym's own errors name the path or the key
        raise RlflowError(
            Diagnostic(
                "gym.config",
                f"NeMo Gym cannot read environment.gym.config_paths: {exc}",
                help="each path is a Gym config YAML, relative to the working directory or to "
                "Gym's install (e.g. resources_servers/example_single_tool_call/configs/"
                "example_single_tool_call.yaml)",
            )
        ) from None
    return config


def servers_to_start(config, cfg) -> list[GymServer]:
    """The server instances the run needs: the agent, the resources servers it names (all of
    the config's, or `environment.gym.resource_servers`) and the policy's model server."""
    from nemo_gym.global_config import get_first_server_config_dict

    found = {}
    for name, value in config.items():
        try:
            [(kind, inner)] = value.items()
            [(server, body)] = inner.items()
        except (AttributeError, ValueError):
            continue
        if not hasattr(body, "get") or "entrypoint" not in body:
            continue
        found[name] = (kind, server)
    wanted = {cfg.agent, POLICY_MODEL, *cfg.resource_servers}
    if not cfg.resource_servers:
        wanted |= {n for n, (kind, _) in found.items() if kind == "resources_servers"}
    missing = sorted(wanted - set(found))
    if missing:
        raise RlflowError(
            Diagnostic(
                "gym.config",
                f"environment.gym names {missing}, which the Gym configs do not define "
                f"(they define {sorted(found)})",
                help="set environment.gym.agent and resource_servers to server instance names "
                "of the config files (their top-level keys)",
            )
        )
    out = []
    for name in sorted(wanted):
        kind, server = found[name]
        body = get_first_server_config_dict(config, name)
        folder = _server_folder(kind, server)
        out.append(GymServer(name, kind, folder, body.entrypoint, body.host, int(body.port)))
    return out


def _server_folder(kind: str, server: str) -> Path:
    import nemo_gym

    local = Path.cwd() / kind / server
    return local if local.is_dir() else Path(nemo_gym.PARENT_DIR) / kind / server


class GymServers:
    """Gym's server processes for the run: `start()` (bounded), `dead()`, `stop()`."""

    def __init__(self, config, servers: list[GymServer], log_dir: Path, ready_timeout_s: int):
        self.config, self.servers = config, servers
        self.log_dir, self.ready_timeout_s = log_dir, ready_timeout_s
        self.processes: dict[str, subprocess.Popen] = {}
        self.head = None  # Gym's head server (uvicorn in a thread), as ng_run runs it

    def _start_head(self) -> None:
        from nemo_gym.server_utils import HeadServer

        self.head, thread, instance = HeadServer.run_webserver()
        self.head_thread = thread
        instance.set_server_instances(
            [{"process_name": s.name, "url": s.url, "port": s.port} for s in self.servers]
        )

    def start(self) -> None:
        from nemo_gym.global_config import (
            NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
            NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
        )
        from omegaconf import OmegaConf

        self.log_dir.mkdir(parents=True, exist_ok=True)
        text = OmegaConf.to_yaml(self.config)
        try:
            self._start_head()
            for server in self.servers:
                env = dict(os.environ)
                env[NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME] = text
                env[NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME] = server.name
                env["RLFLOW_GYM_PARENT"] = str(os.getpid())  # rlflow/compat/gym_server.py
                log = open(self.log_dir / f"{server.name}.log", "wb")  # noqa: SIM115 - the child's
                self.processes[server.name] = subprocess.Popen(
                    [sys.executable, "-m", "rlflow.compat.gym_server", server.entrypoint],
                    cwd=server.folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
                log.close()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.ready_timeout_s
        head = self.config["head_server"]
        waiting = [
            *self.servers,
            GymServer("head_server", "head", Path(), "", head.host, head.port),
        ]
        with httpx.Client(timeout=2.0) as client:
            while waiting:
                for server in list(waiting):
                    if server.kind == "head" and not self.head_thread.is_alive():
                        self._fail(server, "stopped (is its port taken? environment.gym.head_port)")
                    process = self.processes.get(server.name)
                    if process is not None and process.poll() is not None:
                        self._fail(
                            server, f"exited with status {process.poll()} before it was ready"
                        )
                    try:
                        client.get(server.url + "/")
                        waiting.remove(server)
                    except httpx.HTTPError:
                        pass
                if waiting and time.monotonic() > deadline:
                    names = ", ".join(f"{s.name} ({s.url})" for s in waiting)
                    raise RlflowError(
                        Diagnostic(
                            "gym.not-ready",
                            f"NeMo Gym server(s) not ready after {self.ready_timeout_s} s "
                            f"(environment.gym.ready_timeout_s): {names}",
                            help=f"see their logs in {self.log_dir}; raise "
                            "environment.gym.ready_timeout_s if they are only slow to start",
                        )
                    )
                if waiting:
                    time.sleep(0.05)

    def _fail(self, server: GymServer, what: str) -> None:
        log = self.log_dir / f"{server.name}.log"
        tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
        raise RlflowError(
            Diagnostic(
                "gym.server-died",
                f"NeMo Gym server {server.name} ({server.kind}, {server.url}) {what}",
                help=f"its log ({log}) ends:\n{tail}",
            )
        )

    def dead(self) -> list[str]:
        """The servers whose process has exited."""
        return [name for name, p in self.processes.items() if p.poll() is not None]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes.clear()
        if self.head is not None:
            self.head.should_exit = True
            self.head_thread.join()
            self.head = None
