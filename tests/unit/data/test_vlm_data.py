"""Image-text data: the embedded shapes, jsonl records, bad input, and the loader."""

from __future__ import annotations

import hashlib
import io
import json
import logging

import numpy as np
import pytest
from PIL import Image

from mtcore.data import DataConfig, DataError
from mtcore.models.vlm.data import (
    IGNORE_INDEX,
    IMAGE_TOKEN,
    ImageDataConfig,
    ImageTextLoader,
    build_image_text_data,
    prompt_batch,
)
from mtcore.models.vlm.images import BadImage, open_image, shape_image, to_pixels

SEQ, TOKENS, SIZE = 40, 4, 8  # 4 image tokens of 8-pixel images


def _data(paths=None, seq=SEQ, **images):
    config = DataConfig(paths=[str(p) for p in paths] if paths else None, valid_fraction=0.25)
    return build_image_text_data(config, seq, TOKENS, SIZE, ImageDataConfig(**images))


def _png(path, mode="RGB", colour=(200, 30, 30)):
    Image.new(mode, (12, 10), colour if mode == "RGB" else 0).save(path)
    return path


def _jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def _png_bytes(img):
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def test_the_embedded_generator_is_deterministic():
    """Same (seed, index): the same bytes; another index or seed: another image."""
    a, caption = shape_image(0, 17)
    b, again = shape_image(0, 17)
    assert caption == again and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert _png_bytes(a) == _png_bytes(b)
    digests = {hashlib.sha256(np.asarray(shape_image(s, i)[0]).tobytes()).hexdigest()
               for s, i in ((0, 17), (0, 18), (1, 17))}  # fmt: skip
    assert len(digests) == 3


def test_an_embedded_caption_says_what_the_image_holds():
    """The caption's colour is the colour of the shape pixels, and its count the number
    of grid cells holding them."""
    words = {"one": 1, "two": 2, "three": 3, "four": 4}
    rgb = {
        "red": (220, 40, 40),
        "green": (40, 200, 60),
        "blue": (50, 80, 230),
        "yellow": (230, 210, 40),
    }
    for index in range(20):
        img, caption = shape_image(3, index)
        count, colour, _ = caption.split()
        x = np.asarray(img).astype(int)
        shape = np.abs(x - np.array(rgb[colour])).sum(-1) == 0
        cells = shape.reshape(4, 16, 4, 16).any(axis=(1, 3)).sum()
        assert cells == words[count], (index, caption)


def test_embedded_samples_mask_everything_but_the_answer():
    data = _data()
    tok = data.tokenizer
    tokens, labels, pixels = data.train.sample(0)
    assert tokens.shape == labels.shape == (SEQ,) and pixels.shape == (1, 3, SIZE, SIZE)
    image = tokens == tok.token_id(IMAGE_TOKEN)
    assert image.sum() == TOKENS and (labels[image] == IGNORE_INDEX).all()
    answer = tok.decode(labels[labels != IGNORE_INDEX])
    assert answer == " " + shape_image(0, 0)[1] + "<|endoftext|>"
    assert len(data.valid) == 256  # held-out images: the stream's next ones


def test_train_on_prompt_makes_the_prompt_a_target():
    masked = _data().train.sample(0)[1]
    trained = _data(train_on_prompt=True).train.sample(0)[1]
    assert (trained != IGNORE_INDEX).sum() > (masked != IGNORE_INDEX).sum()


def test_records_read_captions_and_conversations(tmp_path):
    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png", colour=(0, 0, 255))
    f = _jsonl(tmp_path / "d.jsonl", [
        {"image": "a.png", "caption": "a red box"},
        {"image": "b.png", "conversations": [
            {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "blue"}]},
        {"images": ["a.png", "b.png"], "conversations": [
            {"role": "user", "content": "<image> and <image>: same?"},
            {"role": "assistant", "content": "no"}]},
        {"image": "b.png", "caption": "blue again"},
    ])  # fmt: skip
    data = _data([f], max_images=2)
    assert len(data.train) + len(data.valid) == 4
    tok = data.tokenizer
    image_id = tok.token_id(IMAGE_TOKEN)
    samples = [*(data.train.sample(i) for i in range(len(data.train))),
               *(data.valid.sample(i) for i in range(len(data.valid)))]  # fmt: skip
    answers = sorted(tok.decode(s[1][s[1] != IGNORE_INDEX]).strip() for s in samples)
    assert answers == sorted(["a red box<|endoftext|>", "blue<|endoftext|>",
                              "no<|endoftext|>", "blue again<|endoftext|>"])  # fmt: skip
    for tokens, _, pixels in samples:
        n = int((tokens == image_id).sum()) // TOKENS
        assert n in (1, 2) and pixels.shape == (2, 3, SIZE, SIZE)
        assert (pixels[n:] == 0).all() and (pixels[:n] != 0).any()  # unused slots are zeros


def test_bad_records_are_counted_and_skipped_or_fatal(tmp_path, caplog):
    _png(tmp_path / "good.png")
    _png(tmp_path / "cmyk.jpg", mode="CMYK")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    f = _jsonl(tmp_path / "d.jsonl", [
        {"image": "good.png", "caption": "fine"},
        {"image": "missing.png", "caption": "x"},
        {"image": "cmyk.jpg", "caption": "x"},
        {"image": "broken.png", "caption": "x"},
        "{not json",
        {"image": "good.png", "caption": "also fine"},
    ])  # fmt: skip
    with caplog.at_level(logging.WARNING):
        data = _data([f])
    assert len(data.train) + len(data.valid) == 2
    assert sum(data.train.skipped.values()) == 4
    assert data.train.skipped == {"image missing": 1, "image of another mode": 1,
                                  "image unreadable": 1, "not JSON": 1}  # fmt: skip
    assert "skipped 4 of 6 records" in caplog.text and f"{f}:2" in caplog.text
    with pytest.raises(DataError, match=rf"bad record {f}:2: image .*missing.png does not exist"):
        _data([f], bad_records="error")


def test_placeholders_must_match_the_images(tmp_path):
    _png(tmp_path / "a.png")
    f = _jsonl(tmp_path / "d.jsonl", [
        {"image": "a.png", "caption": "fine"},
        {"image": "a.png", "conversations": [
            {"from": "human", "value": "<image> <image> two?"}, {"from": "gpt", "value": "no"}]},
    ])  # fmt: skip
    with pytest.raises(DataError, match=rf"{f}:2: 2 <image> placeholder\(s\) for 1 image"):
        _data([f])
    g = _jsonl(tmp_path / "e.jsonl", [{"images": [], "caption": "<image> where?"}])
    with pytest.raises(DataError, match=rf"{g}:1: 1 <image> placeholder\(s\) for 0 image"):
        _data([g])


def test_a_sequence_too_long_with_its_images_is_an_error_or_truncated(tmp_path):
    _png(tmp_path / "a.png")
    long = " ".join(["word"] * 60)
    f = _jsonl(tmp_path / "d.jsonl", [{"image": "a.png", "caption": long}] * 4)
    with pytest.raises(
        DataError, match=rf"{f}:1: \d+ tokens with its images expanded, more than seq_len={SEQ}"
    ):
        _data([f])
    data = _data([f], overflow="truncate")
    tokens, labels, _ = data.train.sample(0)
    assert (tokens != data.tokenizer.eod_id).all() and (labels != IGNORE_INDEX).sum() > 10
    # Whatever the cut, a sample holds whole images; a cut inside one is an error.
    g = _jsonl(tmp_path / "e.jsonl", [{"image": "a.png", "caption": f"<image> {long}"}] * 4)
    cut_inside = 0
    for seq in range(2, 14):
        try:
            tokens = _data([g], seq=seq, overflow="truncate").train.sample(0)[0]
        except DataError as e:
            assert "would cut an image's tokens" in str(e) or "no target" in str(e), e
            cut_inside += "would cut" in str(e)
            continue
        assert (tokens == data.tokenizer.token_id(IMAGE_TOKEN)).sum() in (0, TOKENS), seq
    assert cut_inside >= TOKENS - 1


def test_open_image_names_the_file(tmp_path):
    with pytest.raises(BadImage, match=r"nope\.png does not exist"):
        open_image(tmp_path / "nope.png")
    img = open_image(_png(tmp_path / "grey.png", mode="L"))
    assert img.mode == "RGB"
    x = to_pixels(img, 4, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    assert x.shape == (3, 4, 4) and np.allclose(x, -1.0)  # black: (0 - 0.5) / 0.5


def test_the_loader_is_sharded_over_dp_and_resumes():
    data = _data()
    whole = ImageTextLoader(data.train, micro_batch_size=4, global_batch_size=4, seed=1)
    halves = [ImageTextLoader(data.train, micro_batch_size=2, global_batch_size=4, dp_rank=r,
                              dp_size=2, seed=1) for r in (0, 1)]  # fmt: skip
    a = next(whole)
    parts = [next(h) for h in halves]
    assert set(a) == {"tokens", "labels", "image_mask", "pixel_values"}
    for k in a:  # rank r reads rows r::2 of the global batch
        assert (a[k][0::2] == parts[0][k]).all() and (a[k][1::2] == parts[1][k]).all()
    state = whole.state_dict()
    expected = next(whole)
    resumed = ImageTextLoader(data.train, micro_batch_size=4, global_batch_size=4, seed=1)
    resumed.load_state_dict(state)
    got = next(resumed)
    assert all((got[k] == expected[k]).all() for k in got)


def test_prompt_batch_renders_as_training_does(tmp_path):
    from mtcore.models.vlm import LlavaConfig

    data = _data()
    config = LlavaConfig(seq_len=SEQ, vision=dict(image_size=SIZE, patch_size=4, num_heads=4))
    shape_image(0, 0)[0].save(tmp_path / "s.png")
    batch = prompt_batch("What is in the image?", tmp_path / "s.png", data.tokenizer, config)
    tokens = data.train.sample(0)[0]
    n = batch["tokens"].shape[1]
    assert (batch["tokens"][0] == tokens[:n]).all()  # the training sample's prompt
    assert int(batch["image_mask"].sum()) == TOKENS and batch["pixel_values"].shape == (
        1,
        1,
        3,
        SIZE,
        SIZE,
    )
    with pytest.raises(DataError, match="does not exist"):
        prompt_batch("hi", tmp_path / "none.png", data.tokenizer, config)
    Image.new("I;16", (8, 8)).save(tmp_path / "deep.png")
    with pytest.raises(DataError, match=r"deep\.png has mode 'I;16'"):
        prompt_batch("hi", tmp_path / "deep.png", data.tokenizer, config)


def test_many_bad_records_are_summed_up_not_listed(tmp_path, caplog):
    _png(tmp_path / "good.png")
    records = [{"image": "good.png", "caption": "fine"}] * 2
    records += [{"image": f"gone{i}.png", "caption": "x"} for i in range(15)]
    f = _jsonl(tmp_path / "d.jsonl", records)
    with caplog.at_level(logging.WARNING):
        data = _data([f])
    assert data.train.skipped == {"image missing": 15}
    assert caplog.text.count("skipping bad record") == 10
    assert "skipped 15 of 17 records (image missing: 15)" in caplog.text


def test_images_that_change_under_the_job_are_dropped_then_stop_it(tmp_path, caplog):
    """A record checked when the data was built whose image is then deleted or truncated:
    its sample keeps its place with no target and blank pixels, each record is said once
    with the count so far, and past model.images.max_unreadable the loader stops naming
    the record (bad_records: error stops at the first)."""
    from mtcore.data.loader import SamplesLost

    images = [_png(tmp_path / f"{i}.png", colour=(40 * i, 30, 30)) for i in range(4)]
    f = _jsonl(tmp_path / "d.jsonl", [{"image": p.name, "caption": "red"} for p in images])
    config = DataConfig(paths=[str(f)], valid_fraction=0.0)

    def loader(**settings):
        data = build_image_text_data(config, SEQ, TOKENS, SIZE, ImageDataConfig(**settings))
        return ImageTextLoader(data.train, micro_batch_size=4, shuffle=False)

    lenient, strict = loader(max_unreadable=2), loader(bad_records="error")
    intact = next(loader())
    images[1].unlink()  # deleted, and rewritten half-written, after the records were checked
    images[3].write_bytes(_png_bytes(Image.new("RGB", (12, 10)))[:40])
    with caplog.at_level(logging.WARNING):
        batch = next(lenient)
    for row in (0, 2):  # the intact samples are unchanged
        assert all((batch[k][row] == intact[k][row]).all() for k in batch)
    for row in (1, 3):  # the changed ones: in place, nothing to learn, no pixels
        assert (batch["tokens"][row] == intact["tokens"][row]).all()
        assert (batch["labels"][row] == IGNORE_INDEX).all()
        assert (batch["pixel_values"][row] == 0).all()
    said = [r.getMessage() for r in caplog.records if "dropping" in r.getMessage()]
    assert len(said) == 2 and f"{f}:2: image " in said[0] and "1.png does not exist" in said[0]
    assert f"{f}:4: image " in said[1] and "3.png cannot be read" in said[1]
    assert "2 record(s) so far" in said[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        next(lenient)  # the same records again: dropped, not said again
    assert not [r for r in caplog.records if "dropping" in r.getMessage()]
    images[0].unlink()  # a third record is past the limit of 2
    with pytest.raises(SamplesLost, match=rf"{f}:1: image .*0\.png does not exist; 3 record"):
        next(lenient)
    with pytest.raises(SamplesLost, match=rf"{f}:1: .*bad_records: error"):
        next(strict)


def test_a_record_file_that_is_not_utf8_is_named_with_line_and_byte(tmp_path):
    _png(tmp_path / "a.png")
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"image": "a.png", "caption": "fine"}\n{"image": "a.png", "caption": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"^{f}:2: not UTF-8 \(byte 0xe9 at column 35\)"):
        _data([f])
