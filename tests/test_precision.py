"""fusedreduce.precision: the rule for the dtype gradients travel in, and the split of a mean."""
import pytest
import torch

from fusedreduce import communication_dtype
from fusedreduce.precision import split_scale
from reference import communication_dtype as documented_communication_dtype

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize("reduce_dtype", DTYPES)
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_the_communication_dtype_follows_the_documented_rule(grad_dtype, reduce_dtype):
    assert communication_dtype(grad_dtype, reduce_dtype) == \
        documented_communication_dtype(grad_dtype, reduce_dtype)


@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_by_default_16_bit_gradients_travel_in_fp32_and_wider_ones_in_their_own_dtype(grad_dtype):
    wide = torch.float32 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype
    assert communication_dtype(grad_dtype) == wide


@pytest.mark.parametrize("total,prescale,default", [
    (0.25, None, 1.0), (0.25, None, 0.25), (1 / 3, 0.5, 1.0), (1.0, 4, 1.0), (0.125, -2.0, 1.0)])
def test_a_split_scale_applies_the_prescale_or_the_default_before_and_the_rest_after(
        total, prescale, default):
    before, after = split_scale(total, prescale, default)
    assert before == (default if prescale is None else prescale)
    assert after == total / before
