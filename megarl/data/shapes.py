"""Synthetic vision tasks built offline over small images of coloured shapes: `count` ("How many red squares?") and
`colour` ("What colour is the shape?").

Each image is a grid of cells (cell_pixels square); some cells hold a red square, others a distractor (a blue square
or a red plus, same colour or same shape as the target), the rest are white. The answer is the number of red
squares, 0..max_count. The `colour` task draws one large square (all but a half-cell border) in red, green or
blue, answered R, G or B: its colour is a linear function of the pixels, which even a tiny random tower carries.
`blank=True` writes the same prompts and answers with all-white images: the image-ablation
control (a policy that learns the task from the images cannot learn it from these).

write_shapes_prompts(out_dir, rows, seed) writes out_dir/prompts.jsonl (megarl/data/images.py's row layout: an
`<image>` marker in the prompt, the image file beside it) and the PNG files. `python -m megarl.data.shapes OUT` writes
the splits configs/quickstart_vl.yaml reads (write_shapes_splits).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WHITE, RED, GREEN, BLUE = (255, 255, 255), (220, 30, 30), (30, 160, 50), (30, 60, 220)
QUESTIONS = {"count": "<image>How many red squares? Answer with one digit.",
             "colour": "<image>What colour is the shape? Answer R, G or B."}
COLOURS = {"R": RED, "G": GREEN, "B": BLUE}  # the colour task's answers and their fills


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


def draw_colour(answer: str, grid: int, cell_pixels: int):
    """A PIL image of one large square in the answer's colour, a half-cell white border around it."""
    from PIL import Image, ImageDraw

    side = grid * cell_pixels
    image = Image.new("RGB", (side, side), WHITE)
    border = cell_pixels // 2
    ImageDraw.Draw(image).rectangle([border, border, side - 1 - border, side - 1 - border], fill=COLOURS[answer])
    return image


def write_shapes_prompts(out_dir: str | Path, rows: int, seed: int, grid: int = 3, cell_pixels: int = 8,
                         max_count: int = 3, blank: bool = False, task: str = "count") -> Path:
    """out_dir/prompts.jsonl and its images (`task`: count or colour); returns the prompt file's path."""
    if task not in QUESTIONS:
        raise ValueError(f"shapes task {task!r}: expected one of {sorted(QUESTIONS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    records = []
    for row in range(rows):
        name = f"image_{row:05d}.png"
        if task == "colour":
            answer = rng.choice(sorted(COLOURS))
            image = draw_colour(answer, grid, cell_pixels)
        else:
            cells, count = shape_cells(rng, grid, max_count)
            answer, image = str(count), draw_cells(cells, grid, cell_pixels)
        if blank:
            image = draw_cells(["empty"] * grid * grid, grid, cell_pixels)
        image.save(out_dir / name)
        records.append({"prompt": QUESTIONS[task], "images": [name], "answer": answer})
    path = out_dir / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


SPLITS = {"train": 1, "val": 2}  # split -> seed offset: the held-out images are drawn apart from the training ones


def write_shapes_splits(out_dir: str | Path, train_rows: int = 512, val_rows: int = 128, seed: int = 0,
                        max_count: int = 3, task: str = "count") -> dict:
    """out_dir/{train,val}/prompts.jsonl and their blank-image twins out_dir/{train,val}_blank/ (the same prompts and
    answers); returns {split name: prompt file}. Every prompt has the same text, so the held-out split is a file of
    its own (data.val_task), not a hash split of one file."""
    rows = {"train": train_rows, "val": val_rows}
    return {f"{split}{'_blank' if blank else ''}": write_shapes_prompts(
                Path(out_dir) / f"{split}{'_blank' if blank else ''}", rows[split], seed * 10 + offset,
                max_count=max_count, blank=blank, task=task)
            for split, offset in SPLITS.items() for blank in (False, True)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the shapes prompt files (and blank twins).")
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=512, help="training rows")
    parser.add_argument("--val", type=int, default=128, help="held-out rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-count", type=int, default=3, help="answers are 0..max-count red squares")
    parser.add_argument("--task", choices=sorted(QUESTIONS), default="count",
                        help="count: how many red squares; colour: the colour of one large square")
    args = parser.parse_args(argv)
    for split, path in write_shapes_splits(args.out_dir, args.train, args.val, args.seed, args.max_count,
                                           args.task).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
