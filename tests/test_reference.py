"""The float64 references themselves (reference.py), where a mistake in them
could hide one in the library: every test that uses them would agree with it."""
import pytest
import torch

from reference import adasum_tree, adasum_tree_order


def test_the_adasum_reference_tree_combines_in_the_documented_order():
    # orthogonal vectors add, equal ones average, and with 3 ranks the third
    # joins rank 0 first
    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    e2 = torch.tensor([0.0, 1.0], dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    assert torch.equal(adasum_tree([e1, e2]), e1 + e2)
    assert torch.equal(adasum_tree([e1, e1]), e1)
    # AdaSum(AdaSum(e1, e1), e2) = e1 + e2, but AdaSum(AdaSum(e1, e2), e1) is not
    assert torch.equal(adasum_tree([e1, e2, e1]), e1 + e2)
    assert torch.equal(adasum_tree([e1, zero]), e1)


#: with P the largest power of two <= n: (r - P, r) for every r >= P, then the
#: pairs at distance 1, 2, 4, ... < P
DOCUMENTED_ORDER = {
    1: [],
    2: [(0, 1)],
    3: [(0, 2), (0, 1)],
    4: [(0, 1), (2, 3), (0, 2)],
    5: [(0, 4), (0, 1), (2, 3), (0, 2)],
    8: [(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (4, 6), (0, 4)],
}


@pytest.mark.parametrize("n", sorted(DOCUMENTED_ORDER))
def test_the_adasum_tree_order_is_the_documented_one(n):
    assert adasum_tree_order(n) == DOCUMENTED_ORDER[n]
