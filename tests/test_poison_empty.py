"""The plugin's uninitialized allocations are poisoned in the CPU tests (tests/poison_empty.py), the tests' own not."""

import os

import pytest
import torch

import poison_empty
from sgl_sparsekv.kernels.select import scratch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="installed with the interpreter")


def test_the_plugins_scratch_comes_poisoned_and_a_tests_allocation_does_not(monkeypatch):
    bounds, picks = scratch(1 << 16, 2, "cpu")   # 512 KiB each: fresh pages, zero on the CPU without the poison
    assert torch.isinf(bounds).all() and torch.isinf(picks).all()
    poisoned = []
    monkeypatch.setattr(poison_empty, "_poison", poisoned.append)
    mine = torch.empty(1 << 16)   # outside the plugin: left alone
    assert poisoned == []
    scratch(4, 2, "cpu")
    assert len(poisoned) == 2 and mine.shape == (1 << 16,)


@pytest.mark.parametrize("dtype, value", [(torch.int32, -0x55555556), (torch.int64, -0x5555555555555556),
                                          (torch.int8, -0x56), (torch.uint8, 0xAA), (torch.bool, True)])
def test_integers_get_a_pattern_no_index_survives(dtype, value):
    t = poison_empty._poison(torch.empty(5, dtype=dtype))
    assert (t == value).all()
    strided = poison_empty._poison(torch.empty(4, 6, dtype=dtype)[:, ::2])
    assert (strided == value).all()
