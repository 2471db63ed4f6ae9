"""The LLaVA family through the trainer in one process: the embedded task trains and
reports caption accuracy, a resumed job repeats the uninterrupted one bitwise, jsonl
records train, bad input is refused naming the record, and ``mtcore generate --image``
answers from a checkpoint."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest

from mtcore.models.vlm.images import shape_image
from mtcore.training.config import ConfigError
from mtcore.training.overrides import validate
from mtcore.training.trainer import train

ROOT = Path(__file__).resolve().parents[3]
LLAVA = {
    "family": "llava", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
    "seq_len": 32, "vision": {"image_size": 16, "patch_size": 8, "hidden_size": 16, "num_layers": 1,
                              "num_heads": 2},
    "images": {"embedded_train": 64, "embedded_valid": 16},
}  # fmt: skip


def _llava(tiny, **sections) -> dict:
    model = sections.pop("model", {})
    config = tiny(**sections)
    config["model"] = {**LLAVA, **model}
    config["data"] = {"cache_dir": config["data"]["cache_dir"], **sections.get("data", {})}
    config["training"]["sample_prompt"] = None
    return config


@pytest.mark.parametrize("precision", [{"dtype": "fp32"}, {"dtype": "bf16"}], ids=["fp32", "bf16"])
def test_the_embedded_task_trains_and_reports_caption_accuracy(tiny, precision):
    config = _llava(
        tiny, precision=precision, optimizer={"lr": 3e-3, "warmup_steps": 1},
        training={"steps": 8, "eval_interval": 8}, checkpoint={"dir": None},
    )  # fmt: skip
    stream = io.StringIO()
    result = train(validate(config), stream=stream)
    assert all(math.isfinite(x) for x in result.losses) and result.losses[-1] < result.losses[0]
    ((step, metrics),) = result.val_metrics
    assert step == 8 and set(metrics) == {"loss", "lm", "caption_accuracy"}
    assert 0.0 <= metrics["caption_accuracy"] <= 1.0
    log = stream.getvalue()
    assert "mtcore train: LLaVA" in log and "caption_accuracy" in log


def test_a_resumed_job_repeats_the_uninterrupted_one(tiny, tmp_path):
    """Bitwise: the loader's position and the weights come back from step 3."""
    sections = dict(training={"steps": 6, "eval_interval": 0}, checkpoint={"interval": 3})
    whole = train(validate(_llava(tiny, **sections)), stream=io.StringIO())
    step3 = Path(whole.checkpoint).parent / "step_000003"
    again = {"interval": 3, "dir": str(tmp_path / "again"), "load": str(step3)}
    resumed = train(
        validate(_llava(tiny, **{**sections, "checkpoint": again})), stream=io.StringIO()
    )
    assert resumed.start_step == 3 and resumed.losses == whole.losses[3:]


def _records(root: Path, bad: bool = False) -> Path:
    records = []
    for i in range(12):
        img, caption = shape_image(7, i)
        img.save(root / f"{i}.png")
        records.append({"image": f"{i}.png", "caption": caption})
    if bad:
        records.append({"image": "missing.png", "caption": "gone"})
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    return root / "d.jsonl"


def test_jsonl_records_train_and_bad_ones_are_refused_on_request(tiny, tmp_path):
    f = _records(tmp_path, bad=True)
    data = {"paths": [str(f)], "valid_fraction": 0.25}
    config = _llava(
        tiny, data=data, training={"steps": 2, "eval_interval": 2}, checkpoint={"dir": None}
    )
    result = train(validate(config), stream=io.StringIO())  # the bad record is skipped
    assert len(result.losses) == 2 and result.val_metrics
    strict = _llava(tiny, data=data, model={"images": {"bad_records": "error"}})
    with pytest.raises(
        ConfigError,
        match=rf"bad record {re.escape(str(f))}:13: image .*missing\.png does not exist",
    ):
        train(validate(strict), stream=io.StringIO())
    short = _llava(tiny, data=data, model={"seq_len": 8})
    with pytest.raises(
        ConfigError, match=rf"{re.escape(str(f))}:1: \d+ tokens with its images expanded"
    ):
        train(validate(short), stream=io.StringIO())


def test_generate_answers_from_an_image(tiny, tmp_path, run_mtcore):
    config = _llava(tiny, training={"steps": 2, "eval_interval": 0})
    result = train(validate(config), stream=io.StringIO())
    image = tmp_path / "shape.png"
    shape_image(0, 999)[0].save(image)
    run = run_mtcore("generate", result.checkpoint, "--image", image, "What is in the image?",
                     "--max-new-tokens", "4")  # fmt: skip
    assert run.returncode == 0, run.stderr
    answer = run.stdout  # the answer alone, not the prompt
    assert answer.endswith("\n") and "What is in the image" not in answer
    missing = run_mtcore("generate", result.checkpoint, "--image", tmp_path / "none.png", "hi")
    assert missing.returncode == 2 and "none.png does not exist" in missing.stderr


@pytest.mark.slow
def test_llava_yaml_trains_on_four_ranks(tmp_path, run_mtcore):
    """The shipped job, shortened, through `mtcore train` under tp2 x pp2."""
    args = ["train", ROOT / "configs/llava.yaml", "--nproc", "4",
            "--training.steps", "60", "--training.eval_interval", "60",
            "--logging.tensorboard_dir", "null", "--checkpoint.dir", str(tmp_path / "checkpoints")]  # fmt: skip
    run = run_mtcore(*args, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+/60 \| loss ([0-9.]+)", run.stdout, re.M)]
    assert losses[-1] < losses[0] - 2.0, losses
    accuracy = re.search(
        r"eval step 60 \| val loss [0-9.]+ .*caption_accuracy ([0-9.]+)", run.stdout
    )
    assert accuracy and float(accuracy.group(1)) > 0.5, run.stdout[-2000:]
