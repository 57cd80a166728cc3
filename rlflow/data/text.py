"""Text-only counting: the scene is described in words, the question and answer are CLEVR's.

These rows have no media at all; in a mixed batch they check that the trainer handles rows
without images beside rows with them, and they are learnable from the text alone.
"""

from __future__ import annotations

import random

from rlflow.data.clevr import TEMPLATES
from rlflow.data.sample import Sample
from rlflow.data.scene import SceneSpec, count, counting_scene, describe


def make_text_row(rng: random.Random, row_id: str, spec: SceneSpec) -> Sample:
    template = rng.choice(TEMPLATES)
    query, scene = counting_scene(rng, spec, template)
    return Sample(
        id=row_id,
        media="text",
        question=f"A picture shows {describe(scene)}. How many {query.noun()} are there?",
        answer=str(count(scene, query)),
        kind="text",
        template=template,
        scene=scene,
    )
