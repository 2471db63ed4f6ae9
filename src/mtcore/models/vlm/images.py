"""Images for vision-language training: reading them with Pillow, preprocessing, and the
embedded task (coloured shapes drawn from a seed).

*Reading.* ``open_image`` decodes a file completely (a truncated file fails here, not
in the middle of an epoch) and accepts the modes that have an RGB meaning (``RGB``,
``RGBA``, ``L``, ``LA``, ``P``, converted to RGB); any other mode (``CMYK``, 16-bit
``I;16``, float ``F``, 1-bit ``1``) is a ``BadImage`` naming the file and the mode.

*Preprocessing.* ``to_pixels`` resizes to ``size x size`` (Pillow's resampling filter
from the config, no crop: the embedded images are already square) and normalises each
channel as ``(x / 255 - mean) / std``, giving float32 ``[3, size, size]``, CLIP's
convention (its mean and std are ``CLIP_MEAN`` / ``CLIP_STD``).

*The embedded task.* ``shape_image(seed, index)`` draws 1 to 4 shapes of one colour and
one kind (square, circle, triangle) into distinct cells of a 4 x 4 grid on a dark,
slightly noisy background, and says so in words: ``"three red circles"``. Every draw
comes from numpy's ``Generator`` seeded with ``(seed, index)``, so an image is a pure
function of its two numbers (the same seed gives the same bytes, on any machine), and
any image of the stream can be made without the ones before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RGB_MODES = ("RGB", "RGBA", "L", "LA", "P")
RESAMPLING = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
}

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
}
SHAPES = ("square", "circle", "triangle")
COUNT_WORDS = ("one", "two", "three", "four")
GRID = 4  # shapes sit in distinct cells of a GRID x GRID grid
CANVAS = 64  # drawn at this size, then resized like any image
_SHAPE_SALT = 0x5A7E_11A9  # keeps the image draws apart from other streams of one seed


class BadImage(ValueError):
    """An image that is missing, unreadable or of a mode with no RGB meaning; the
    message names the file."""


def open_image(path: str | Path) -> Image.Image:
    """The decoded RGB image at ``path``, or ``BadImage`` naming the file and why."""
    path = Path(path)
    if not path.is_file():
        raise BadImage(f"image {path} does not exist")
    try:
        with Image.open(path) as img:
            img.load()  # decode now: a truncated file must fail here
            mode = img.mode
            if mode not in RGB_MODES:
                raise BadImage(
                    f"image {path} has mode {mode!r}; mtcore reads {', '.join(RGB_MODES)} "
                    "(convert it to RGB first)"
                )
            return img.convert("RGB")
    except BadImage:
        raise
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError...
        raise BadImage(f"image {path} cannot be read: {type(e).__name__}: {e}") from None


def to_pixels(
    img: Image.Image,
    size: int,
    mean: tuple[float, ...] = CLIP_MEAN,
    std: tuple[float, ...] = CLIP_STD,
    resample: str = "bicubic",
) -> np.ndarray:
    """float32 ``[3, size, size]``: ``img`` resized and normalised per channel."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), RESAMPLING[resample])
    x = np.asarray(img, dtype=np.float32) / 255.0
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


@dataclass(frozen=True)
class ShapeScene:
    """What one embedded image holds: ``count`` shapes of ``colour`` and ``shape``."""

    count: int
    colour: str
    shape: str

    @property
    def caption(self) -> str:
        noun = self.shape if self.count == 1 else self.shape + "s"
        return f"{COUNT_WORDS[self.count - 1]} {self.colour} {noun}"


def shape_scene(seed: int, index: int) -> tuple[ShapeScene, np.random.Generator]:
    """The scene of image ``index`` of the stream ``seed`` and the generator that drew it
    (its next draws place the shapes)."""
    rng = np.random.default_rng([int(seed), int(index), _SHAPE_SALT])
    count = int(rng.integers(1, len(COUNT_WORDS) + 1))
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    return ShapeScene(count, colour, shape), rng


def shape_image(seed: int, index: int) -> tuple[Image.Image, str]:
    """Embedded image ``index`` of the stream ``seed`` (RGB, ``CANVAS`` pixels square) and
    its caption."""
    scene, rng = shape_scene(seed, index)
    noise = rng.integers(0, 24, size=(CANVAS, CANVAS, 1), dtype=np.uint8)
    img = Image.fromarray(np.repeat(noise + 16, 3, axis=2), "RGB")
    draw = ImageDraw.Draw(img)
    cell = CANVAS // GRID
    cells = rng.choice(GRID * GRID, size=scene.count, replace=False)
    rgb = COLOURS[scene.colour]
    for c in cells:
        x0, y0 = (int(c) % GRID) * cell, (int(c) // GRID) * cell
        margin = int(rng.integers(1, cell // 4 + 1))
        box = (x0 + margin, y0 + margin, x0 + cell - 1 - margin, y0 + cell - 1 - margin)
        if scene.shape == "square":
            draw.rectangle(box, fill=rgb)
        elif scene.shape == "circle":
            draw.ellipse(box, fill=rgb)
        else:
            left, top, right, bottom = box
            draw.polygon([((left + right) // 2, top), (left, bottom), (right, bottom)], fill=rgb)
    return img, scene.caption


def shape_vocabulary() -> list[str]:
    """Every caption the embedded task can produce (what a tokenizer for it must cover)."""
    return [
        ShapeScene(n, colour, shape).caption
        for n in range(1, len(COUNT_WORDS) + 1)
        for colour in COLOURS
        for shape in SHAPES
    ]
