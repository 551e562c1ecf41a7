"""The controls kernel on two edges the torch path's tests define (interpreter on CPU):

* ``cut_order="vllm"`` (min-p before top-k and top-p) equals the float64 reference, as the
  torch ops do in tests/test_cut_order.py;
* an out-of-range tensor control flags its row at any temperature, a Python 0 included
  (tests/test_bad_values.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import test_bad_values
import test_cut_order


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "triton")


@pytest.mark.parametrize("order", test_cut_order.ORDERS)
def test_cut_orders_match_the_reference(order):
    import fastsample as fs

    xs, controls = test_cut_order.order_batch(300, 12, seed=21, order=order)
    got = fs.process(torch.tensor(xs, dtype=torch.float32), **test_cut_order.tensors(controls),
                     cut_order=order)  # fmt: skip
    want = test_cut_order.reference(xs, controls, order)
    test_cut_order.assert_matches_reference(got, want, f"triton {order}")


@pytest.mark.parametrize("num_samples", [1, 2])
@pytest.mark.parametrize("name", sorted(test_bad_values.OUT_OF_RANGE))
def test_out_of_range_tensor_control_flags_its_row_at_any_temperature(name, num_samples):
    test_bad_values.test_out_of_range_tensor_control_flags_its_row_at_any_temperature(
        name, num_samples
    )
