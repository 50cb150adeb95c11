"""The interpreter's bounds check (tests/kernel_bounds.py) catches an access past a tensor, and only that."""

import os
import re

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter")


@triton.jit
def _shift_copy(X, Y, n, shift, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    tl.store(Y + i, tl.load(X + i + shift, mask=m), mask=m)


def test_loads_and_stores_inside_the_tensors_pass():
    x = torch.arange(16, dtype=torch.float32)
    y = torch.zeros(16)
    _shift_copy[(1,)](x[4:], y, 12, 0, BLOCK=16)   # a view: its storage holds the 4 elements before it too
    assert torch.equal(y[:12], x[4:])
    _shift_copy[(1,)](x[4:], y, 12, -4, BLOCK=16)
    assert torch.equal(y[:12], x[:12])


@pytest.mark.parametrize("shift, where", [(1, "4 bytes past the end of argument X (64 bytes)"),
                                          (-1, "4 bytes before argument X")])
def test_an_access_outside_every_tensor_argument_fails_naming_it(shift, where):
    x, y = torch.arange(16, dtype=torch.float32), torch.zeros(16)
    with pytest.raises(Exception, match=re.escape(where)):
        _shift_copy[(1,)](x, y, 16, shift, BLOCK=16)


def test_a_store_past_the_end_fails():
    x, y = torch.arange(16, dtype=torch.float32), torch.zeros(8)
    where = "_shift_copy: a store of 4 bytes at 4 bytes past the end of argument Y (32 bytes)"
    with pytest.raises(Exception, match=re.escape(where)):
        _shift_copy[(1,)](x, y, 16, 0, BLOCK=16)
