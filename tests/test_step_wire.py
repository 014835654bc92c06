"""The least step time the wire allows (aqpipe.runtime.capacity.step_wire): every rank behind a link of its own, so a middle
stage's link carries both of its neighbours' traffic, the tied rows ride on the first and last stages' links, and the
grad sync comes after a rank's last backward pass."""

import pytest

from aqpipe.runtime.capacity.step_wire import RankTraffic, least_step_seconds, links_seconds, rank_traffic

MB = 1_000_000
BITS = 8 * MB  # 1 MB/s: seconds are megabytes


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_a_middle_rank_sends_its_activations_and_its_gradients_over_one_link(stages):
    """fp32 links (as many bytes each way): under 1F1B a two-stage step needs one link's bytes, but from three stages
    on a middle rank sends activations forward and gradients backward over its one link at once: twice that. (A
    three-stage 1F1B run at 4 Mbit/s measured 5.2-6.0 s per step, the old per-link bound 2.1 s, this one 4.2 s.) Under
    GPipe the two go in different halves of the step either way."""
    traffic = rank_traffic([(MB, MB)] * (stages - 1))
    assert links_seconds(traffic, BITS, overlapped=True) == pytest.approx(1.0 if stages == 2 else 2.0)
    assert links_seconds(traffic, BITS, overlapped=False) == pytest.approx(2.0)
    assert [t.most_each_way for t in traffic] == [MB] + [2 * MB] * (stages - 2) + [MB]


def test_a_tied_tables_rows_ride_on_the_first_and_last_ranks_links_in_their_halves_of_the_step():
    """The owner (last stage) sends the rows before the forward passes that read them, the lookup side (first stage)
    the gradient rows after its backward passes."""
    first, middle, last = rank_traffic([(4 * MB, 8 * MB), (4 * MB, 8 * MB)], row_bytes_each_way=3 * MB)
    assert first == RankTraffic(forward_out=4 * MB, forward_in=3 * MB, backward_out=3 * MB, backward_in=8 * MB)
    assert middle == RankTraffic(4 * MB, 4 * MB, 8 * MB, 8 * MB)
    assert last == RankTraffic(forward_out=3 * MB, forward_in=4 * MB, backward_out=8 * MB, backward_in=3 * MB)
    # GPipe: the forward half is the slowest rank's (4 MB), the backward half the slowest rank's (8 MB)
    assert links_seconds([first, middle, last], BITS, overlapped=False) == pytest.approx(12.0)
    # 1F1B: the middle rank's 12 MB each way; the ends carry 11 MB in their busier direction
    assert links_seconds([first, middle, last], BITS, overlapped=True) == pytest.approx(12.0)
    assert (first.most_each_way, last.most_each_way) == (11 * MB, 11 * MB)


def test_a_stages_grad_sync_follows_its_own_traffic_and_a_pipeline_exchange_waits_for_every_rank():
    traffic = rank_traffic([(MB, MB), (MB, MB)])  # 1F1B: 1, 2, 1 s before each rank's sync
    seconds, sync = least_step_seconds(traffic, BITS, True, [5 * MB, 0, 0])
    assert (seconds, sync) == pytest.approx((6.0, 5.0))  # the first rank: 1 s of links, then its 5 s sync
    seconds, sync = least_step_seconds(traffic, BITS, True, [0, 0, 0])
    assert (seconds, sync) == pytest.approx((2.0, 0.0))  # the links alone
    # tied copies summed over the pipeline (3 s a rank) wait for the slowest rank's 2 s, then the slowest sync
    seconds, sync = least_step_seconds(traffic, BITS, True, [5 * MB, MB, 0], pipeline_bytes=3 * MB)
    assert (seconds, sync) == pytest.approx((10.0, 5.0))


def test_a_grad_sync_per_rank_or_it_is_refused():
    """Fewer syncs than ranks would have dropped the rest silently (a smaller bound)."""
    with pytest.raises(ValueError, match="1 grad syncs for 2 ranks"):
        least_step_seconds(rank_traffic([(MB, MB)]), BITS, True, [MB])
    assert least_step_seconds(rank_traffic([]), BITS, True, [5 * MB]) == pytest.approx((5.0, 5.0))  # one stage
