"""The `shapes` task: count the shapes of one colour and kind in a small generated picture ("How many red squares?").

Each row is a 64x64 RGB picture (PIL) on a white background holding 1-`max_count` shapes of the asked colour and
kind among a few distractors (other colours, the other kind), none overlapping; the prompt is one user message, the
picture comes in the `image` column (TRL's layout for vision-language data), and the answer is the count. The
picture is drawn from a description (`Scene`), so a row is reproducible from its seed and its split is decided by
the description's canonical key (grpo.tasks._common): no held-out picture appears in train.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from grpo.tasks._common import sample_rows

SIZE = 64  # pixels per side: 8x8 patches of 8 pixels for the tiny vision model (grpo/assets/tiny-vision)
CELL = 16  # shapes sit in a 4x4 grid of 16-pixel cells, one per cell, so they never overlap
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
KINDS = ("square", "circle")


@dataclass(frozen=True)
class Scene:
    """What a picture holds: (cell, colour, kind) per shape; cells index the 4x4 grid row by row."""

    shapes: tuple[tuple[int, str, str], ...]

    @property
    def key(self) -> str:
        return ";".join(f"{c}:{col}:{k}" for c, col, k in sorted(self.shapes))

    def count(self, colour: str, kind: str) -> int:
        return sum(1 for _, col, k in self.shapes if col == colour and k == kind)


def draw(scene: Scene):
    """The scene as a 64x64 RGB PIL image: squares 10 pixels wide, circles 10 pixels across, centred in cells."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for cell, colour, kind in scene.shapes:
        x, y = (cell % 4) * CELL + 3, (cell // 4) * CELL + 3
        box = (x, y, x + 9, y + 9)
        (pen.rectangle if kind == "square" else pen.ellipse)(box, fill=COLOURS[colour])
    return image


def random_scene(rng: random.Random, max_count: int, distractors: int) -> tuple[Scene, str, str]:
    """A scene with 1..max_count shapes of a drawn (colour, kind) and up to `distractors` others."""
    colour, kind = rng.choice(sorted(COLOURS)), rng.choice(KINDS)
    cells = rng.sample(range(16), max_count + distractors)
    n = rng.randint(1, max_count)
    others = [(c, k) for c in sorted(COLOURS) for k in KINDS if (c, k) != (colour, kind)]
    shapes = [(cell, colour, kind) for cell in cells[:n]]
    shapes += [(cell, *rng.choice(others)) for cell in cells[n:n + rng.randint(0, distractors)]]
    return Scene(tuple(shapes)), colour, kind


def question(colour: str, kind: str) -> str:
    return f"How many {colour} {kind}s?"


def rows(split: str, n: int, seed: int, max_count: int = 4, distractors: int = 3) -> list[dict]:
    """`n` rows of `split`: {"prompt": [user message], "image": PIL image, "answer": count as text}."""
    if not 1 <= max_count <= 9 or not 0 <= distractors <= 16 - max_count:
        raise ValueError(f"shapes: max_count must be 1..9 and distractors 0..{16 - max_count} "
                         f"(got {max_count}, {distractors})")

    def one(rng: random.Random) -> tuple[str, dict]:
        scene, colour, kind = random_scene(rng, max_count, distractors)
        text = question(colour, kind)
        return f"{scene.key}|{text}", {"prompt": [{"role": "user", "content": text}], "image": draw(scene),
                                       "answer": str(scene.count(colour, kind))}

    return sample_rows("shapes", split, n, seed, one)
