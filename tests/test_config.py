"""The one definition of the settings: sections, typed values, the resume rule, and the CLI and README generated
from it."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from aqpipe.cli import _parser
from aqpipe.config import RESUME_MAY_CHANGE, SECTIONS, ConfigError, RunConfig, build_config, resume_values, settings
from aqpipe.config.reference import BEGIN, END, flag, flag_help, markdown_reference
from aqpipe.config.values import value_type

ROOT = Path(__file__).resolve().parents[1]
# A value of each type that differs from every field's default.
OTHER = {bool: True, int: 7, float: 0.125, str: "other"}


def test_every_setting_has_a_section_help_and_a_type_the_loader_knows():
    for name, setting in settings().items():
        assert setting.section in SECTIONS, name
        assert len(flag_help(name)) > 10 and "{" not in flag_help(name), name
        assert value_type(name) in (bool, int, float, str), (name, value_type(name))
    assert set(settings()) == {f for f in RunConfig.__dataclass_fields__ if f != "stage_bounds"}


def test_values_are_typed_by_their_fields_annotation():
    cfg = build_config({"lora_alpha": 8, "clip": "0.5", "recompute": "on"}, {"lora": "4", "store_max_gb": "2"})
    assert (cfg.lora_alpha, cfg.clip, cfg.recompute, cfg.lora, cfg.store_max_gb) == (8.0, 0.5, True, 4, 2.0)
    assert isinstance(cfg.lora_alpha, float) and isinstance(cfg.lora, int)
    with pytest.raises(ConfigError, match="--lora-alpha must be a number"):
        build_config({}, {"lora_alpha": "many"})
    with pytest.raises(ConfigError, match="--port must be an integer"):
        build_config({"port": 1.5}, {})


def test_the_resume_rule_is_the_definitions(tmp_path):
    """Each setting given anew on --resume is taken when the definition marks it, and refused naming it otherwise."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(RunConfig(out=str(run)).to_dict()))
    for name in settings():
        if name in ("resume", "out"):
            continue
        value = OTHER[value_type(name)]
        if name in RESUME_MAY_CHANGE:
            assert resume_values(str(run), {}, {name: value})[name] == value, name
        else:
            with pytest.raises(ConfigError, match=f"{flag(name)} cannot change on --resume"):
                resume_values(str(run), {}, {name: value})
    assert "recompute" in RESUME_MAY_CHANGE and "seed" not in RESUME_MAY_CHANGE


def test_help_shows_every_setting_in_its_section():
    text = _parser()._subparsers._group_actions[0].choices["launch"].format_help()
    for title in SECTIONS.values():
        assert f"\n{title}:\n" in text, title
    flat = " ".join(text.split())
    for name in settings():
        assert flag(name) in flat, name
        assert " ".join(flag_help(name).replace("`", "").split())[:40] in flat, name
    resume = " ".join(flag_help("resume").split())
    assert all(flag(name) in resume for name in RESUME_MAY_CHANGE if name not in ("resume", "out"))


def test_the_documented_reference_is_generated_from_the_definition():
    page = (ROOT / "docs" / "configuration.md").read_text()
    between = page.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert between == markdown_reference().strip(), (
        "regenerate: python -m aqpipe.config.reference --update docs/configuration.md")
    out = subprocess.run([sys.executable, "-m", "aqpipe.config.reference"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == between


@pytest.mark.parametrize("bounds", [[0, "x"], [0, 2.5], "0,2", [0, True]])
def test_a_config_files_stage_bounds_that_are_not_integers_exit_2_with_one_line(tmp_path, capsys, bounds):
    """`[0, "x"]` in a config file stops the launch with one line, exit 2, not a ValueError's traceback."""
    from aqpipe.cli import main

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"stage_bounds": bounds}))
    assert main(["launch", str(config), "--out", str(tmp_path / "run"), "--dry-run"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "stage_bounds" in lines[0] and "a list of integers" in lines[0], lines


def test_the_resolved_configuration_hands_out_the_parsed_grad_sync_that_nothing_parses_again(monkeypatch, tmp_path):
    """--grad-sync is parsed where the configuration is resolved; planning a run with replicas (its bytes per step,
    memory copies, optimizer state), building the sync of a DP group and the facts its replicas compare take the
    parsed value and parse no text again."""
    import torch

    from aqpipe.compress.grad import methods, registry
    from aqpipe.compress.grad.base import DPGroup
    from aqpipe.config import resolve
    from aqpipe.pipeline.links.rendezvous import replica_gpu_facts
    from aqpipe.runtime.capacity.plan import plan_capacity
    from aqpipe.runtime.plan import make_plan

    cfg = resolve(RunConfig(model="gpt2-tiny", pp=2, dp=2, grad_sync="powersgd:3", seq_len=32, max_samples=32,
                            micro_batch_size=4, micro_batches=2, device="cpu", out=str(tmp_path / "run")))
    assert cfg.grad_spec == methods.GradSpec("powersgd", (3,))

    def parsed_again(*args, **kwargs):
        raise AssertionError(f"--grad-sync parsed again: {args}")

    monkeypatch.setattr(methods, "parse_grad_spec", parsed_again)
    capacity = plan_capacity(make_plan(cfg))
    assert all(stage.sync.steady > 0 for stage in capacity.stages)
    sync = registry.build_grad_sync(cfg.grad_spec, DPGroup(None, (0,), 0))
    assert sync.name == "powersgd:3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    assert "NVIDIA H200" in str(replica_gpu_facts(cfg.grad_spec, 2, torch.device("cuda", 0)))  # (powersgd: replica-computed)


def test_the_resolved_configuration_hands_out_parsed_codec_specs_that_nothing_parses_again(monkeypatch):
    """--fw, --bw, --first-sight and --eval-codec are parsed where the configuration is resolved; building the run's
    codecs from what it hands out (an AQ-SGD link with a coded first sight, the evaluation codec), sizing their
    messages, and `aqpipe bench` timing its candidate codecs and weighing their bytes parse no spec again."""
    import torch

    from aqpipe.compress.link import factory, specs
    from aqpipe.compress.link.factory import build_codec, message_bytes
    from aqpipe.compress.link.options import QuantOptions
    from aqpipe.config import resolve
    from aqpipe.storage import MemoryStore, StoreView

    cfg = resolve(RunConfig(fw="aqsgd:3", bw="rtq:4", first_sight="rtqo:3", eval_codec="rtqo:7"))
    assert (cfg.fw_spec, cfg.bw_spec) == (specs.CodecSpec("aqsgd", 3), specs.CodecSpec("rtq", 4))
    assert (cfg.first_sight_spec, cfg.eval_spec) == (specs.CodecSpec("rtqo", 3), specs.CodecSpec("rtqo", 7))
    assert cfg.keeps_messages and not resolve(RunConfig(fw="directq:4")).keeps_messages

    def parsed_again(*args, **kwargs):
        raise AssertionError(f"a spec parsed again: {args}")

    for name in ("parse_spec", "check_sample_coder", "check_first_sight", "check_eval_codec"):
        monkeypatch.setattr(specs, name, parsed_again)
    monkeypatch.setattr(factory, "parse_spec", parsed_again)
    view = StoreView(MemoryStore(torch.float16), 0, "send")
    codec = build_codec(cfg.fw_spec, "fw", view, QuantOptions(), first_sight=cfg.first_sight_spec)
    assert codec.first_sight is not None and codec.first_sight.name == "rtqo:3"
    build_codec(cfg.eval_spec, "fw")
    shape = (4, 8, 64)
    assert message_bytes(cfg.fw_spec, "fw", shape, torch.float32, QuantOptions(), cfg.first_sight_spec, True) == \
        4 + 4 * codec.first_sight.sample_bytes(shape)
    from aqpipe.bench import codec_speeds, recommend  # `aqpipe bench`: its candidate codecs timed, and the advice
    from aqpipe.runtime.capacity.links import LinkNeeds

    speeds = codec_speeds(cfg, (2, 4, 16), torch.device("cpu"))
    assert {"fp32", "aqsgd:2", "directq:8", "rtq:4", "rtqo:3"} <= speeds.keys()
    assert recommend(LinkNeeds(0, (2, 4, 16), "float32", 0, 0, 0, 0, 0), cfg, 1e12, 0.05)[:2] == (8, False)


def count_parses(monkeypatch, name: str, module, *readers) -> Counter:
    """Every call of `module.<name>` counted by its arguments, wherever it is called from (`readers`: the modules that
    imported the name); the live count."""
    calls: Counter = Counter()
    parse = getattr(module, name)

    def counted(*args):
        calls[args] += 1
        return parse(*args)

    for where in (module, *readers):
        monkeypatch.setattr(where, name, counted)
    return calls


@pytest.mark.parametrize("given, parsed", [(None, ("rows:delta:4", True, "float32", 4)),
                                           ("rows:bf16", ("rows:bf16", True, "bfloat16", 0)),
                                           ("dense", ("dense", False, "float32", 0))])
def test_resolving_parses_the_tied_exchange_and_the_bandwidth_once(monkeypatch, given, parsed):
    """--tied-exchange (given, or its default beside compressing links) and --bandwidth are parsed once, by `resolve`,
    and handed out parsed: what the rank, the capacity plan and the launcher read parses nothing again."""
    import importlib

    from aqpipe.config import checks, rates, resolve
    from aqpipe.pipeline.vocab import tied_exchanges

    settings_module = importlib.import_module("aqpipe.config.settings")  # (`aqpipe.config.settings` names a function)
    exchanges = count_parses(monkeypatch, "parse_exchange", tied_exchanges, settings_module, checks)
    rate_parses = count_parses(monkeypatch, "parse_rate", rates, settings_module, checks)
    cfg = resolve(RunConfig(tied_exchange=given, bandwidth="100mbit"))
    for _ in range(2):
        assert cfg.tied_spec == tied_exchanges.TiedExchange(*parsed) and cfg.bandwidth_bits == 100_000_000
    assert (exchanges, rate_parses) == ({(parsed[0],): 1}, {("100mbit",): 1}), (exchanges, rate_parses)
    assert resolve(RunConfig()).bandwidth_bits is None


def test_a_tied_exchange_that_is_not_one_is_refused_with_the_choices():
    from aqpipe.config import resolve

    with pytest.raises(ConfigError, match=r"--tied-exchange 'rows:delta:9' is not one of rows, rows:bf16, rows:delta:B"):
        resolve(RunConfig(tied_exchange="rows:delta:9"))


@pytest.mark.parametrize("fw, first_sight, first", [("aqsgd:3", None, "rtqo:3"), ("aqsgd:3", "rtq:4", "rtq:4"),
                                                    ("directq:4", None, "fp32")])
def test_resolving_parses_each_codec_and_grad_sync_setting_once(monkeypatch, fw, first_sight, first):
    """`resolve` parses --fw, --bw, --first-sight (given, or its default: rtqo:3 on AQ-SGD links, else fp32),
    --eval-codec and --grad-sync to check them, and the resolved configuration hands out those parsed values: reading
    them parses nothing again (nor does a copy of it, beyond its own strings once)."""
    import importlib

    from aqpipe.compress.grad import methods
    from aqpipe.compress.link import specs
    from aqpipe.config import resolve

    settings_module = importlib.import_module("aqpipe.config.settings")  # (`aqpipe.config.settings` names a function)
    spec_parses = count_parses(monkeypatch, "parse_spec", specs, settings_module)
    grad_parses = count_parses(monkeypatch, "parse_grad_spec", methods, settings_module)
    cfg = resolve(RunConfig(fw=fw, bw="directq:6", first_sight=first_sight, eval_codec="rtq:8", grad_sync="powersgd:2"))
    handed_out = (cfg.fw_spec, cfg.bw_spec, cfg.first_sight_spec, cfg.eval_spec, cfg.grad_spec, cfg.keeps_messages)
    assert [str(spec) for spec in handed_out[:4]] == [fw, "directq:6", first, "rtq:8"]
    assert handed_out[4] == methods.GradSpec("powersgd", (2,)) and handed_out[5] == fw.startswith("aqsgd")
    once = {(fw, "fw"): 1, ("directq:6", "bw"): 1, (first, "fw"): 1, ("rtq:8", "fw"): 1}
    assert (spec_parses, grad_parses) == (once, {("powersgd:2",): 1}), (spec_parses, grad_parses)
    import dataclasses

    copy = dataclasses.replace(cfg, bw="rtq:4")  # (a copy with another string parses its own, once)
    assert (str(copy.bw_spec), str(copy.bw_spec), copy.fw_spec) == ("rtq:4", "rtq:4", cfg.fw_spec)
    assert spec_parses == {**once, (fw, "fw"): 2, ("rtq:4", "bw"): 1}, spec_parses
