"""The run summary computed from per-step records."""

import re

import pytest

from aqpipe.metrics import summarize


def record(step, epoch, loss, sps=10.0):
    return dict(step=step, epoch=epoch, loss=loss, samples_per_second=sps, fwd_bytes=100, bwd_bytes=50,
                grad_sync_bytes=7, compute_seconds=0.1, comm_wait_seconds=0.2, link_fwd_bytes=[60, 40],
                link_bwd_bytes=[30, 20])


def test_summary_by_epochs_uses_last_epoch_and_post_warmup_median():
    records = [record(1, 0, 9.0, 1.0), record(2, 0, 8.0, 1.0), record(3, 1, 5.0, 20.0), record(4, 1, 3.0, 30.0),
               record(5, 1, 4.0, 40.0)]
    s = summarize(records, used_steps=False, warmup_epochs=1, wall_seconds=12.0)
    assert s["final_loss"] == pytest.approx(4.0)
    assert s["samples_per_second"] == 30.0
    assert s["steps"] == 5 and s["epochs"] == 2
    assert s["link_bytes"] == {"fwd": 500, "bwd": 250, "per_link_fwd": [300, 200], "per_link_bwd": [150, 100]}
    assert s["grad_sync_bytes"] == 35


def test_summary_by_steps_uses_last_tenth():
    records = [record(i + 1, 0, float(100 - i)) for i in range(20)]
    s = summarize(records, used_steps=True, warmup_epochs=1, wall_seconds=1.0)
    assert s["final_loss"] == pytest.approx((82 + 81) / 2)
    assert s["samples_per_second"] == 10.0  # no step after the warm-up epoch: median over all


def test_summary_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        summarize([], used_steps=True, warmup_epochs=0, wall_seconds=0)


def test_summary_of_aqsgd_fidelity_is_the_last_epochs_mean_per_link():
    records = [record(1, 0, 9.0), record(2, 1, 5.0), record(3, 1, 4.0)]
    records[0].update(link_aqsgd_change=[0.9, 0.8], link_aqsgd_error=[0.5, 0.4])
    records[1].update(link_aqsgd_change=[0.2, None], link_aqsgd_error=[0.1, None])
    records[2].update(link_aqsgd_change=[0.4, 0.6], link_aqsgd_error=[0.3, 0.2])
    s = summarize(records, used_steps=False, warmup_epochs=1, wall_seconds=1.0)
    assert s["aqsgd"]["change"] == pytest.approx([0.3, 0.6])
    assert s["aqsgd"]["error"] == pytest.approx([0.2, 0.2])
    assert "aqsgd" not in summarize([record(1, 0, 1.0)], used_steps=False, warmup_epochs=0, wall_seconds=1.0)
    by_steps = [record(i + 1, 0, 1.0) for i in range(20)]  # a run sized by --steps: the last tenth of its steps
    for i, r in enumerate(by_steps):
        r.update(link_aqsgd_change=[i / 10], link_aqsgd_error=[i / 100])
    s = summarize(by_steps, used_steps=True, warmup_epochs=0, wall_seconds=1.0)
    assert s["aqsgd"]["change"] == pytest.approx([1.85]) and s["aqsgd"]["error"] == pytest.approx([0.185])


def test_the_summary_counts_what_travelled_outside_the_records_once():
    """The run's totals beyond its records: restarts, start-up bytes, the last checkpoint's control and copies after
    the last record, and the final weights' gather, each in its traffic class and in the total."""
    from aqpipe.metrics import RunTotals

    records = [dict(record(1, 0, 2.0), control_bytes=5, checkpoint_bytes=100, store_hits=3, skipped=True),
               dict(record(2, 0, 1.0), control_bytes=5, store_hits=8, store_misses=2, eval_loss=1.5)]
    totals = RunTotals(restarts=2, unrecorded={"setup": 40, "control": 7, "checkpoint": 1000}, final_weights_bytes=900)
    s = summarize(records, used_steps=False, warmup_epochs=0, wall_seconds=1.0, totals=totals)
    traffic = s["traffic"]
    assert (traffic["control"], traffic["checkpoint"], traffic["setup"], traffic["final_weights"]) == (17, 1100, 40, 900)
    assert traffic["link_payload"] == 300 and traffic["grad_sync"] == 14
    assert traffic["total"] == sum(v for k, v in traffic.items() if k != "total") == 300 + 14 + 17 + 1100 + 40 + 900
    assert (s["restarts"], s["final_weights_bytes"], s["skipped_steps"]) == (2, 900, 1)
    assert s["store"] == {"hits": 8, "misses": 2, "reseeded": 0, "overflow": 0}  # running counts: the last record's
    assert (s["eval_loss"], s["eval_step"]) == (1.5, 2)


def explained_keys(page: str, header: str) -> set[str]:
    """The backticked names in the first cell of each row of the table under `header` on `page` (sub-keys in
    `{a, b}` too)."""
    rows = page.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    cells = [row.split(" | ")[0] for row in rows]
    names = {name for cell in cells for name in re.findall(r"`(\w+)`", cell)}
    return names | {name for cell in cells for braces in re.findall(r"\{([^}]*)\}", cell)
                    for name in re.split(r",\s*", braces)}


def test_every_key_a_step_record_or_the_summary_holds_is_explained_on_the_runs_page():
    """docs/runs.md has a row for every key of metrics.jsonl (each recorded statistic, each derived field, a held-out
    pass's) and of summary.json: a statistic or summary field added without a word for users fails here."""
    from pathlib import Path

    import torch

    from aqpipe.metrics import TRAFFIC_FIELDS
    from aqpipe.pipeline.execution.evaluate import classification_metrics
    from aqpipe.pipeline.vocab.step_stats import statistics_of
    from aqpipe.runtime.outputs.step_record import DERIVED, record_names

    page = (Path(__file__).resolve().parents[1] / "docs" / "runs.md").read_text()
    held_out = ["loss", "samples", "bytes", "perplexity", *classification_metrics(torch.zeros(2, 2))]
    step_keys = {"step", "epoch", "lr", "elapsed_seconds", *DERIVED, *(f"eval_{name}" for name in held_out),
                 *(name for s in statistics_of() if s.recorded for name in record_names(s))}
    assert explained_keys(page, "| `metrics.jsonl` key |") == step_keys

    full = record(1, 0, 2.0)
    full.update(link_aqsgd_change=[0.5], link_aqsgd_error=[0.1], **{f"eval_{name}": 1.0 for name in held_out})
    summary = summarize([full], used_steps=False, warmup_epochs=0, wall_seconds=1.0)
    # what the run directory adds to the summary (run_dir._summary): the exports, the held-out answer, the data's cuts
    summary.update(export=None, export_adapter=None, sample={}, data={"truncated": 0, "dropped": 0})
    summary_keys = {*summary, *(name for value in summary.values() if isinstance(value, dict) for name in value)}
    summary_keys -= set(TRAFFIC_FIELDS) | {"setup", "final_weights", "total"}  # (traffic's classes: checked below)
    assert explained_keys(page, "| `summary.json` key |") == summary_keys
    traffic = next(row for row in page.splitlines() if row.startswith("| `traffic` |"))
    assert [name for name in [*TRAFFIC_FIELDS, "setup", "final_weights", "total"] if f"`{name}`" not in traffic] == []
