"""The loss spike guard's arithmetic: the mean of the last window's losses, spikes left out."""

from titanlite.bad_steps import spike_ratio


def test_judges_once_the_window_is_full_and_keeps_spikes_out_of_the_mean():
    recent = []
    assert [spike_ratio(x, recent, 2.0, 3) for x in (4.0, 1.0, 1.0)] == [None] * 3  # filling
    assert recent == [4.0, 1.0, 1.0]
    assert spike_ratio(3.0, recent, 2.0, 3) is None  # 3 / 2 = 1.5: kept, the oldest leaves
    assert recent == [1.0, 1.0, 3.0]
    assert spike_ratio(10.0, recent, 2.0, 3) == 10.0 / (5.0 / 3)  # a spike
    assert recent == [1.0, 1.0, 3.0]  # not recorded: the next step meets the same bar
    assert spike_ratio(3.3, recent, 2.0, 3) is None  # 3.3 / (5 / 3) = 1.98
    assert recent == [1.0, 3.0, 3.3]
