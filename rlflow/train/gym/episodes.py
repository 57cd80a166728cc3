"""The leader's side of a Gym step: post the step's task rows to Gym's agent (what Gym's rollout
collection does: `environment.gym.concurrency` at once, each bounded by
`environment.task_timeout_s`), turn each answer into a Trajectory or a TaskFailed saying why, and
sum up the step's environment metrics.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.train.gym.trajectory import TaskFailed, Trajectory, convert


class Episodes:
    """Posts task rows to the agent at `agent_url`; `servers` (GymServers) names the dead."""

    def __init__(self, env, agent_url: str, servers, log_dir: Path):
        self.env, self.agent_url, self.servers, self.log_dir = env, agent_url, servers, log_dir

    def run(self, rows: list[dict], version: int) -> list[Trajectory | TaskFailed]:
        """One answer per row, in order; `version`: the weights the policy's server holds."""
        return asyncio.run(self.post_all(rows, version))

    async def post_all(self, rows: list[dict], version: int) -> list[Trajectory | TaskFailed]:
        import httpx

        concurrency = self.env.gym.concurrency
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency)
        # Each task is a Gym session of its own (Gym's rollout collection keeps no cookies
        # either): a kept session cookie would make every task one session, sharing a stateful
        # resources server's state and pinning every turn to one of vllm_model's servers.
        jar = http.cookiejar.CookieJar(policy=_NoCookies())
        async with httpx.AsyncClient(timeout=None, limits=limits, cookies=jar) as client:

            async def one(row: dict):
                async with gate:
                    try:
                        return await asyncio.wait_for(
                            self._post(client, row, version), self.env.task_timeout_s
                        )
                    except TaskFailed as failure:
                        return failure
                    except TimeoutError:
                        return TaskFailed(
                            "timeout", f"no answer within {self.env.task_timeout_s} s"
                        )
                    except httpx.HTTPError as exc:
                        dead = self.servers.dead()
                        detail = f"dead: {dead}" if dead else f"{type(exc).__name__}: {exc}"
                        return TaskFailed("server_died" if dead else "connection", detail)

            return await asyncio.gather(*(one(row) for row in rows))

    async def _post(self, client, row: dict, version: int) -> Trajectory:
        response = await client.post(f"{self.agent_url}/run", json=row)
        if response.status_code != 200:
            raise TaskFailed(f"http_{response.status_code}", response.text[-500:])
        try:
            body = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TaskFailed("malformed_json", f"the agent's answer is not JSON: {exc}") from None
        return convert(body, version)

    def on_failure(self, failure: TaskFailed, task: int) -> None:
        """`environment.on_task_failure: stop`: the run ends naming the task and why."""
        if self.env.on_task_failure == "stop":
            raise RlflowError(
                Diagnostic(
                    "gym.task-failed",
                    f"NeMo Gym task {task} failed ({failure.reason}): {failure.detail}",
                    help="environment.on_task_failure: continue leaves failed tasks out "
                    f"(counted in env/failed_tasks); the Gym servers' logs are in {self.log_dir}",
                )
            )


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    """Keeps no cookie and sends none."""

    def set_ok(self, cookie, request) -> bool:
        return False

    def return_ok(self, cookie, request) -> bool:
        return False


def failures_seen(step: int, failed: dict, example: dict, log_dir: Path) -> Diagnostic:
    """A warning naming each reason's count and its first task's detail (for continuity: the
    turn and the first differing token)."""
    notes = tuple(f"{reason} ({n}): {example[reason]}" for reason, n in sorted(failed.items()))
    return Diagnostic(
        "gym.tasks-failed",
        f"step {step}: {sum(failed.values())} NeMo Gym tasks failed and their groups were left "
        "out (environment.on_task_failure: continue)",
        severity="warning",
        notes=notes,
        help=f"the Gym servers' logs are in {log_dir}",
    )


def env_metrics(
    failed, malformed, turns, tasks: int, seconds: float, left_out: int = 0
) -> dict[str, float]:
    out = {
        "env/tasks": float(tasks),
        "env/failed_tasks": float(sum(failed.values())),
        "env/malformed_tool_calls": float(sum(malformed.values())),
        "env/turns_per_trajectory": sum(turns) / max(len(turns), 1),
        "env/empty_turns_left_out": float(left_out),
        "env/seconds": seconds,
    }
    out.update({f"env/failed_tasks/{k}": float(v) for k, v in failed.items()})
    out.update({f"env/malformed_tool_calls/{k}": float(v) for k, v in malformed.items()})
    return out
