"""The collective capability table: a mapping, or a callable read once on first use.

A callable lets a plugin answer from the vendor library (which build it has) without
importing that library when plugins are discovered.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import Collective, CollectiveCapabilities, fp8_fallback_everywhere
from mtcore.backend.collective import FP8_DTYPES


def test_a_mapping_still_works_as_before():
    caps = CollectiveCapabilities(fp8_fallback_everywhere(), avg_supported=False)
    assert caps.support("all_gather", torch.float8_e5m2).value == "fallback"
    assert caps.support("all_gather", torch.bfloat16).value == "native"
    assert caps.support("barrier", torch.float8_e5m2).value == "native"
    assert caps.avg_supported is False
    assert CollectiveCapabilities().support("all_reduce", torch.float8_e4m3fn).value == "native"


def test_a_callable_is_read_on_first_use_and_only_once():
    calls = []

    def table():
        calls.append(1)
        return {"all_reduce": {torch.bfloat16, *FP8_DTYPES}, "broadcast": [torch.bfloat16]}

    collective = Collective("gloo", CollectiveCapabilities(table))
    assert calls == []  # building the backend asks nothing
    assert collective.support("all_reduce", torch.bfloat16).value == "fallback"
    assert collective.support("broadcast", torch.bfloat16).value == "fallback"  # a list is fine
    assert collective.support("all_gather", torch.bfloat16).value == "native"
    assert collective.support("all_reduce", torch.float32).value == "native"
    assert calls == [1]
    assert collective.capabilities.fallback_table()["all_reduce"] == frozenset(
        {torch.bfloat16, *FP8_DTYPES}
    )


def test_an_unknown_op_is_an_error_naming_the_known_ones():
    caps = CollectiveCapabilities(lambda: {})
    with pytest.raises(ValueError, match=r"unknown collective 'all_gatherv'.*all_gather"):
        caps.support("all_gatherv", torch.float32)


def test_a_failing_table_raises_each_time_rather_than_caching_nothing():
    def broken():
        raise RuntimeError("vendor library gone")

    caps = CollectiveCapabilities(broken)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="vendor library gone"):
            caps.support("all_reduce", torch.bfloat16)
