"""Tests for scripts/prepare_data.py and the committed data/sample, read back with OpenRLHF 0.11.2's own code.

Source datasets are built in the test with ``datasets`` and PIL and stored the three ways prepare_data reads
them offline (save_to_disk, a folder of parquet files, one parquet file). The output is loaded with
OpenRLHF's ``blending_datasets`` + ``PromptDataset`` and a tiny Qwen2.5-VL processor (conftest's
``tiny_model_dir``), tokenized with images by ``process_prompt_with_images``, and for the sample also rolled
out through ``SingleTurnAgentExecutor`` with the math reward. No network: the hub is switched off.
"""

import asyncio
import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.tools import prepare_data
from PIL import Image, ImageDraw

from rewards.math_answer import PROMPT_INSTRUCTIONS

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DIR = REPO_ROOT / "data" / "sample"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def diagram(mode: str = "RGB", size: tuple[int, int] = (96, 64)) -> Image.Image:
    image = Image.new(mode, size, "white" if mode == "RGB" else (0, 0, 0, 0))
    ImageDraw.Draw(image).polygon([(8, 56), (88, 56), (8, 8)], outline="black")
    return image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# Source rows: (images, problem, answer, what happens to the row).
TRAIN_ROWS = [
    ([diagram()], "<image>Find x.", "5", "written"),
    ([diagram()], "<image>Find y.", " 3\\sqrt{3} ", "written: label stripped"),
    ([diagram("RGBA")], "<image>Find z.", "7", "written: transparent image flattened onto white"),
    (
        [diagram(), diagram()],
        "<image><image>Compare the two figures.",
        "2",
        "too_many_images: over the recipes' 1",
    ),
    ([], "<image>Find v.", "1", "missing_image: empty image list"),
    ([None], "<image>Find w.", "1", "missing_image: null image"),
    ([{"bytes": b"not an image", "path": None}], "<image>Find u.", "4", "unreadable_image: garbage bytes"),
    (
        [{"bytes": png_bytes(diagram())[:60], "path": None}],
        "<image>Find t.",
        "4",
        "unreadable_image: truncated PNG",
    ),
    ([diagram()], "<image>Find s.", "  ", "empty_label: blank answer"),
    ([diagram()], "<image>Find r.", None, "empty_label: null answer"),
    ([diagram()], "<image>", "9", "empty_question: only the image tag"),
]
TEST_ROWS = [
    ([diagram()], "<image>Find the area.", "12", "written"),
]
EXPECTED_SKIPS = Counter(
    outcome.split(":")[0] for *_, outcome in TRAIN_ROWS if not outcome.startswith("written")
)


def as_dataset(rows) -> datasets.Dataset:
    features = datasets.Features(
        {
            "images": datasets.List(datasets.Image()),
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
        }
    )
    columns = {
        "images": [r[0] for r in rows],
        "problem": [r[1] for r in rows],
        "answer": [r[2] for r in rows],
    }
    return datasets.Dataset.from_dict(columns, features=features)


def store_source(kind: str, root: Path) -> Path:
    """The test dataset stored the way `kind` says; returns what to pass as --dataset."""
    source = datasets.DatasetDict({"train": as_dataset(TRAIN_ROWS), "test": as_dataset(TEST_ROWS)})
    if kind == "save_to_disk":
        source.save_to_disk(root / "saved")
        return root / "saved"
    if kind == "parquet_dir":
        # Hub layout: split names come from the file names.
        for split, dataset in source.items():
            dataset.to_parquet(root / "parquet" / f"{split}-00000-of-00001.parquet")
        return root / "parquet"
    source["train"].to_parquet(root / "one.parquet")
    return root / "one.parquet"


@pytest.fixture(scope="module")
def vl_processor(tiny_model_dir):
    """The tiny Qwen2.5-VL processor, loaded by OpenRLHF's own get_tokenizer (AutoProcessor for a VLM)."""
    from openrlhf.utils.utils import get_tokenizer

    return get_tokenizer(str(tiny_model_dir("qwen2_5_vl")), None)


def openrlhf_prompt_dataset(jsonl: Path, processor):
    """What train_ppo_ray does with --data.prompt_dataset JSONL --data.input_key prompt --data.label_key label
    --data.image_key images --data.apply_chat_template."""
    from openrlhf.datasets import PromptDataset
    from openrlhf.datasets.utils import blending_datasets

    data_args = SimpleNamespace(
        input_key="prompt", label_key="label", image_key="images", apply_chat_template=True
    )
    strategy = SimpleNamespace(
        args=SimpleNamespace(data=data_args, use_ms=False), is_rank_0=lambda: True, print=lambda *_: None
    )
    return PromptDataset(blending_datasets(str(jsonl), None, strategy), processor, strategy)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("kind", ["save_to_disk", "parquet_dir", "parquet_file"])
def test_converts_local_datasets_and_counts_bad_rows(kind, tmp_path, capsys):
    output_dir = tmp_path / "out"
    summaries = prepare_data.prepare(
        ["--dataset", str(store_source(kind, tmp_path)), "--output-dir", str(output_dir)]
    )

    written = sum(outcome.startswith("written") for *_, outcome in TRAIN_ROWS)
    assert summaries["train"].written == written
    assert summaries["train"].skipped == EXPECTED_SKIPS
    # A lone parquet file is one "train" split; the other layouts keep both splits.
    assert set(summaries) == ({"train"} if kind == "parquet_file" else {"train", "test"})
    assert f"train: wrote {written} rows, skipped {sum(EXPECTED_SKIPS.values())}" in capsys.readouterr().out

    rows = read_jsonl(output_dir / "train.jsonl")
    assert [row["label"] for row in rows] == ["5", "3\\sqrt{3}", "7"]
    assert [len(row["images"]) for row in rows] == [1, 1, 1]
    assert all(Path(path).is_absolute() and Path(path).is_file() for row in rows for path in row["images"])
    # The datasource defaults to the dataset's base name without extension.
    assert {row["datasource"] for row in rows} == {
        {"save_to_disk": "saved", "parquet_dir": "parquet"}.get(kind, "one")
    }
    first = rows[0]["prompt"]
    assert first == [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": f"Find x.\n\n{PROMPT_INSTRUCTIONS['boxed']}"},
            ],
        }
    ]
    # The transparent diagram must not turn into a black square.
    flattened = Image.open(rows[2]["images"][0])
    assert flattened.mode == "RGB" and flattened.getpixel((60, 10)) == (255, 255, 255)


def test_output_loads_with_openrlhf_prompt_dataset_for_a_vlm(tmp_path, vl_processor):
    from openrlhf.utils.vlm_utils import process_prompt_with_images

    output_dir = tmp_path / "out"
    prepare_data.prepare(
        ["--dataset", str(store_source("save_to_disk", tmp_path)), "--output-dir", str(output_dir)]
        + ["--answer-format", "think_answer", "--datasource", "geo"]
    )
    dataset = openrlhf_prompt_dataset(output_dir / "train.jsonl", vl_processor)

    assert len(dataset) == 3
    datasource, prompt, label, images = dataset[0]
    assert (datasource, label) == ("geo", "5")
    assert "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x." in prompt
    assert PROMPT_INSTRUCTIONS["think_answer"] in prompt
    assert prompt.endswith("<|im_start|>assistant\n")

    # What the vLLM actor does next: load the image files and expand each placeholder to its patches.
    token_ids, mm_inputs, pil_images = process_prompt_with_images(vl_processor, prompt, images)
    assert len(pil_images) == 1 and mm_inputs["image_grid_thw"].shape == (1, 3)
    merged_patches = int(mm_inputs["image_grid_thw"].prod()) // 4
    assert token_ids.count(vl_processor.image_token_id) == merged_patches


# A plain table of rows with 0, 1 and 2 images, each labelled with its image count: (images, problem, answer).
IMAGE_COUNT_ROWS = [
    ([], "<image>Find a.", "0"),
    ([diagram()], "<image>Find b.", "1"),
    ([diagram(), diagram()], "<image><image>Find c.", "2"),
]
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


# (extra flags, labels written, skipped, what the case shows)
IMAGE_LIMITS = [
    ([], ["1"], {"missing_image": 1, "too_many_images": 1}, "default: the recipes' one image"),
    (
        ["--max-images-per-prompt", "2"],
        ["1", "2"],
        {"missing_image": 1},
        "control: a limit of two keeps both",
    ),
]


@pytest.mark.parametrize(
    ("flags", "labels", "skipped", "case"), IMAGE_LIMITS, ids=[case for *_, case in IMAGE_LIMITS]
)
def test_rows_over_the_image_limit_are_skipped_and_counted(
    tmp_path, capsys, vl_processor, flags, labels, skipped, case
):
    from openrlhf.utils.vlm_utils import process_prompt_with_images

    as_dataset(IMAGE_COUNT_ROWS).to_parquet(tmp_path / "rows.parquet")
    output_dir = tmp_path / "out"
    summaries = prepare_data.prepare(
        ["--dataset", str(tmp_path / "rows.parquet"), "--output-dir", str(output_dir)] + flags
    )

    assert summaries["train"].skipped == Counter(skipped)
    assert [row["label"] for row in read_jsonl(output_dir / "train.jsonl")] == labels
    hint = capsys.readouterr().err
    if "too_many_images" in skipped:
        assert "1 row(s) had more than 1 image(s); to keep them, raise --max-images-per-prompt" in hint
    else:
        assert "had more than" not in hint
    # What is written is what OpenRLHF renders and the vLLM actor loads: one placeholder per image.
    dataset = openrlhf_prompt_dataset(output_dir / "train.jsonl", vl_processor)
    for _, prompt, label, images in dataset:
        image_count = int(label)  # each row's label is its number of images
        assert prompt.count(VISION_PLACEHOLDER) == image_count
        _, mm_inputs, pil_images = process_prompt_with_images(vl_processor, prompt, images)
        assert len(pil_images) == image_count and mm_inputs["image_grid_thw"].shape == (image_count, 3)


def test_image_limit_defaults_to_the_recipes_value(tmp_path, monkeypatch):
    from openrlhf_lora_sync.config.recipe import load_recipe

    default = prepare_data.parse_args([]).max_images_per_prompt
    recipes = sorted((REPO_ROOT / "recipes").glob("*.yaml"))
    # Data prepared with the default fits every shipped recipe, and the base recipe's limit is the default.
    assert recipes and all(load_recipe(recipe)[prepare_data.IMAGE_LIMIT_KEY] >= default for recipe in recipes)
    assert load_recipe(REPO_ROOT / "recipes" / "base.yaml")[prepare_data.IMAGE_LIMIT_KEY] == default
    # Control: the default is read from recipes/base.yaml, not a constant that happens to agree.
    (tmp_path / "base.yaml").write_text(f"{prepare_data.IMAGE_LIMIT_KEY}: 3\n")
    monkeypatch.setattr(prepare_data, "RECIPES_DIR", tmp_path)
    assert prepare_data.parse_args([]).max_images_per_prompt == 3


def test_answer_format_and_output_defaults_are_the_settings_and_the_recipes(capsys):
    from openrlhf_lora_sync.config.recipe import load_recipe

    args = prepare_data.parse_args([])
    assert args.answer_format == settings.get("reward.answer_format").default
    for answer_format in settings.ANSWER_FORMATS:
        assert prepare_data.parse_args(["--answer-format", answer_format]).answer_format == answer_format
    with pytest.raises(SystemExit):
        prepare_data.parse_args(["--answer-format", "xml"])
    assert "--answer-format" in capsys.readouterr().err
    # Written where the recipes read it, whatever the working directory.
    base = load_recipe(REPO_ROOT / "recipes" / "base.yaml")
    assert args.output_dir / "train.jsonl" == REPO_ROOT / base["data.prompt_dataset"]


@pytest.mark.parametrize("value", ["0", "-1", "one"])
def test_image_limit_must_be_a_positive_integer(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        prepare_data.parse_args(["--max-images-per-prompt", value])
    assert exit_info.value.code == 2
    assert "--max-images-per-prompt" in capsys.readouterr().err.splitlines()[-1]


def test_relative_image_paths(tmp_path, monkeypatch):
    output_dir = tmp_path / "out"
    prepare_data.prepare(
        ["--dataset", str(store_source("parquet_file", tmp_path)), "--output-dir", str(output_dir)]
        + ["--relative-to", str(tmp_path)]
    )
    paths = [path for row in read_jsonl(output_dir / "train.jsonl") for path in row["images"]]
    assert paths[0] == "out/images/train/000000-0.png"
    monkeypatch.chdir(tmp_path)
    assert all(Path(path).is_file() for path in paths)


def test_max_rows_and_split_selection(tmp_path):
    summaries = prepare_data.prepare(
        ["--dataset", str(store_source("parquet_dir", tmp_path)), "--output-dir", str(tmp_path / "out")]
        + ["--splits", "train", "--max-rows", "2"]
    )
    assert list(summaries) == ["train"] and summaries["train"].written == 2
    assert not (tmp_path / "out" / "test.jsonl").exists()


def test_missing_column_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no column 'question'"):
        prepare_data.prepare(
            ["--dataset", str(store_source("parquet_file", tmp_path)), "--output-dir", str(tmp_path / "out")]
            + ["--question-column", "question"]
        )


def test_cli_help():
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "prepare_data.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent,
    )
    assert "--dataset" in completed.stdout and "--relative-to" in completed.stdout
    assert "--max-images-per-prompt" in completed.stdout


def test_committed_sample_is_small_and_loads_from_the_repo_root(monkeypatch, vl_processor):
    files = [path for path in SAMPLE_DIR.rglob("*") if path.is_file()]
    assert sum(path.stat().st_size for path in files) < 200_000
    monkeypatch.chdir(REPO_ROOT)  # image paths in the sample are relative to the repository root
    for split, size in [("train", 6), ("test", 2)]:
        dataset = openrlhf_prompt_dataset(SAMPLE_DIR / f"{split}.jsonl", vl_processor)
        assert len(dataset) == size
        for _, _, _, images in dataset:
            assert all(Image.open(path).size == (224, 224) for path in images)


def test_committed_sample_matches_its_generator(tmp_path):
    # As a user runs it, from another working directory: the script finds the package, not the cwd.
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "make_sample_data.py"), "--output-dir", str(tmp_path)],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )

    def without_paths(path: Path) -> list[dict]:
        return [{key: value for key, value in row.items() if key != "images"} for row in read_jsonl(path)]

    for split in ("train", "test"):
        assert without_paths(tmp_path / f"{split}.jsonl") == without_paths(SAMPLE_DIR / f"{split}.jsonl")


class ScriptedEngine:
    """Stands in for the vLLM engine: every prompt gets the same scripted completion, ending in <|im_end|>."""

    def __init__(self, processor, completion: str) -> None:
        self.completion = completion
        self.token_ids = processor.tokenizer(completion + "<|im_end|>", add_special_tokens=False)["input_ids"]
        self.images_seen = None

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.images_seen = multi_modal_data
        output = SimpleNamespace(
            token_ids=self.token_ids, text=self.completion, finish_reason="stop", logprobs=None
        )
        return SimpleNamespace(outputs=[output])


# Completions for the first sample row (a 3-4-x right triangle, label 5): (completion, reward, score).
ROLLOUTS = [
    ("The legs are 3 and 4, so x = \\sqrt{9 + 16} = \\boxed{5}", 1.1, 1.0),
    ("x = \\boxed{5}", 1.1, 1.0),
    ("x = \\boxed{7}", 0.1, 0.0),
    ("x is five", 0.0, 0.0),
]


@pytest.mark.parametrize(("completion", "reward", "score"), ROLLOUTS)
def test_sample_rollout_through_openrlhf_executor_is_graded(
    monkeypatch, vl_processor, completion, reward, score
):
    """The committed sample, rendered by OpenRLHF, rolled out by its single-turn executor with images, and
    graded by rewards/math_answer.py loaded through --reward.remote_url."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    for name in ("REWARD_ACCURACY_WEIGHT", "REWARD_FORMAT_WEIGHT", "REWARD_ANSWER_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(REPO_ROOT)
    _, prompt, label, images = openrlhf_prompt_dataset(SAMPLE_DIR / "train.jsonl", vl_processor)[0]
    executor = SingleTurnAgentExecutor(remote_rm_url=[str(REPO_ROOT / "rewards" / "math_answer.py")])
    engine = ScriptedEngine(vl_processor, completion)
    sampling_params = SimpleNamespace(max_tokens=256, logprobs=None)

    output = asyncio.run(executor.execute(prompt, label, sampling_params, 4096, vl_processor, engine, images))

    assert len(engine.images_seen["image"]) == 1
    assert output["reward"].tolist() == pytest.approx([reward])
    assert output["scores"].tolist() == [score]
    assert output["extra_logs"]["math_accuracy"] == score


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "run_grpo_lora.sh"), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


def test_the_main_jobs_path_prepares_missing_data_then_reaches_preflights_verdict(tmp_path):
    """A fresh clone's first `run_grpo_lora.sh <GPU recipe>`: the run's data is missing, data.source (here a
    local copy in the hub's parquet layout, in place of the hub) is converted into it with one line, the
    reward file is checked, and preflight gives its verdict (FAIL here: no GPUs) on the prepared data.
    Control: the second run finds the data and prepares nothing."""
    source = store_source("parquet_dir", tmp_path)
    data = tmp_path / "fresh" / "geometry3k"
    args = [
        "qwen2_5_vl-7b-4x4090",
        f"data.source={source}",
        f"data.prompt_dataset={data / 'train.jsonl'}",
        f"eval.dataset={data / 'test.jsonl'}",
    ]
    done = run_script(*args)
    said = [line for line in done.stderr.splitlines() if "missing: converting" in line]
    assert len(said) == 1 and str(source) in said[0], done.stderr[-3000:]
    written = sum(outcome.startswith("written") for *_, outcome in TRAIN_ROWS)
    assert len(read_jsonl(data / "train.jsonl")) == written and read_jsonl(data / "test.jsonl")
    assert "reward_check: rewards/math_answer.py: reward_func returned OpenRLHF's dict" in done.stdout
    verdict = done.stdout.splitlines()
    assert any(line.startswith("PASS  data") for line in verdict), done.stdout[-3000:]
    assert any(line.startswith("PASS  reward") for line in verdict), done.stdout[-3000:]
    assert verdict[-1].startswith("preflight: 17 checks") and "gpus" in verdict[-1]
    assert done.returncode == 1 and "run_grpo_lora: preflight failed" in done.stderr

    again = run_script(*args)
    assert "missing: converting" not in again.stderr and again.returncode == 1


def test_offline_without_a_local_copy_is_one_line_naming_data_source(tmp_path):
    """Where the hub is out of reach (offline here), the data step stops the run with one line naming the fix,
    before the reward check and preflight; nothing is written."""
    data = tmp_path / "fresh" / "geometry3k"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = run_script("qwen2_5_vl-7b-4x4090", f"data.prompt_dataset={data / 'train.jsonl'}", env=env)
    lines = [line for line in done.stderr.splitlines() if line.startswith("prepare_data:")]
    assert done.returncode == 2 and len(lines) == 2, done.stderr[-3000:]  # what it does, then why it cannot
    assert "cannot read hiyouga/geometry3k" in lines[1] and "data.source=PATH" in lines[1]
    assert "reward_check" not in done.stdout + done.stderr and "preflight" not in done.stdout
    assert not data.exists()


def test_data_source_comes_from_the_environment_unless_the_recipe_sets_it(tmp_path, monkeypatch, capsys):
    """Docker's way (DATA_SOURCE in .env): base.yaml leaves data.source null, so the variable is used; a
    recipe key wins over it (the control: the variable then names a folder that does not exist)."""
    source = store_source("parquet_file", tmp_path)
    data = tmp_path / "fresh"
    monkeypatch.setenv("DATA_SOURCE", str(source))
    sets = [f"data.prompt_dataset={data / 'train.jsonl'}", "eval.dataset=null"]
    assert prepare_data.prepare_for_run("qwen2_5_vl-7b-4x4090", sets) == 0
    assert (data / "train.jsonl").is_file() and str(source) in capsys.readouterr().err
    monkeypatch.setenv("DATA_SOURCE", str(tmp_path / "nowhere"))
    other = tmp_path / "other"
    sets = [f"data.prompt_dataset={other / 'train.jsonl'}", "eval.dataset=null", f"data.source={source}"]
    assert prepare_data.prepare_for_run("qwen2_5_vl-7b-4x4090", sets) == 0
    assert (other / "train.jsonl").is_file()
