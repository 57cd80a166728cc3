"""Scene graph -> PIL image: flat, solid shapes centred in their grid cells on a white ground.

No anti-aliasing and no jitter on purpose: colours stay exact (tests read them back from the
pixels) and each object stays inside its cell, on the vision tower's patch grid.
"""

from __future__ import annotations

from PIL import Image, ImageDraw

from rlflow.data.scene import BACKGROUND, COLORS, SIZES, Scene, SceneObject


def render(scene: Scene, image_size: int, frame: int | None = None) -> Image.Image:
    """The scene as an RGB image; with `frame`, only the objects shown in that frame."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for obj in scene.objects:
        if frame is None or obj.frame == frame:
            _draw_object(pen, obj, scene.grid, scene.cell_pixels)
    return image


def object_box(obj: SceneObject, grid: int, cell_pixels: int) -> tuple[int, int, int, int]:
    """Inclusive pixel box (x0, y0, x1, y1) of an object: a square centred in its cell."""
    row, col = divmod(obj.cell, grid)
    side = max(int(round(cell_pixels * SIZES[obj.size])), 4)
    x0 = col * cell_pixels + (cell_pixels - side) // 2
    y0 = row * cell_pixels + (cell_pixels - side) // 2
    return x0, y0, x0 + side - 1, y0 + side - 1


def _draw_object(pen: ImageDraw.ImageDraw, obj: SceneObject, grid: int, cell_pixels: int) -> None:
    x0, y0, x1, y1 = box = object_box(obj, grid, cell_pixels)
    fill = COLORS[obj.color]
    if obj.shape == "square":
        pen.rectangle(box, fill=fill)
    elif obj.shape == "circle":
        pen.ellipse(box, fill=fill)
    elif obj.shape == "triangle":
        pen.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    else:
        raise AssertionError(f"unknown shape {obj.shape!r}")
