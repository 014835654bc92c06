"""benchmarks/throughput.py's report: the tables it writes from its measurements and what main() records of the
machine (the measuring itself needs `tc` and minutes; the results page holds its numbers)."""

import json
from pathlib import Path

from benchmarks.provenance import machine
from benchmarks.throughput import write_markdown

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def schedules_table() -> tuple[dict, list[str]]:
    """The medians of a measured comparison of schedules, trimmed to two variants' worth of what the script keeps."""
    saved = json.loads((RESULTS / "throughput-schedules-pp2-r2.json").read_text())
    table = {system: saved["medians"][system] for system in saved["medians"]
             if system.split(" · ")[0] in ("fp32", "aqsgd fw3 bw4")}
    return table, ["unthrottled", "25mbit", "19mbit"]


def test_the_report_names_the_machine_and_commit_main_records_and_a_row_per_system(tmp_path):
    table, bandwidths = schedules_table()
    info = dict(machine(), rounds=2, pp=2, whole_run=False)  # as main() passes it
    write_markdown(table, bandwidths, info, tmp_path / "report.md")
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, commit "
                             f"{info['commit']}. pp=2. Median of 2 rounds")
    for system in table:
        assert f"| {system} | " in report


def test_each_schedule_is_set_against_gpipe_for_every_variant_measured(tmp_path):
    table, bandwidths = schedules_table()
    write_markdown(table, bandwidths, dict(machine(), rounds=2, pp=2), tmp_path / "report.md")
    report = (tmp_path / "report.md").read_text()
    sps = {system: {bw: table[system][bw]["samples_per_second"] for bw in bandwidths} for system in table}
    for variant in ("fp32", "aqsgd fw3 bw4"):
        for schedule in ("1f1b", "eager-1f1b"):
            ratios = " / ".join(f"{sps[f'{variant} · {schedule}'][bw] / sps[f'{variant} · gpipe'][bw]:.2f}"
                                for bw in bandwidths)
            assert f"| {variant} | {schedule} | {ratios} |" in report


def test_the_default_schedule_is_the_one_measured_fastest_over_slow_links():
    """CONTRACT: --schedule defaults to the schedule measured fastest on slow links (the results page's
    "Schedules" table, the default codecs at pp = 2 and 4)."""
    from aqpipe.config.settings import RunConfig

    default = RunConfig().schedule
    for pp in (2, 4):
        saved = json.loads((RESULTS / f"throughput-schedules-defaults-pp{pp}.json").read_text())
        bandwidths = [bw for bw in saved["settings"]["bandwidths"].split(",") if bw != "unthrottled"]
        for bw in bandwidths:
            sps = {system.split(" · ")[1]: saved["medians"][system][bw]["samples_per_second"]
                   for system in saved["medians"]}
            assert sps[default] >= 0.95 * max(sps.values()), (pp, bw, sps)
            if pp == 2 and bw == bandwidths[-1]:  # the slowest link, where the link binds even on two cores
                assert sps[default] == max(sps.values()), (pp, bw, sps)
