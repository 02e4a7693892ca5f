"""A synthetic vision task built offline: "How many red squares?" over small images of coloured shapes.

Each image is a grid of cells (cell_pixels square); some cells hold a red square, others a distractor (a blue square
or a red plus, same colour or same shape as the target), the rest are white. The answer is the number of red
squares, 0..max_count. `blank=True` writes the same prompts and answers with all-white images: the image-ablation
control (a policy that learns the task from the images cannot learn it from these).

write_shapes_prompts(out_dir, rows, seed) writes out_dir/prompts.jsonl (megarl/data/images.py's row layout: an
`<image>` marker in the prompt, the image file beside it) and the PNG files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WHITE, RED, BLUE = (255, 255, 255), (220, 30, 30), (30, 60, 220)
QUESTION = "<image>How many red squares? Answer with one digit."


def draw_cells(cells: list[str], grid: int, cell_pixels: int):
    """A PIL image of grid x grid cells, row-major: 'red_square', 'blue_square', 'red_plus' or 'empty'."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (grid * cell_pixels, grid * cell_pixels), WHITE)
    draw = ImageDraw.Draw(image)
    margin, last = cell_pixels // 4, cell_pixels - 1 - cell_pixels // 4
    for index, kind in enumerate(cells):
        x, y = (index % grid) * cell_pixels, (index // grid) * cell_pixels
        if kind in ("red_square", "blue_square"):
            draw.rectangle([x + margin, y + margin, x + last, y + last], fill=RED if kind == "red_square" else BLUE)
        elif kind == "red_plus":
            middle = cell_pixels // 2
            draw.line([x + margin, y + middle, x + last, y + middle], fill=RED)
            draw.line([x + middle, y + margin, x + middle, y + last], fill=RED)
    return image


def shape_cells(rng: random.Random, grid: int, max_count: int) -> tuple[list[str], int]:
    """One image's cells and its answer: 0..max_count red squares and up to two distractors, at random cells."""
    count = rng.randint(0, max_count)
    distractors = [rng.choice(["blue_square", "red_plus"]) for _ in range(rng.randint(0, 2))]
    kinds = ["red_square"] * count + distractors
    cells = ["empty"] * (grid * grid)
    for kind, index in zip(kinds, rng.sample(range(grid * grid), len(kinds))):
        cells[index] = kind
    return cells, count


def write_shapes_prompts(out_dir: str | Path, rows: int, seed: int, grid: int = 3, cell_pixels: int = 8,
                         max_count: int = 3, blank: bool = False) -> Path:
    """out_dir/prompts.jsonl and its images; returns the prompt file's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    records = []
    for row in range(rows):
        cells, count = shape_cells(rng, grid, max_count)
        name = f"image_{row:05d}.png"
        draw_cells(["empty"] * len(cells) if blank else cells, grid, cell_pixels).save(out_dir / name)
        records.append({"prompt": QUESTION, "images": [name], "answer": str(count)})
    path = out_dir / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
