import pytest

from titanlite.data.order import Microbatches, PermutedOrder, microbatch_rows

G = 8


def test_permutation_per_epoch():
    order = PermutedOrder(lambda i: i, 0, 50, seed=3)
    e0, e1 = order.take(0, 50), order.take(50, 100)
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1
    assert order.take(45, 55) == e0[45:] + e1[:5]  # a batch may span two epochs
    assert PermutedOrder(lambda i: i, 0, 50, seed=3).take(0, 50) == e0


# (dp_degree, local_batch_size): 1x8x1, 1x1x8, 2x2x2, 4x1x2 as D x local_b x microbatches
@pytest.mark.parametrize("dp, lb", [(1, 8), (1, 1), (2, 2), (4, 1)])
def test_a_steps_rows_over_all_ranks_are_its_global_batch_in_order(dp, lb):
    n = G // (dp * lb)
    for step in (0, 1, 7):
        rows = [
            microbatch_rows(step, i, r, dp_degree=dp, num_microbatches=n, local_batch_size=lb)
            for r in range(dp)
            for i in range(n)
        ]
        assert [p for start, stop in rows for p in range(start, stop)] == list(
            range(step * G, (step + 1) * G)
        )


def test_microbatches_read_their_rows_from_the_order():
    order = PermutedOrder(lambda i: i, 0, 50, seed=3)
    items = Microbatches(
        order, list, dp_rank=1, dp_degree=2, num_microbatches=2, local_batch_size=2
    )
    assert items[3, 1] == order.take(3 * G + 6, 3 * G + 8)
