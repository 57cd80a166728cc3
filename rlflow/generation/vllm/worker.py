"""rlflow's vLLM worker: runs in vLLM's own environment and serves one trainer over a socket.

Started by `rlflow.generation.vllm.process.WorkerProcess` with the environment's interpreter:

    ENV/bin/python worker.py --fd FD --parent PID --config JSON

It must run under another Python and torch than the trainer, so it imports nothing from rlflow:
standard library at module level (the trainer imports the framing helpers below from here) and
vllm/PIL inside functions. One in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by
the trainer): no engine-core subprocess that could outlive us, tensors go straight to
`reload_weights`, and start-up takes seconds.

Messages are length-prefixed pickles of plain values (dict, list, str, bytes, numbers) over a
socketpair inherited from the trainer. Requests and replies:

    {"op": "generate", "requests": [...], "params": {...}} -> {"ok": True, "outputs": [...]}
    {"op": "reload", "path": FILE, "resets": ["encoder", "prefix"], "version": V,
     "samples": {key: [flat positions]}} -> {"ok": True, "seconds": s, "version": V,
                                            "fingerprint": {key: [shape, [bits]]}}
    {"op": "ping"} -> {"ok": True};  {"op": "shutdown"} -> {"ok": True}, then exit
    any failure -> {"ok": False, "error": traceback text}

The worker exits when the trainer goes away: end-of-file on the socket, and the kernel's
parent-death signal (PR_SET_PDEATHSIG) if the trainer is killed while we are busy.
"""

import argparse
import ctypes
import io
import json
import os
import pickle
import signal
import socket
import struct
import sys
import time
import traceback

_HEADER = struct.Struct(">Q")
_LOADED = {"version": None}  # the weights' version of the last reload (generate replies say it)


def send_message(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=4)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_message(sock: socket.socket):
    """The next message, or None at end-of-file (the other side is gone)."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = _recv_exactly(sock, _HEADER.unpack(header)[0])
    if body is None:
        return None
    return pickle.loads(body)


def _recv_exactly(sock: socket.socket, size: int):
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


# --- engine -------------------------------------------------------------------------------------


def start_engine(config: dict):
    from vllm import LLM

    return LLM(
        model=config["model"],
        dtype=config["dtype"],
        max_model_len=config["max_model_len"],
        max_num_seqs=config["max_num_seqs"],
        enforce_eager=config["enforce_eager"],
        gpu_memory_utilization=config["gpu_memory_utilization"],
        limit_mm_per_prompt=config["limit_mm_per_prompt"],
        seed=config["seed"],
        # Log-probs of the unmodified model (before temperature/top-k/top-p): what the trainer
        # recomputes, so token_mult_prob_error measures numerics only.
        logprobs_mode="raw_logprobs",
        # Sampling comes from each request, never from the checkpoint's generation_config.json.
        generation_config="vllm",
    )


def _image(data: bytes):
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def vllm_input(request: dict) -> dict:
    """A trainer request -> vLLM's prompt dict (images as PIL, video as frames + metadata)."""
    media = {}
    if request["images"]:
        images = [_image(b) for b in request["images"]]
        media["image"] = images[0] if len(images) == 1 else images
    video = request["video"]
    if video is not None:
        count, fps = len(video["frames"]), video["fps"]
        # Qwen2.5-VL needs metadata with the frames; they are already sampled (do_sample_frames).
        metadata = {
            "fps": fps,
            "duration": count / fps,
            "total_num_frames": count,
            "frames_indices": list(range(count)),
            "video_backend": "opencv",
            "do_sample_frames": False,
        }
        media["video"] = ([_image(b) for b in video["frames"]], metadata)
    out = {"prompt": request["prompt"]}
    if media:
        out["multi_modal_data"] = media
    return out


def sampling_params(params: dict, row: int):
    from vllm import SamplingParams

    greedy = params["temperature"] == 0
    return SamplingParams(
        n=1,
        max_tokens=params["max_new_tokens"],
        temperature=params["temperature"],
        top_p=1.0 if greedy else params["top_p"],
        top_k=0 if greedy else params["top_k"],
        seed=None if greedy else params["seed"] + row,  # every row of a group samples differently
        # The trainer's stop tokens decide, exactly as in the other backends: vLLM's own EOS
        # handling is off, and ignore_eos means no stop token at all.
        ignore_eos=True,
        stop_token_ids=[] if params["ignore_eos"] else list(params["stop_token_ids"]),
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
    )


def weight_key(name: str) -> str | None:
    """The part of a language-model weight's name that HF checkpoints and vLLM share, or None:
    from "layers." on (decoder layers), or the embedding, the final norm and the head. The
    trainer names the tensors it samples by this key (rlflow.generation.vllm.client)."""
    if "layers." in name and not name.startswith(("visual", "model.visual", "vision")):
        return name[name.index("layers.") :]
    for tail in ("embed_tokens.weight", "lm_head.weight"):
        if name.endswith(tail):
            return tail
    if name.endswith(("model.norm.weight", "language_model.norm.weight")):
        return "norm.weight"
    return None


def fingerprint(llm, samples: dict) -> dict:
    """The bits of the sampled elements of vLLM's own weights, for the keys that name one of
    them unfused (fused ones, e.g. qkv_proj, are not there under an HF key): {key: [shape, bits]}.
    Read from the live engine after the reload, so a load that dropped or garbled a tensor shows."""

    def read(worker):
        import torch

        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        out = {}
        for name, param in worker.model_runner.model.named_parameters():
            key = weight_key(name)
            if key is None or key not in samples or key in out:
                continue
            flat = param.detach().reshape(-1)
            index = torch.tensor(samples[key], dtype=torch.long)
            if len(index) and int(index.max()) < flat.numel():
                values = flat[index.to(flat.device)].cpu()
                pattern = values.view(bits[values.element_size()]).to(torch.int64) & 0xFFFFFFFF
                out[key] = [list(param.shape), pattern.tolist()]
        return out

    return llm.collective_rpc(read)[0]


def generate(llm, message: dict) -> dict:
    inputs = [vllm_input(r) for r in message["requests"]]
    params = [sampling_params(message["params"], row) for row in range(len(inputs))]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    rows = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        steps = zip(tokens, completion.logprobs, strict=True)
        logprobs = [step[token].logprob for token, step in steps]
        rows.append(
            {
                "token_ids": tokens,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "prompt_token_ids": list(output.prompt_token_ids),
            }
        )
    return {"outputs": rows, "version": _LOADED["version"]}


def reload(llm, message: dict) -> dict:
    """New weights in place (a safetensors file, HF checkpoint names), then the cache resets.

    Both resets are needed after vLLM 0.32's reload: without the encoder-cache reset the
    scheduler believes old image features are cached and the engine dies on the next image
    ("Encoder cache miss"); without the prefix-cache reset prompts of a full KV block (>= 128
    tokens on CPU) reuse keys and values computed with the old weights, silently.
    """
    from safetensors.torch import load_file

    start = time.perf_counter()
    # Tensors, not `weights_path`: reloading from a path re-points vLLM's model config at that
    # folder, and the processor and tokenizer would later be looked up there.
    weights = list(load_file(message["path"]).items())
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    if "encoder" in message["resets"]:
        llm.llm_engine.reset_encoder_cache()
    if "prefix" in message["resets"] and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
    _LOADED["version"] = message.get("version")
    return {
        "seconds": time.perf_counter() - start,
        "version": _LOADED["version"],
        "fingerprint": fingerprint(llm, message.get("samples") or {}),
    }


# --- serving ------------------------------------------------------------------------------------


def serve(sock: socket.socket, llm) -> int:
    handlers = {"generate": generate, "reload": reload, "ping": lambda llm, message: {}}
    while True:
        message = recv_message(sock)
        if message is None:
            print("rlflow-vllm-worker: the trainer closed the connection; exiting", flush=True)
            return 0
        op = message.get("op")
        if op == "shutdown":
            print("rlflow-vllm-worker: shutdown requested; exiting", flush=True)
            send_message(sock, {"ok": True})
            return 0
        try:
            reply = {"ok": True, **handlers[op](llm, message)}
        except BaseException:  # noqa: BLE001 - every failure goes back to the trainer, verbatim
            text = traceback.format_exc()
            print(f"rlflow-vllm-worker: {op} failed:\n{text}", file=sys.stderr, flush=True)
            reply = {"ok": False, "error": text}
        send_message(sock, reply)


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to kill us when the trainer dies (Linux), even if we are mid-request."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: end-of-file on the socket still ends us between requests
    if os.getppid() != parent:  # the trainer died before the request above took effect
        sys.exit(1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    _die_with_parent(args.parent)
    sock = socket.socket(fileno=args.fd)
    config = json.loads(args.config)
    start = time.perf_counter()
    print(
        f"rlflow-vllm-worker: pid {os.getpid()}, python {sys.version.split()[0]}, "
        f"starting vLLM on {config['model']}",
        flush=True,
    )
    try:
        import vllm

        llm = start_engine(config)
    except BaseException:  # noqa: BLE001 - reported to the trainer, which shows the log tail
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        send_message(sock, {"ok": False, "error": text})
        return 1
    send_message(
        sock,
        {
            "ok": True,
            "vllm_version": vllm.__version__,
            "startup_seconds": time.perf_counter() - start,
        },
    )
    print(f"rlflow-vllm-worker: ready in {time.perf_counter() - start:.1f} s", flush=True)
    return serve(sock, llm)


if __name__ == "__main__":
    sys.exit(main())
