"""benchmarks/codec_speed.py times the link codecs its --codecs names, AQ-SGD among them, and refuses a spec it
cannot parse with a usage error."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "codec_speed.py"


def codec_speed(monkeypatch, *args: str) -> None:
    """Run the script as `python benchmarks/codec_speed.py ARGS` would, in this process (its torch already imported);
    the one compute thread it sets is undone afterwards."""
    argv = [str(SCRIPT), "--shape", "2,8,16", "--repeats", "1", "--only-codecs", *args]
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        torch.set_num_threads(threads)


def test_aqsgd_named_in_codecs_is_timed_as_a_links_two_ends_beside_a_stateless_codec(tmp_path, monkeypatch):
    out = tmp_path / "speed"
    codec_speed(monkeypatch, "--codecs", "aqsgd:3,rtq:4", "--out", str(out))
    rows = {row["codec"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert list(rows) == ["aqsgd:3", "rtq:4"]
    assert rows["aqsgd:3"]["bits"] == 3 and rows["aqsgd:3"]["rounding"] == "aqsgd codec"
    # a 3-bit delta with its scales: more than 3 bits a value, far below the first sight's fp32
    assert 3 < rows["aqsgd:3"]["bits_per_value"] < 8
    for row in rows.values():
        assert row["encode_MBps"] > 0 and row["decode_MBps"] > 0


def test_a_codec_spec_it_cannot_parse_is_a_usage_error_naming_the_flag(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        codec_speed(monkeypatch, "--codecs", "rtq:4,aqsgd:x", "--out", str(tmp_path / "speed"))
    assert exit_.value.code == 2
    assert "--codecs takes --fw specs: --fw 'aqsgd:x': bits must be an integer in 1..8" in capsys.readouterr().err
    assert not (tmp_path / "speed.json").exists()


def test_a_codec_that_cannot_code_the_shape_is_a_usage_error_before_anything_is_timed(tmp_path, monkeypatch, capsys):
    # tahq codes tiles of 64 channels: the test's hidden size of 16 is not a multiple
    with pytest.raises(SystemExit) as exit_:
        codec_speed(monkeypatch, "--codecs", "rtq:4,tahq", "--out", str(tmp_path / "speed"))
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert "--codecs tahq cannot code --shape 2,8,16: tahq quantizes tiles of 64 channels" in err
    assert "MB/s" not in out and not (tmp_path / "speed.json").exists()


def test_a_scale_granularity_it_does_not_know_is_a_usage_error(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        codec_speed(monkeypatch, "--codecs", "rtq:4", "--per", "sample", "--out", str(tmp_path / "speed"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --per: invalid choice: 'sample'" in err and "channel" in err and "token" in err
