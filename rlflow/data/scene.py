"""Scene graphs for the synthetic tasks: objects on a grid, questions, answers computed from them.

Pure Python (no PIL): drawing lives in `rlflow.data.draw`. Scenes are generated question first:
pick a question, pick its answer uniformly, then place that many matching objects and some
distractors. A model that ignores the image cannot beat chance, and every answer is recounted
from the finished scene, never written by hand.

Shapes are flat (square, circle, triangle) rather than CLEVR's 3D cube/sphere/cylinder: a tiny
vision tower at 56-112 pixels tells flat shapes apart by their area alone. Colours are CLEVR's
eight; `COGENT` holds CLEVR-CoGenT's colour/shape conditions for a compositional split.
"""

from __future__ import annotations

import math
import random

from rlflow.errors import Diagnostic, RlflowError
from rlflow.frozen import frozen

COLORS: dict[str, tuple[int, int, int]] = {
    "gray": (128, 128, 128),
    "red": (214, 39, 40),
    "blue": (31, 90, 214),
    "green": (44, 160, 44),
    "brown": (140, 86, 35),
    "purple": (148, 62, 189),
    "cyan": (23, 190, 207),
    "yellow": (240, 200, 20),
}
SHAPES = ("square", "circle", "triangle")
SIZES = {"large": 0.8, "small": 0.5}  # object side as a fraction of its grid cell
BACKGROUND = (255, 255, 255)
MIN_CELL_PIXELS = 14  # one vision patch; smaller objects are noise to a ViT
PATCH_PIXELS = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2 into one visual token

# CLEVR-CoGenT: condition A restricts cube (square) and cylinder (triangle) colours, B swaps them;
# spheres (circles) take any colour. Train on A, validate on B to test unseen combinations.
_CUBE_A = ("gray", "blue", "brown", "yellow")
_CYLINDER_A = ("red", "green", "purple", "cyan")
COGENT: dict[str, dict[str, tuple[str, ...]]] = {
    "A": {"square": _CUBE_A, "triangle": _CYLINDER_A, "circle": tuple(COLORS)},
    "B": {"square": _CYLINDER_A, "triangle": _CUBE_A, "circle": tuple(COLORS)},
}

Combo = tuple[str, str]  # (colour, shape)


@frozen
class SceneObject:
    color: str
    shape: str
    size: str  # "large" | "small"
    cell: int  # index into the grid, row-major
    frame: int = 0  # video: the one frame the object is shown in


@frozen
class Scene:
    grid: int  # cells per side
    cell_pixels: int
    objects: tuple[SceneObject, ...]
    num_frames: int = 1


@frozen
class Query:
    """Which objects a question asks about; None matches any value."""

    color: str | None = None
    shape: str | None = None

    def matches(self, color: str, shape: str) -> bool:
        return self.color in (None, color) and self.shape in (None, shape)

    def noun(self) -> str:
        """'red squares', 'circles', 'yellow objects', 'objects'."""
        words = [self.color] if self.color else []
        words.append(f"{self.shape}s" if self.shape else "objects")
        return " ".join(words)


def count(scene: Scene, query: Query) -> int:
    return sum(query.matches(o.color, o.shape) for o in scene.objects)


def grid_for(image_size: int, max_objects: int) -> tuple[int, int]:
    """(cells per side, cell pixels): cells sit on the 28-pixel visual-token grid where they can.

    At 112 px and 4 objects that is a 4x4 grid of 28-px cells, one object per visual token;
    bigger images get bigger cells (at most twice the cells a scene needs per side).
    """
    needed = math.ceil(math.sqrt(max_objects))
    grid = max(needed, min(image_size // PATCH_PIXELS, 2 * needed))
    cell = image_size // grid
    if cell < MIN_CELL_PIXELS:
        largest = (image_size // MIN_CELL_PIXELS) ** 2
        raise RlflowError(
            Diagnostic(
                "data.scene-too-small",
                f"{max_objects} objects do not fit a {image_size}x{image_size} image "
                f"(each needs a cell of at least {MIN_CELL_PIXELS} pixels)",
                help=f"lower data.max_objects to {largest} or less, or raise data.image_size to "
                f"{MIN_CELL_PIXELS * needed} or more",
            )
        )
    return grid, cell


def allowed_combos(condition: str | None) -> list[Combo]:
    """Every (colour, shape) a scene may hold: all 24, or a CoGenT condition's subset."""
    if condition is None:
        return [(c, s) for s in SHAPES for c in COLORS]
    if condition not in COGENT:
        raise RlflowError(
            Diagnostic(
                "data.cogent-condition",
                f"CoGenT condition {condition!r} is not one of A, B",
                help="use condition='A' for training and 'B' for the unseen-combination validation",
            )
        )
    return [(c, s) for s in SHAPES for c in COGENT[condition][s]]


def sample_query(rng: random.Random, template: str, combos: list[Combo]) -> Query:
    """The question's target for a template: total | color | shape | color_shape."""
    color, shape = rng.choice(combos)
    return {
        "total": Query(),
        "color": Query(color=color),
        "shape": Query(shape=shape),
        "color_shape": Query(color=color, shape=shape),
    }[template]


def sample_counting_objects(
    rng: random.Random, query: Query, combos: list[Combo], max_objects: int
) -> list[tuple[str, str, str]]:
    """(colour, shape, size) for a scene whose answer to `query` is uniform on 1..max_objects."""
    matching = [c for c in combos if query.matches(*c)]
    others = [c for c in combos if not query.matches(*c)]
    answer = rng.randint(1, max_objects)
    total = rng.randint(answer, max_objects) if others else answer
    picks = [rng.choice(matching) for _ in range(answer)]
    picks += [rng.choice(others) for _ in range(total - answer)]
    rng.shuffle(picks)
    return [(color, shape, rng.choice(tuple(SIZES))) for color, shape in picks]


def place(
    rng: random.Random,
    attributes: list[tuple[str, str, str]],
    grid: int,
    cell_pixels: int,
    frames: list[int] | None = None,
    num_frames: int = 1,
) -> Scene:
    """Put each object in its own grid cell (never overlapping), optionally with a frame each."""
    cells = rng.sample(range(grid * grid), len(attributes))
    frames = frames if frames is not None else [0] * len(attributes)
    objects = tuple(
        SceneObject(color, shape, size, cell, frame)
        for (color, shape, size), cell, frame in zip(attributes, cells, frames, strict=True)
    )
    return Scene(grid=grid, cell_pixels=cell_pixels, objects=objects, num_frames=num_frames)


def describe(scene: Scene) -> str:
    """'a large red square, a small blue circle and a large red square' (scene order)."""
    parts = [f"a {o.size} {o.color} {o.shape}" for o in scene.objects]
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


@frozen
class SceneSpec:
    """What every synthetic row of one dataset shares (from the recipe's `data` section)."""

    image_size: int
    max_objects: int
    num_frames: int | None  # video rows only
    condition: str | None  # CoGenT "A" | "B", or None for every colour/shape combination

    @property
    def layout(self) -> tuple[int, int]:
        return grid_for(self.image_size, self.max_objects)


def counting_scene(rng: random.Random, spec: SceneSpec, template: str) -> tuple[Query, Scene]:
    """A still scene for a counting question of `template`, answer uniform on 1..max_objects."""
    combos = allowed_combos(spec.condition)
    query = sample_query(rng, template, combos)
    attributes = sample_counting_objects(rng, query, combos, spec.max_objects)
    return query, place(rng, attributes, *spec.layout)
