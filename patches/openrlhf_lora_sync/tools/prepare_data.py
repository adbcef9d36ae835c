"""Convert an image + question + answer dataset into OpenRLHF 0.11.2's VLM prompt format (JSONL + PNG files).

Input (``--dataset``): a hub dataset name (default ``hiyouga/geometry3k``, columns images/problem/answer;
needs network access), a directory written by ``save_to_disk``, a directory of parquet files (splits named
from the file names the way ``datasets`` does it: ``train-*.parquet``, ``test-*.parquet``, ...), or a single
parquet file (split ``train``). The image column may hold one image or a list of images, as encoded images
or file paths.

Output, per split: ``OUTPUT_DIR/SPLIT.jsonl`` and ``OUTPUT_DIR/images/SPLIT/ROW-K.png``, one JSON row each::

    {"prompt": [{"role": "user",
                 "content": [{"type": "image"}, {"type": "text", "text": "QUESTION\\n\\nINSTRUCTION"}]}],
     "images": ["/abs/OUTPUT_DIR/images/train/000000-0.png"], "label": "ANSWER", "datasource": "geometry3k"}

The image items come first, one per image, with the question's ``<image>`` tags removed; INSTRUCTION is
``rewards.math_answer.PROMPT_INSTRUCTIONS[--answer-format]`` (choices and default: the setting
``reward.answer_format`` in openrlhf_lora_sync.base.settings), so run the reward with the same
``REWARD_ANSWER_FORMAT``. The default ``--output-dir`` is ``data/geometry3k`` in the checkout, where the
recipes' ``data.prompt_dataset`` points. ``--for-recipe RECIPE`` is scripts/run_grpo_lora.sh's step: it
converts the recipe's ``data.source`` (default: the hub's geometry3k; a local copy offline) into the
directory of each dataset the run names that is missing there (SPLIT.jsonl in a folder with no JSONL yet),
image paths relative to the repository root, and says so in one line (or, when the source cannot be read,
one line naming ``data.source=PATH``). Train with::

    --data.prompt_dataset OUTPUT_DIR/train.jsonl --data.input_key prompt --data.label_key label
    --data.image_key images --data.apply_chat_template --data.max_images_per_prompt N
    --eval.dataset OUTPUT_DIR/test.jsonl

OpenRLHF's PromptDataset renders ``prompt`` with the processor's chat template (each image item becomes the
model's image placeholder) and hands ``images`` to ``openrlhf.utils.vlm_utils.load_images``, which opens each
path relative to the vLLM actor's working directory. Paths are therefore absolute unless ``--relative-to DIR``
is given (the committed ``data/sample`` is written relative to the repository root: train from there).

Rows with no image, more images than ``--max-images-per-prompt`` (default: the recipes'
``data.max_images_per_prompt``, read from recipes/base.yaml; train with the same N, vLLM refuses a prompt
with more images mid-run), an image that cannot be decoded, an empty question or an empty answer are
skipped and counted; a summary per split is printed, plus a line naming the fix when rows were over the
image limit. Not covered: videos, multi-turn prompts, interleaving text between several images, and
multiple-choice options (the answer column is used as the label as it is).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from PIL import Image
from tqdm import tqdm

from openrlhf_lora_sync import REPO_ROOT
from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.config import preflight
from openrlhf_lora_sync.config.recipe import RECIPES_DIR, RecipeError, Run, load_recipe, load_run
from rewards.math_answer import PROMPT_INSTRUCTIONS

IMAGE_TAG = "<image>"
IMAGE_LIMIT_KEY = "data.max_images_per_prompt"
ANSWER_FORMAT = settings.get("reward.answer_format")


def recipe_image_limit() -> int:
    """The image limit every recipe trains with: recipes/base.yaml's data.max_images_per_prompt."""
    return load_recipe(RECIPES_DIR / "base.yaml")[IMAGE_LIMIT_KEY]


@dataclass
class SplitSummary:
    written: int = 0
    skipped: Counter = field(default_factory=Counter)

    def __str__(self) -> str:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.skipped.items()))
        skipped = f"skipped {sum(self.skipped.values())}" + (f" ({reasons})" if reasons else "")
        return f"wrote {self.written} rows, {skipped}"


@dataclass(frozen=True)
class Columns:
    image: str = "images"
    question: str = "problem"
    answer: str = "answer"


class SkipRow(Exception):
    """A row that cannot become a training prompt; the message is the reason it is counted under."""


def load_source(dataset: str) -> datasets.DatasetDict:
    """The dataset as a DatasetDict, from a save_to_disk directory, parquet files, or the hub."""
    path = Path(dataset)
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        loaded = datasets.load_from_disk(str(path))
    elif path.is_file():
        loaded = datasets.load_dataset("parquet", data_files={"train": str(path)})
    else:
        # A local folder of data files, or a hub name.
        loaded = datasets.load_dataset(dataset)
    return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})


def without_image_decoding(split: datasets.Dataset, image_column: str) -> datasets.Dataset:
    """Keep images as raw bytes/paths, so one corrupt image skips its row instead of failing the iteration."""
    feature = split.features[image_column]
    if isinstance(feature, datasets.Image):
        return split.cast_column(image_column, datasets.Image(decode=False))
    if isinstance(feature, datasets.List) and isinstance(feature.feature, datasets.Image):
        return split.cast_column(image_column, datasets.List(datasets.Image(decode=False)))
    return split


def open_image(reference: object) -> Image.Image:
    """Decode one image given as {"bytes", "path"}, bytes, a file path, or a PIL image; RGB on white."""
    if isinstance(reference, dict):
        reference = reference.get("bytes") or reference.get("path")
    if isinstance(reference, bytes):
        image = Image.open(io.BytesIO(reference))
    elif isinstance(reference, (str, os.PathLike)):
        image = Image.open(reference)
    elif isinstance(reference, Image.Image):
        image = reference
    else:
        raise SkipRow("missing_image")
    image.load()  # decoding is lazy; force it so a truncated file fails here
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        # Geometry diagrams are often line art on transparent background: keep it visible.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, "white")
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def build_row(
    example: dict,
    index: int,
    *,
    split_name: str,
    output_dir: Path,
    columns: Columns,
    instruction: str,
    datasource: str,
    relative_to: Path | None,
    max_images: int,
) -> dict:
    """One OpenRLHF prompt row; writes its images. Raises SkipRow for rows that cannot be used."""
    label = example.get(columns.answer)
    label = "" if label is None else str(label).strip()
    if not label:
        raise SkipRow("empty_label")
    question = (example.get(columns.question) or "").replace(IMAGE_TAG, "").strip()
    if not question:
        raise SkipRow("empty_question")
    references = preflight.image_references(example, columns.image)
    if not references:
        raise SkipRow("missing_image")
    if len(references) > max_images:
        raise SkipRow("too_many_images")
    try:
        images = [open_image(reference) for reference in references]
    except SkipRow:
        raise
    except Exception as error:  # PIL raises many types for corrupt data (OSError, SyntaxError, ValueError...)
        raise SkipRow("unreadable_image") from error

    image_paths = []
    image_dir = output_dir / "images" / split_name
    image_dir.mkdir(parents=True, exist_ok=True)
    for position, image in enumerate(images):
        image_path = (image_dir / f"{index:06d}-{position}.png").resolve()
        image.save(image_path, format="PNG")
        image_paths.append(os.path.relpath(image_path, relative_to) if relative_to else str(image_path))

    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"{question}\n\n{instruction}"}]
    return {
        "prompt": [{"role": "user", "content": content}],
        "images": image_paths,
        "label": label,
        "datasource": datasource,
    }


def convert(
    source: datasets.DatasetDict,
    output_dir: Path,
    *,
    columns: Columns = Columns(),
    answer_format: str = "boxed",
    splits: list[str] | None = None,
    datasource: str = "default",
    relative_to: Path | None = None,
    max_rows: int | None = None,
    max_images_per_prompt: int | None = None,
) -> dict[str, SplitSummary]:
    """Write OUTPUT_DIR/SPLIT.jsonl and its images for each split; returns what was written and skipped.

    Rows with more than ``max_images_per_prompt`` images (default: ``recipe_image_limit()``) are skipped."""
    max_images = recipe_image_limit() if max_images_per_prompt is None else max_images_per_prompt
    output_dir = output_dir.resolve()
    relative_to = relative_to.resolve() if relative_to else None
    summaries = {}
    for split_name in splits or list(source):
        split = source[split_name]
        for column in (columns.image, columns.question, columns.answer):
            if column not in split.column_names:
                raise SystemExit(f"split {split_name!r} has no column {column!r} (has {split.column_names})")
        if max_rows is not None:
            split = split.select(range(min(max_rows, len(split))))
        split = without_image_decoding(split, columns.image)

        summary = SplitSummary()
        output_dir.mkdir(parents=True, exist_ok=True)
        with open(output_dir / f"{split_name}.jsonl", "w", encoding="utf-8") as jsonl:
            for index, example in enumerate(tqdm(split, desc=split_name, unit="row")):
                try:
                    row = build_row(
                        example,
                        index,
                        split_name=split_name,
                        output_dir=output_dir,
                        columns=columns,
                        instruction=PROMPT_INSTRUCTIONS[answer_format],
                        datasource=datasource,
                        relative_to=relative_to,
                        max_images=max_images,
                    )
                except SkipRow as reason:
                    summary.skipped[str(reason)] += 1
                    continue
                jsonl.write(json.dumps(row, ensure_ascii=False) + "\n")
                summary.written += 1
        summaries[split_name] = summary
    return summaries


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Convert an image+question+answer dataset to OpenRLHF VLM prompt JSONL with PNG images."
    )
    parser.add_argument(
        "--dataset",
        default="hiyouga/geometry3k",
        help="hub name, save_to_disk directory, directory of parquet files, or one parquet file "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=REPO_ROOT / "data" / "geometry3k", help="(default: %(default)s)"
    )
    parser.add_argument("--splits", nargs="+", help="splits to convert (default: all)")
    parser.add_argument("--image-column", default="images", help="(default: %(default)s)")
    parser.add_argument("--question-column", default="problem", help="(default: %(default)s)")
    parser.add_argument("--answer-column", default="answer", help="(default: %(default)s)")
    parser.add_argument(
        "--answer-format",
        choices=ANSWER_FORMAT.choices,
        default=ANSWER_FORMAT.default,
        help=f"answer format the prompt asks for; must match the reward's {ANSWER_FORMAT.env} "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--datasource", help="datasource field of every row (default: the dataset's base name, no extension)"
    )
    parser.add_argument(
        "--relative-to",
        type=Path,
        help="write image paths relative to this directory, then train from it (default: absolute paths)",
    )
    parser.add_argument(
        "--max-rows", type=int, help="convert at most this many rows per split (default: all)"
    )
    parser.add_argument(
        "--for-recipe",
        metavar="RECIPE",
        help="prepare what this run's data needs, only where it is missing (scripts/run_grpo_lora.sh's "
        "step; the source is the recipe's data.source; the other flags are ignored)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --for-recipe")
    parser.add_argument(
        "--max-images-per-prompt",
        type=positive_int,
        default=recipe_image_limit(),
        help=f"skip rows with more images than this; train with the same {IMAGE_LIMIT_KEY} "
        "(default: %(default)s, the recipes' value)",
    )
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def prepare(argv: list[str] | None = None) -> dict[str, SplitSummary]:
    """Converts what the command line names; prints a summary per split; returns the summaries."""
    args = parse_args(argv)
    summaries = convert(
        load_source(args.dataset),
        args.output_dir,
        columns=Columns(args.image_column, args.question_column, args.answer_column),
        answer_format=args.answer_format,
        splits=args.splits,
        datasource=args.datasource or Path(args.dataset.rstrip("/")).stem,
        relative_to=args.relative_to,
        max_rows=args.max_rows,
        max_images_per_prompt=args.max_images_per_prompt,
    )
    for split_name, summary in summaries.items():
        print(f"{split_name}: {summary} -> {args.output_dir / f'{split_name}.jsonl'}")
    over_limit = sum(summary.skipped["too_many_images"] for summary in summaries.values())
    if over_limit:
        print(
            f"{over_limit} row(s) had more than {args.max_images_per_prompt} image(s); to keep them, raise "
            f"--max-images-per-prompt and train with the same {IMAGE_LIMIT_KEY}",
            file=sys.stderr,
        )
    return summaries


def missing_outputs(run: Run, workdir: Path = REPO_ROOT) -> dict[Path, list[Path]]:
    """The run's datasets (data.prompt_dataset, eval.dataset) this converter would write and that do not
    exist, by output directory: SPLIT.jsonl files missing from a directory that holds no .jsonl yet (a
    fresh location, not a typo in a folder of data someone made)."""
    sources = [run.args.data.prompt_dataset, run.args.eval.dataset]
    paths = [workdir / part.partition("@")[0].strip() for s in sources if s for part in s.split(",")]
    missing: dict[Path, list[Path]] = {}
    for path in paths:
        if path.suffix == ".jsonl" and not path.exists() and not any(path.parent.glob("*.jsonl")):
            missing.setdefault(path.parent, []).append(path)
    return missing


def prepare_for_run(recipe: str, sets: list[str]) -> int:
    """Converts the run's data.source into each missing output directory (missing_outputs), with the run's
    answer format and image limit; 0 when nothing was missing or it was written, 2 (one line) when the
    source cannot be read or lacks a split the run names."""
    try:
        run = load_run(recipe, sets)
    except RecipeError as error:
        print("\n".join(f"prepare_data: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    source = run.setting("data.source")
    for output_dir, paths in missing_outputs(run).items():
        names = ", ".join(str(path) for path in paths)
        print(
            f"prepare_data: {names} missing: converting {source} (data.source) into {output_dir}",
            file=sys.stderr,
        )
        try:
            loaded = load_source(source)
        except Exception as error:  # the hub out of reach, or a local copy `datasets` cannot read
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            print(
                f"prepare_data: cannot read {source} ({type(error).__name__}: {reason}); offline, copy the "
                "dataset here and give its path: data.source=PATH (a parquet file or folder, a save_to_disk "
                "folder), or run python scripts/prepare_data.py --dataset PATH",
                file=sys.stderr,
            )
            return 2
        lacking = [path.stem for path in paths if path.stem not in loaded]
        if lacking:
            print(
                f"prepare_data: {source} has no split {', '.join(lacking)} (it has {', '.join(loaded)}): "
                "point data.prompt_dataset / eval.dataset at SPLIT.jsonl of one it has",
                file=sys.stderr,
            )
            return 2
        summaries = convert(
            loaded,
            output_dir,
            answer_format=run.setting("reward.answer_format"),
            splits=[path.stem for path in paths],
            datasource=Path(source.rstrip("/")).stem,
            relative_to=REPO_ROOT,  # the launcher's directory: opens in the actors here and in Docker
            max_images_per_prompt=run.args.data.max_images_per_prompt or None,  # 0: a text run, the default
        )
        for split_name, summary in summaries.items():
            print(f"prepare_data: {split_name}: {summary}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.for_recipe:
        return prepare_for_run(args.for_recipe, args.set)
    prepare(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
