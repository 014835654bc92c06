"""`aqpipe report`: several runs on one plot and one table; bad run directories get one-line errors."""

import json

import pytest

from aqpipe.cli import main
from aqpipe.report import ReportError, load_run, report


def make_run(path, fw, losses, finished=True, evals=()):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model": "gpt2-tiny", "pp": 2, "dp": 1, "fw": fw, "bw": "directq:8",
                                                  "grad_sync": "none"}))
    lines = [json.dumps({"step": i + 1, "epoch": 0, "loss": loss}) for i, loss in enumerate(losses)]
    evaluated = dict(evals)
    lines = [json.dumps({**json.loads(line), "eval_loss": evaluated[json.loads(line)["step"]]})
             if json.loads(line)["step"] in evaluated else line for line in lines]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if finished:
        (path / "summary.json").write_text(json.dumps({
            "final_loss": losses[-1], "steps": len(losses), "samples_per_second": 12.5, "wall_seconds": 30.0,
            "link_bytes": {"fwd": 3_000_000, "bwd": 1_000_000}, "grad_sync_bytes": 0}))
    return path


def test_report_tables_every_run_and_writes_one_plot(tmp_path):
    a = make_run(tmp_path / "fp32", "fp32", [5.0, 4.0, 3.5], evals=[(3, 3.9)])
    b = make_run(tmp_path / "aq", "aqsgd:3", [5.0, 4.2, 3.6])
    c = make_run(tmp_path / "crashed", "directq:3", [5.0, 4.5], finished=False)
    table = report([str(a), str(b), str(c)], tmp_path / "out" / "report.png")
    rows = table.splitlines()
    assert len(rows) == 5
    assert "| fp32 | gpt2-tiny | 2×1 | fp32 | directq:8 | none | 3 | 3.5000 | 3.9000 | — | 12.5 | 4.0 |" in rows[2]
    assert "aqsgd:3" in rows[3] and "3.6000" in rows[3]
    assert "2 (unfinished)" in rows[4] and "4.5000" in rows[4]
    assert (tmp_path / "out" / "report.png").stat().st_size > 10_000


def test_runs_with_the_same_name_are_told_apart(tmp_path):
    a = make_run(tmp_path / "x" / "run", "fp32", [2.0, 1.0])
    b = make_run(tmp_path / "y" / "run", "aqsgd:2", [2.0, 1.5])
    table = report([str(a), str(b)], tmp_path / "r.png")
    assert str(a) in table and str(b) in table


@pytest.mark.parametrize("setup, message", [
    (lambda p: p, "not a run directory"),
    (lambda p: (p.mkdir(), p)[1], "no metrics.jsonl"),
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text("{broken\n"), p)[2], "line 1 is not JSON"),
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text(""), p)[2], "no training steps"),
])
def test_bad_run_directories_are_named(tmp_path, setup, message):
    path = setup(tmp_path / "bad")
    with pytest.raises(ReportError, match=message):
        load_run(path)


def test_command_prints_the_table_and_fails_with_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "ok", "fp32", [3.0, 2.0])
    assert main(["report", str(run), "--out", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "| ok |" in out and (tmp_path / "p.png").is_file()
    assert main(["report", str(run), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing: not a run directory" in err
