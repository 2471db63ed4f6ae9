"""examples/kubernetes/Containerfile, checked without a container engine (none here, and
no test builds it): the paths it copies exist, it installs mtcore and a backend plugin
of this repository (with what their extras need), its base image's torch fits, and its
ENTRYPOINT is installed. Each check is shown able to fail on a broken copy."""

from __future__ import annotations

import pytest
from k8s_image import CONTAINERFILE, image, problems, repo_distributions


@pytest.fixture(scope="module")
def text():
    return CONTAINERFILE.read_text()


def test_containerfile_passes_every_check(text):
    assert problems(text) == []
    built = image(text)
    assert built.entrypoint == ["/usr/bin/tini", "--"]
    assert built.tag == "registry.example.com/mtcore-cuda:0.1.0"
    assert {"mtcore", "mtcore-cuda", "mtcore-triton"} <= set(repo_distributions())


BREAKS = {
    "copies a missing path": (
        "COPY src ./src",
        "COPY source ./src",
        "COPY source: no such path in the build context",
    ),
    "forgets the package sources": ("COPY src ./src\n", "", "pip install .: not a project"),
    "installs no plugin": (
        " './plugins/mtcore_cuda[triton]' ./plugins/mtcore_triton",
        "",
        "mtcore and a backend plugin needed",
    ),
    "an extra that does not exist": (
        "mtcore_cuda[triton]",
        "mtcore_cuda[tensorrt]",
        "no such extra",
    ),
    "the extra's requirement left to an index": (
        " ./plugins/mtcore_triton \\",
        " \\",
        "mtcore-cuda[triton] needs mtcore-triton, which is on no index",
    ),
    "torch too old for the shutdown timeout": (
        "pytorch:2.9.0-cuda12.8",
        "pytorch:2.7.1-cuda12.8",
        "ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    ),
    "torch outside mtcore's range": (
        "pytorch:2.9.0-cuda12.8",
        "pytorch:3.0.0-cuda12.8",
        "outside mtcore's torch",
    ),
    "an init never installed": (
        "--no-install-recommends tini",
        "--no-install-recommends",
        "installed by no RUN",
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_each_check_fails_on_a_broken_copy(text, case):
    old, new, expected = BREAKS[case]
    assert old in text
    found = problems(text.replace(old, new))
    assert any(expected in line for line in found), found


def test_the_comments_name_what_exists(text):
    """The test files the comments point at exist, and the torch floor they state is
    pyproject's (they once named a moved test and torch >= 2.6)."""
    import re

    from k8s_image import ROOT, tomllib

    named = re.findall(r"\btests/[\w/]+\.py\b", text)
    assert named and all((ROOT / path).is_file() for path in named), named
    floor = re.search(r"mtcore accepts torch >= ([\d.]+)", text)
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_range = next(r for r in requirements["dependencies"] if r.startswith("torch"))
    assert floor and f">={floor[1]}" in torch_range, (floor, torch_range)
