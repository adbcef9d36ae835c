"""Regenerate the committed sample dataset in data/sample/ (8 geometry diagrams drawn with PIL).

The diagrams are built into a ``datasets.DatasetDict`` shaped like ``hiyouga/geometry3k`` (images / problem /
answer, ``<image>`` tag in the problem) and converted by ``prepare_data.py``'s own ``convert``, so the
sample is exactly what prepare_data writes. Image paths are relative to the repository root, where training
and the tests run. Every answer follows from the numbers drawn in the figure.
Does not cover: converting real datasets (prepare_data.py does).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

import datasets
from PIL import Image, ImageDraw, ImageFont

from openrlhf_lora_sync import REPO_ROOT
from openrlhf_lora_sync.tools.prepare_data import convert

SIZE = 224
FONT = ImageFont.load_default(size=18)
Point = tuple[float, float]


def canvas() -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("L", (SIZE, SIZE), 255)
    return image, ImageDraw.Draw(image)


def label(draw: ImageDraw.ImageDraw, at: Point, text: str) -> None:
    draw.text(at, text, fill=0, font=FONT, anchor="mm")


def polygon(draw: ImageDraw.ImageDraw, points: list[Point]) -> None:
    draw.line([*points, points[0]], fill=0, width=3)


def right_angle_mark(draw: ImageDraw.ImageDraw, corner: Point, toward_a: Point, toward_b: Point) -> None:
    def step(target: Point) -> Point:
        length = math.dist(corner, target)
        return ((target[0] - corner[0]) * 14 / length, (target[1] - corner[1]) * 14 / length)

    (ax, ay), (bx, by) = step(toward_a), step(toward_b)
    x, y = corner
    draw.line([(x + ax, y + ay), (x + ax + bx, y + ay + by), (x + bx, y + by)], fill=0, width=2)


def right_triangle(vertical: int, horizontal: int) -> Image.Image:
    """Legs drawn to scale and labelled with their lengths; the hypotenuse is labelled x."""
    image, draw = canvas()
    scale = 144 / max(vertical, horizontal)
    corner = (40, 184)
    top, right = (40, 184 - vertical * scale), (40 + horizontal * scale, 184)
    polygon(draw, [corner, top, right])
    right_angle_mark(draw, corner, top, right)
    label(draw, (22, (top[1] + corner[1]) / 2), str(vertical))
    label(draw, ((corner[0] + right[0]) / 2, 202), str(horizontal))
    label(draw, ((top[0] + right[0]) / 2 + 14, (top[1] + right[1]) / 2 - 10), "x")
    return image


def circle(segment: str, length: int) -> Image.Image:
    """A circle with its radius or diameter drawn and labelled."""
    image, draw = canvas()
    draw.ellipse([32, 32, 192, 192], outline=0, width=3)
    draw.ellipse([108, 108, 116, 116], fill=0)
    start = (32, 112) if segment == "diameter" else (112, 112)
    draw.line([start, (192, 112)], fill=0, width=2)
    label(draw, ((start[0] + 192) / 2, 98), str(length))
    return image


def rectangle(width: int, height: int) -> Image.Image:
    """Drawn to scale, right angles marked, sides labelled."""
    image, draw = canvas()
    scale = 140 / max(width, height)
    left, top = 42, 42
    right, bottom = left + width * scale, top + height * scale
    polygon(draw, [(left, top), (right, top), (right, bottom), (left, bottom)])
    right_angle_mark(draw, (left, top), (right, top), (left, bottom))
    right_angle_mark(draw, (right, bottom), (left, bottom), (right, top))
    label(draw, ((left + right) / 2, bottom + 16), str(width))
    label(draw, (right + 16, (top + bottom) / 2), str(height))
    return image


def triangle_angles(left_degrees: int, right_degrees: int) -> Image.Image:
    """Base angles drawn to size and labelled; the apex angle is labelled x°."""
    image, draw = canvas()
    left, right = (30, 184), (194, 184)
    left_tan, right_tan = (math.tan(math.radians(angle)) for angle in (left_degrees, right_degrees))
    apex_dx = (right[0] - left[0]) * right_tan / (left_tan + right_tan)
    apex = (left[0] + apex_dx, left[1] - apex_dx * left_tan)
    polygon(draw, [left, right, apex])
    label(draw, (left[0] + 34, left[1] - 12), f"{left_degrees}°")
    label(draw, (right[0] - 30, right[1] - 12), f"{right_degrees}°")
    label(draw, (apex[0], apex[1] + 30), "x°")
    return image


def equilateral_with_height(side: int) -> Image.Image:
    """Equilateral triangle, both slanted sides labelled, its height drawn and labelled h."""
    image, draw = canvas()
    left, right = (32, 184), (192, 184)
    apex = (112, 184 - 160 * math.sqrt(3) / 2)
    polygon(draw, [left, right, apex])
    draw.line([apex, (112, 184)], fill=0, width=2)
    right_angle_mark(draw, (112, 184), apex, right)
    label(draw, (60, 110), str(side))
    label(draw, (164, 110), str(side))
    label(draw, (124, 150), "h")
    return image


def sample_rows() -> dict[str, list[tuple[Image.Image, str, str]]]:
    """(image, problem, answer) per split, written the way geometry3k writes them."""
    return {
        "train": [
            (right_triangle(3, 4), "<image>Find x.", "5"),
            (circle("radius", 7), "<image>Find the circumference of the circle.", "14\\pi"),
            (rectangle(8, 6), "<image>Find the area of the rectangle.", "48"),
            (triangle_angles(50, 60), "<image>Find x.", "70"),
            (rectangle(9, 9), "<image>The quadrilateral is a square. Find its perimeter.", "36"),
            (equilateral_with_height(6), "<image>The triangle is equilateral. Find h.", "3\\sqrt{3}"),
        ],
        "test": [
            (circle("diameter", 10), "<image>Find the area of the circle.", "25\\pi"),
            (right_triangle(5, 5), "<image>Find x.", "5\\sqrt{2}"),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--output-dir", type=Path, default=REPO_ROOT / "data" / "sample", help="(default: %(default)s)"
    )
    args = parser.parse_args(argv)

    source = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {
                    "images": [[image] for image, _, _ in rows],
                    "problem": [problem for _, problem, _ in rows],
                    "answer": [answer for _, _, answer in rows],
                }
            )
            for split, rows in sample_rows().items()
        }
    )
    shutil.rmtree(args.output_dir / "images", ignore_errors=True)
    summaries = convert(source, args.output_dir, datasource="sample", relative_to=REPO_ROOT)
    for split, summary in summaries.items():
        print(f"{split}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
