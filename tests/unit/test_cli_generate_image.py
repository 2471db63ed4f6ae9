"""`mtcore generate --image`: the prompt given twice, or --image given too much, is one
line and exit 2 before anything loads (the answering itself: test_vlm_training.py)."""

from __future__ import annotations

import pytest

from mtcore.cli.main import main


@pytest.mark.parametrize(
    "args, message",
    [
        (["--image", "a.png", "hi", "more"], "--image takes a path and at most one prompt"),
        (["--image", "a.png", "hi", "--prompt", "again"], "give the prompt once"),
        (["hi", "--prompt", "again"], "give the prompt once"),
        (["hi", "--image", "a.png", "again"], "give the prompt once"),
    ],
)
def test_the_prompt_is_given_once(tmp_path, capsys, args, message):
    assert main(["generate", str(tmp_path / "none"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtcore generate: error:") and message in err[0], err
