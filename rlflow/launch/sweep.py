"""Sweeps: `--sweep KEY=V1,V2` axes -> their cross product -> named elements -> a manifest.

    SWEEP_DIR/sweep.json      axes, elements (name, overrides), the job array's id
    SWEEP_DIR/script.sbatch   the array's script: task i runs element i's own script
    SWEEP_DIR/job_id          the array's job id
    SWEEP_DIR/logs/           slurm-<array>_<i>.out: which element each array task ran
    SWEEP_DIR/<element>/      a run directory like a single job's (script.sbatch, recipe.yaml,
                              job_id `<array>_<i>`, logs/, status/, attempts.jsonl, metrics)

Each value becomes an ordinary override (`KEY=VALUE`), so the schema types it and every check a
single submission runs checks it. Nothing here touches Slurm.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rlflow import bounded
from rlflow.errors import Diagnostic, RlflowError
from rlflow.job.files import JOB_ID, short

MANIFEST = "sweep.json"
# Keys that name the sweep itself (its directory, its one job array) or come from the flags.
FIXED_KEYS = ("run.name", "run.output_dir", "cluster.num_nodes", "cluster.gpus_per_node")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
NAME_MAX = 80  # characters of an element's directory name after its index
# Elements in one sweep: each is checked like a submission (~0.1 s), and Slurm's default
# MaxArraySize (1001) takes array indices 0-1000; 8,000 elements ran past 10 minutes.
MAX_ELEMENTS = 1000


@dataclass(frozen=True)
class Axis:
    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Element:
    index: int
    name: str  # its directory under SWEEP_DIR
    overrides: tuple[str, ...]  # KEY=VALUE, one per axis


def parse_axes(texts: tuple[str, ...] | list[str], overrides: tuple[str, ...] = ()) -> list[Axis]:
    """`--sweep KEY=V1,V2,...` flags -> axes; every problem at once, as diagnostics."""
    axes: list[Axis] = []
    problems: list[Diagnostic] = []
    overridden = {text.partition("=")[0] for text in overrides}
    for text in texts:
        key, sep, values_text = text.partition("=")
        key = key.strip()
        values = split_values(values_text)
        if not sep or not key or not values or any(not v.strip() for v in values):
            problems.append(
                _error(
                    f"cannot read `--sweep {text}`",
                    "write --sweep dotted.key=VALUE1,VALUE2, e.g. --sweep optimizer.lr=1e-6,2e-6",
                )
            )
        elif key in FIXED_KEYS:
            problems.append(
                _error(
                    f"`--sweep {key}=...`: `{key}` is one value for the whole sweep",
                    "run.name and run.output_dir name the sweep directory and the job array, and "
                    "--nodes/--gpus set cluster.*; set them once (as an override or in the recipe)",
                )
            )
        elif any(axis.key == key for axis in axes):
            problems.append(
                _error(
                    f"`--sweep {key}=...` is given twice",
                    f"list every value once: --sweep {key}=A,B,C",
                )
            )
        elif key in overridden:
            problems.append(
                _error(
                    f"`{key}` is both swept and overridden (`{key}=...` on the command line)",
                    f"drop one of them: the sweep sets `{key}` for every element",
                )
            )
        elif len(values) > MAX_ELEMENTS:
            problems.append(_too_many(f"`--sweep {key}=...` lists {len(values)} values"))
        elif same := _repeated(key, [v.strip() for v in values]):
            problems.append(
                _error(
                    f"`--sweep {text}` repeats a value: {same[0]} and {same[1]} are the same "
                    f"`{key}` (two elements would be the same run)",
                    "list each value once",
                )
            )
        else:
            axes.append(Axis(key, tuple(v.strip() for v in values)))
    if not problems and _count(axes) > MAX_ELEMENTS:
        problems.append(_too_many(f"the sweep is {_count(axes)} elements"))
    if problems:
        raise RlflowError(problems)
    return axes


def _repeated(key: str, values: list[str]) -> tuple[str, str] | None:
    """Two values that give `key` the same value once typed (`1e-4` and `0.0001`), if any."""
    from rlflow.recipe.values import override_value

    seen: dict[object, str] = {}
    for text in values:
        typed = override_value(key, text)
        marker = repr(text) if typed is None else repr(typed)  # untyped: the load says why
        if marker in seen:
            return seen[marker], text
        seen[marker] = text
    return None


def _too_many(what: str) -> Diagnostic:
    return _error(
        f"{what}: rlflow submits at most {MAX_ELEMENTS} elements as one job array",
        "split it into several sweeps (or sweep fewer values); Slurm's default MaxArraySize "
        "allows array indices up to 1000",
    )


def split_values(text: str) -> list[str]:
    """Split at commas outside quotes and brackets: `1,[a, b],'x,y'` -> 3 values."""
    values, current, depth, quote = [], [], 0, None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append("".join(current))
            current = []
            continue
        current.append(char)
    values.append("".join(current))
    return [] if values == [""] else values


def elements(axes: list[Axis]) -> list[Element]:
    """The cross product, first axis slowest, each with a readable, file-safe directory name."""
    width = len(str(max(_count(axes) - 1, 0)))
    short = _short_keys([a.key for a in axes])
    found = []
    for index, values in enumerate(itertools.product(*(a.values for a in axes))):
        label = ",".join(f"{k}={v}" for k, v in zip(short, values, strict=True))
        label = _NAME_UNSAFE.sub("_", label).strip("._")[:NAME_MAX]
        found.append(
            Element(
                index=index,
                name=f"{index:0{width}d}-{label}" if label else f"{index:0{width}d}",
                overrides=tuple(f"{a.key}={v}" for a, v in zip(axes, values, strict=True)),
            )
        )
    return found


def _count(axes: list[Axis]) -> int:
    count = 1
    for axis in axes:
        count *= len(axis.values)
    return count


def _short_keys(keys: list[str]) -> list[str]:
    """The last part of each key (`optimizer.lr` -> `lr`), or the whole key where two clash."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return [s if last.count(s) == 1 else k for s, k in zip(last, keys, strict=True)]


def array_spec(count: int, max_concurrent: int | None) -> str:
    """sbatch --array: `0-3`, or `0-3%2` with at most 2 elements running at once."""
    return f"0-{count - 1}" + (f"%{max_concurrent}" if max_concurrent else "")


def write_manifest(
    directory: Path,
    axes: list[Axis],
    found: list[Element],
    array_job_id: str,
    max_concurrent: int | None,
) -> None:
    manifest = {
        "format": 1,
        "array_job_id": array_job_id,
        "max_concurrent": max_concurrent,
        "axes": [{"key": a.key, "values": list(a.values)} for a in axes],
        "elements": [
            {
                "index": e.index,
                "name": e.name,
                "overrides": list(e.overrides),
                "job_id": f"{array_job_id}_{e.index}",
            }
            for e in found
        ],
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(directory: Path) -> dict | None:
    """SWEEP_DIR/sweep.json, checked whole, or None when `directory` is not a sweep directory.

    `cancel` acts on it, so nothing in it may be ambiguous: every key of the format is present
    with its type, keys are not repeated, the elements are the indexes 0..N-1 of the array
    named by `array_job_id` (which SWEEP_DIR/job_id, where present, repeats), and each name is
    one folder inside the sweep directory."""
    path = directory / MANIFEST
    if not os.path.lexists(path):
        return None
    try:
        data = bounded.read_bytes(path, MANIFEST_MAX_BYTES)  # a regular file, not too long
        manifest = json.loads(data.decode("utf-8"), object_pairs_hook=_no_repeats)
        _check_manifest(manifest)
        _check_job_id_file(directory, manifest["array_job_id"])
    except bounded.UnreadableFile as err:
        raise _unreadable(path, str(err)) from None
    except OSError as err:
        raise _unreadable(path, f"cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise _unreadable(path, "it is not UTF-8 text") from None
    except (ValueError, RecursionError) as err:
        raise _unreadable(path, str(err)) from None
    return manifest


MANIFEST_MAX_BYTES = 64 * 1024 * 1024
_ARRAY_ID = re.compile(r"[0-9]{1,12}")


def _no_repeats(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"key `{repeated[0]}` is given twice")
    return dict(pairs)


def _check_manifest(manifest: object) -> None:
    """ValueError naming the key (`elements[2].job_id`) that is not what write_manifest writes."""
    _expect(isinstance(manifest, dict), "", manifest, "a JSON object")
    for key in ("format", "array_job_id", "max_concurrent", "axes", "elements"):
        if key not in manifest:
            raise ValueError(f"key `{key}` is missing")
    _expect(manifest["format"] == 1 and _int(manifest["format"]), "format", manifest, "1")
    array = manifest["array_job_id"]
    _expect(isinstance(array, str) and _ARRAY_ID.fullmatch(array), "array_job_id", manifest,
            "a job id (a string of digits)")  # fmt: skip
    limit = manifest["max_concurrent"]
    _expect(limit is None or (_int(limit) and limit >= 1), "max_concurrent", manifest,
            "null or a positive integer")  # fmt: skip
    axes = manifest["axes"]
    _expect(isinstance(axes, list) and axes, "axes", manifest, "a list of axes")
    count = 1
    for i, axis in enumerate(axes):
        where = f"axes[{i}]"
        _expect(isinstance(axis, dict) and set(axis) >= {"key", "values"}, where, axes[i],
                "an object with `key` and `values`", whole=True)  # fmt: skip
        _expect(isinstance(axis["key"], str), f"{where}.key", axis, "a string")
        values = axis["values"]
        _expect(_strings(values) and values, f"{where}.values", axis, "a list of strings")
        count *= len(values)
    elements = manifest["elements"]
    _expect(isinstance(elements, list) and elements, "elements", manifest, "a list of elements")
    if len(elements) != count:
        raise ValueError(f"`elements` has {len(elements)} entries, but the axes make {count}")
    for i, element in enumerate(elements):
        _check_element(element, i, array)


def _check_element(element: object, index: int, array: str) -> None:
    where = f"elements[{index}]"
    _expect(isinstance(element, dict), where, element, "an object", whole=True)
    for key in ("index", "name", "overrides", "job_id"):
        if key not in element:
            raise ValueError(f"key `{where}.{key}` is missing")
    _expect(_int(element["index"]) and element["index"] == index, f"{where}.index", element,
            f"{index} (its place in the list)")  # fmt: skip
    name = element["name"]
    _expect(isinstance(name, str) and _safe_name(name), f"{where}.name", element,
            "a folder name inside the sweep directory")  # fmt: skip
    _expect(_strings(element["overrides"]), f"{where}.overrides", element, "a list of strings")
    _expect(element["job_id"] == f"{array}_{index}", f"{where}.job_id", element,
            f"{array}_{index} (the array's job id and the index)")  # fmt: skip


def _check_job_id_file(directory: Path, array: str) -> None:
    """SWEEP_DIR/job_id, where present, names the same array."""
    id_file = directory / JOB_ID
    if not os.path.lexists(id_file):
        return
    try:
        text = bounded.read_bytes(id_file, 65).decode("ascii")
    except (OSError, UnicodeDecodeError):
        text = None
    if text is None or text.removesuffix("\n") != array:
        raise ValueError(
            f"the array's job id is {array}, but {id_file} does not hold exactly that; "
            "which job is the sweep's cannot be told"
        )


def _expect(ok: object, key: str, where: object, expected: str, whole: bool = False) -> None:
    if not ok:
        value = where if whole or not key else where.get(key.rsplit(".", 1)[-1])
        name = f"`{key}`" if key else "the file"
        raise ValueError(f"{name} is {short(value)}, not {expected}")


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _safe_name(name: str) -> bool:
    """One folder name: no separator, not `.` or `..`, nothing a file system refuses."""
    return (
        bool(name)
        and len(name) <= 255
        and name not in (".", "..")
        and "/" not in name
        and ("\0" not in name)
    )


def _unreadable(path: Path, why: str) -> RlflowError:
    return RlflowError(
        Diagnostic(
            "sweep.manifest",
            f"{path} is not a sweep manifest rlflow can read: {why}",
            file=str(path),
            help="`rlflow submit --sweep` writes it, and nothing acts on a sweep whose manifest "
            "is damaged: pass an element's directory or its job id (ARRAY_INDEX) instead, or "
            "restore the file",
        )
    )


def _error(message: str, help: str) -> Diagnostic:
    return Diagnostic("sweep.axis", message, file="command line", help=help)
