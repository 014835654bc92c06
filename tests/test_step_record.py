"""One step's metrics record (aqpipe.runtime.outputs.step_record): every rank's statistics combined as each declares
(aqpipe.pipeline.vocab.step_stats), and the fields worked out from them."""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from aqpipe.pipeline.vocab.step_stats import StepStats, stat, statistics_of
from aqpipe.runtime.outputs.step_record import combine_rows, record_names
from tests.distributed import run_ranks


@dataclass
class WithWidgets(StepStats):
    """A statistic of a test's own, added the way a new one is added: one field and how it combines."""

    widgets: int = stat(0, "sum", "per_stage", "link_recv")


def _grid(pp: int, dp: int):
    from aqpipe.pipeline.world.grid import Grid

    return Grid(pp, dp, 0)


def test_every_statistic_declares_how_it_combines():
    with pytest.raises(ValueError, match="unknown combine"):
        stat(0)
    with pytest.raises(ValueError, match="unknown combine"):
        stat(0, "mean")
    assert all(s.combine for s in statistics_of(StepStats))


def test_each_rule_combines_the_ranks_values_as_it_says():
    """pp 3 × dp 2: rank r's value of `widgets` is 10·r + 1 (ranks hold stage r mod 3 of replica r // 3)."""
    grid = _grid(3, 2)
    statistics = statistics_of(WithWidgets)
    rows = torch.zeros(6, len(statistics), dtype=torch.float64)
    column = [s.name for s in statistics].index("widgets")
    rows[:, column] = torch.tensor([10.0 * r + 1 for r in range(6)])
    combined = combine_rows(rows, grid, statistics)
    assert combined["widgets"] == sum(10 * r + 1 for r in range(6))
    assert combined["stage_widgets"] == [1, 11, 21]  # replica 0's
    # link k's recv side is stage k + 1, summed over its replicas: stage 1 = ranks 1 and 4, stage 2 = ranks 2 and 5
    assert combined["link_widgets"] == [11 + 41, 21 + 51]
    assert all(isinstance(v, int) for v in [combined["widgets"], *combined["stage_widgets"]])
    assert record_names(statistics[column]) == ["widgets", "stage_widgets", "link_widgets"]


def _record_of_a_step(rank: int, world: int, deltas: bool) -> dict:
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.outputs.step_record import step_record

    stats = WithWidgets(widgets=rank + 3, loss_sum=6.0 * rank, fwd_bytes=100 * (rank + 1), fwd_elements=50,
                        fwd_recv_bytes=500 * rank, fwd_arrived_bytes=400 * rank, fwd_recv_seconds=2.0 * rank, overflow=0, control_bytes=10 + rank)
    if deltas and rank == 0:  # the send side of the one link: ‖a‖², ‖a − m_old‖², ‖a − m_new‖² of its deltas
        stats.aqsgd_signal, stats.aqsgd_change, stats.aqsgd_error = 4.0, 1.0, 0.25
    cfg = SimpleNamespace(micro_batches=4, dp=1, samples_per_step=8)
    return step_record(stats, Grid(2, 1, rank), cfg, 4, 10, 0.01, 0.5 + rank, torch.device("cpu"))


# Every field a record holds (with the fixture's statistic), as the record before the statistics declared their
# combining held them: nothing combined only to derive another field leaks into metrics.jsonl
RECORD_FIELDS = {
    "step", "epoch", "lr", "loss", "samples_per_second", "step_seconds", "fwd_bytes", "bwd_bytes", "grad_sync_bytes",
    "tied_bytes", "stage_tied_bytes", "fwd_framing_bytes", "bwd_framing_bytes", "checkpoint_bytes", "control_bytes",
    "compute_seconds", "stage_compute_seconds", "comm_wait_seconds", "stage_comm_wait_seconds", "stage_forward_seconds",
    "stage_backward_seconds", "grad_norm", "stage_peak_activation_bytes", "stage_peak_memory_bytes",
    "stage_codec_graph_bytes", "loss_scale", "store_hits", "store_misses", "store_reseeded", "store_overflow",
    "link_fwd_bytes", "link_bwd_bytes", "link_fwd_wire_seconds", "link_bwd_wire_seconds", "link_fwd_bytes_per_second",
    "link_bwd_bytes_per_second", "fwd_bytes_per_element", "bwd_bytes_per_element", "skipped",
    "widgets", "stage_widgets", "link_widgets",
}


@pytest.mark.parametrize("deltas", [False, True], ids=["no-deltas", "aqsgd-deltas"])
def test_a_new_statistic_reaches_the_record_with_no_other_change(deltas):
    """Two ranks (pp 2): rank 0's record holds the new field as it declares, beside the derived fields, and nothing
    else."""
    results = run_ranks(_record_of_a_step, 2, deltas)
    assert all(status == "ok" for status, _ in results), results
    record, elsewhere = results[0][1], results[1][1]
    assert elsewhere == {}
    aqsgd = {"link_aqsgd_change", "link_aqsgd_error"} if deltas else set()
    assert set(record) == RECORD_FIELDS | aqsgd
    assert (record["widgets"], record["stage_widgets"], record["link_widgets"]) == (3 + 4, [3, 4], [4])
    assert (record["step"], record["epoch"], record["lr"]) == (5, 0, 0.01)
    assert record["loss"] == 6.0 / 4  # the last stage's loss sum over its micro-batches
    assert record["step_seconds"] == 1.5 and record["samples_per_second"] == 8 / 1.5
    assert record["link_fwd_bytes"] == [100] and record["fwd_bytes"] == 300
    assert record["fwd_bytes_per_element"] == 300 / 100
    assert record["link_fwd_bytes_per_second"] == [200.0] and record["link_fwd_wire_seconds"] == [2.0]
    assert record["skipped"] is False
    row_bytes = 8 * len(statistics_of(WithWidgets))  # rank 1's row to rank 0, float64s: control traffic too
    assert record["control_bytes"] == 10 + 11 + row_bytes
    if deltas:
        assert record["link_aqsgd_change"] == [0.5] and record["link_aqsgd_error"] == [0.25]
