import numpy as np
import pytest

from titanlite.data.shuffle import Permutation


@pytest.mark.parametrize("n", [1, 2, 3, 50, 1024, 1025, 65537])
def test_a_bijection_of_every_size(n):
    assert sorted(Permutation(n, seed=3, epoch=0)(np.arange(n)).tolist()) == list(range(n))


def test_fixed_by_seed_and_epoch():
    x = np.arange(500)
    ref = Permutation(500, 1, 0)(x)
    assert np.array_equal(Permutation(500, 1, 0)(x), ref)
    assert not np.array_equal(Permutation(500, 2, 0)(x), ref)
    assert not np.array_equal(Permutation(500, 1, 1)(x), ref)


def test_any_position_of_a_huge_permutation_without_a_table():
    """FineWeb-sized (15 T tokens / 2,049 per sample): positions are computed where read."""
    n = 7_300_000_000
    p = Permutation(n, seed=0, epoch=0)
    got = p(np.arange(n - 4096, n))
    assert got.dtype == np.int64 and got.min() >= 0 and got.max() < n
    assert len(np.unique(got)) == 4096
    assert np.array_equal(p(np.array([n - 1])), got[-1:])  # alone == within a batch


def test_scatters_neighbours():
    """Consecutive positions land far apart: mean |p(i+1) - p(i)| ~ n/3 for a random order."""
    n = 3000
    p = Permutation(n, seed=5, epoch=0)(np.arange(n))
    assert abs(np.abs(np.diff(p)).mean() / n - 1 / 3) < 0.05
    # Every value of a few positions is reachable: position 0 over 4,000 seeds covers 0..9 evenly.
    hits = np.bincount([Permutation(10, s, 0)(np.array([0]))[0] for s in range(4000)], minlength=10)
    assert hits.min() > 300 and hits.max() < 500


def test_nothing_to_permute():
    with pytest.raises(ValueError, match="cannot permute 0 samples"):
        Permutation(0, 0, 0)
