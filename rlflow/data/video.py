"""Synthetic video: objects flash one frame each; count them over the clip or name the frame.

Each object is drawn in exactly one frame, so no single frame holds the answer: counting needs
every frame, and "In which frame does the red square appear?" needs their order.
"""

from __future__ import annotations

import random

from rlflow.data.draw import render
from rlflow.data.sample import Sample
from rlflow.data.scene import (
    SIZES,
    Query,
    Scene,
    SceneSpec,
    allowed_combos,
    count,
    place,
    sample_counting_objects,
    sample_query,
)

TEMPLATES = ("total", "color", "frame")


def make_video_row(rng: random.Random, row_id: str, spec: SceneSpec) -> Sample:
    assert spec.num_frames, "build_dataset checks data.video.num_frames for video rows"
    template = rng.choice(TEMPLATES)
    if template == "frame":
        query, scene = _frame_scene(rng, spec)
        question = (
            f"The video has {spec.num_frames} frames, numbered from 1. "
            f"In which frame does the {query.color} {query.shape} appear?"
        )
        answer = str(frame_of(scene, query) + 1)
    else:
        query, scene = _counting_clip(rng, spec, template)
        question = f"How many {query.noun()} appear in the video?"
        answer = str(count(scene, query))
    frames = tuple(render(scene, spec.image_size, frame=t) for t in range(spec.num_frames))
    return Sample(
        id=row_id,
        media="video",
        question=question,
        answer=answer,
        video=frames,
        kind="video",
        template=template,
        scene=scene,
    )


def frame_of(scene: Scene, query: Query) -> int:
    """The frame of the one object matching `query` (frame questions target a unique object)."""
    (frame,) = [o.frame for o in scene.objects if query.matches(o.color, o.shape)]
    return frame


def _counting_clip(rng: random.Random, spec: SceneSpec, template: str) -> tuple[Query, Scene]:
    combos = allowed_combos(spec.condition)
    query = sample_query(rng, template, combos)
    attributes = sample_counting_objects(rng, query, combos, spec.max_objects)
    frames = [rng.randrange(spec.num_frames) for _ in attributes]
    return query, place(rng, attributes, *spec.layout, frames=frames, num_frames=spec.num_frames)


def _frame_scene(rng: random.Random, spec: SceneSpec) -> tuple[Query, Scene]:
    combos = allowed_combos(spec.condition)
    color, shape = target = rng.choice(combos)
    others = [c for c in combos if c != target]
    picks = [target] + [rng.choice(others) for _ in range(rng.randint(0, spec.max_objects - 1))]
    attributes = [(c, s, rng.choice(tuple(SIZES))) for c, s in picks]
    frames = [rng.randrange(spec.num_frames) for _ in attributes]
    scene = place(rng, attributes, *spec.layout, frames=frames, num_frames=spec.num_frames)
    return Query(color=color, shape=shape), scene
