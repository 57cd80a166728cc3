"""CLEVR-style counting on rendered images: "How many red squares are there?" -> "2"."""

from __future__ import annotations

import random

from rlflow.data.draw import render
from rlflow.data.sample import Sample
from rlflow.data.scene import SceneSpec, count, counting_scene

TEMPLATES = ("total", "color", "shape", "color_shape")


def make_clevr_row(rng: random.Random, row_id: str, spec: SceneSpec) -> Sample:
    template = rng.choice(TEMPLATES)
    query, scene = counting_scene(rng, spec, template)
    return Sample(
        id=row_id,
        media="image",
        question=f"How many {query.noun()} are there?",
        answer=str(count(scene, query)),
        images=(render(scene, spec.image_size),),
        kind="clevr",
        template=template,
        scene=scene,
    )
