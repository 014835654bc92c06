"""Bad input gets one line on stderr and exit code 2, before any worker starts."""

import subprocess
import sys

import pytest

from aqpipe.cli import main

FAST = ["--max-samples", "64", "--seq-len", "16", "--steps", "1"]


def run_cli(capsys, args, tmp_path):
    code = main(["launch", *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model"], "unknown --model"),
    (["--model", "nosuchmodule_xyz:build"], "cannot import module"),
    (["--model", "json:no_such_function"], "no callable"),
    (["--data", "/no/such/file.txt"], "does not exist"),
    (["--pp", "0"], "--pp must be at least 1"),
    (["--pp", "-3"], "--pp must be at least 1"),
    (["--pp", "7"], "more stages than the model's 6 layers"),
    (["--dp", "0"], "--dp must be at least 1"),
    (["--pp", "two"], "--pp must be an integer"),
    (["--lr", "-0.1"], "--lr must not be negative"),
    (["--lr", "nan"], "finite number"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
    (["--micro-batch-size", "40", "--micro-batches", "4"], "batch settings do not fit"),
    (["--seq-len", "100000"], "exceeds gpt2-tiny's 256 positions"),
    (["--partition", "1,2"], "lists 2 stages but --pp is 4"),
    (["--partition", "2,2,1,2"], "covers 7 layers but the model has 6"),
    (["--partition", "bogus"], "must be parameters, time, or a comma list"),
    (["--optimizer", "lamb"], "use adamw or sgd"),
    (["--device", "tpu"], "cpu or cuda"),
    (["--fw", "aqsgd:0"], "bits must be an integer in 1..8"),
    (["--fw", "aqsgd:9"], "bits must be an integer in 1..8"),
    (["--fw", "aqsgd"], "must look like aqsgd:B"),
    (["--fw", "directq:x"], "bits must be an integer in 1..8"),
    (["--fw", "zip"], "not a forward codec"),
    (["--fw", "topk:0.2:8"], "not a forward codec"),
    (["--bw", "topk:1.5:8"], "kept fraction F must be in (0, 1]"),
    (["--bw", "topk:0:8"], "kept fraction F must be in (0, 1]"),
    (["--bw", "topk:abc:8"], "kept fraction F must be a number"),
    (["--bw", "aqsgd:2"], "not a backward codec"),
    (["--bw", "fp16:3"], "takes no parameters"),
    (["--quant-scales", "tensor"], "--quant-scales"),
    (["--quant-rounding", "up"], "--quant-rounding"),
    (["--store-dtype", "q4"], "needs --store lmdb"),
    (["--store", "lmdb", "--store-max-gb", "0"], "--store-max-gb must be positive"),
    (["--store", "lmdb", "--store-max-gb", "0.000001"], "store needs about"),
    (["--grad-sync", "marsit:0"], "use --optimizer sgd"),
    (["--grad-sync", "signsgd", "--optimizer", "adamw"], "use --optimizer sgd"),
    (["--grad-sync", "qadam:4", "--optimizer", "sgd"], "use --optimizer adamw"),
    (["--grad-sync", "gzip"], "not a gradient compressor"),
    (["--grad-sync", "topk:3"], "(0, 1]"),
    (["--store", "disk"], "not a store"),
    (["--store-dtype", "q3"], "--store-dtype"),
    (["--bandwidth", "100mbits"], "bad rate"),
    (["--resume", "no/such/run"], "is not a run directory"),
    (["--task", "classify"], "--task classify needs a BERT-family model"),
    (["--model", "bert-tiny", "--task", "lm"], "--task lm needs a causal LM"),
    (["--model", "bert-tiny", "--data", "/no/such/table.csv"], "does not exist"),
    (["--model", "bert-tiny", "--seq-len", "600"], "exceeds bert-tiny's 512 positions"),
    (["--eval-every", "-1"], "--eval-every must be at least 0"),
    (["--max-restarts", "-1"], "--max-restarts must be at least 0"),
    (["--checkpoint-replicas", "-1"], "--checkpoint-replicas must be at least 0"),
    (["--checkpoint-share", "0"], "--checkpoint-share must be above 0 and at most 1"),
    (["--checkpoint-share", "1.5"], "--checkpoint-share must be above 0 and at most 1"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["--task", "translate"], "not a task"),
    (["--schedule", "zigzag"], "not a schedule"),
    (["--weight-decay", "-1"], "--weight-decay must not be negative"),
    (["--clip", "-1"], "--clip must not be negative"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--warmup-steps", "-2"], "--warmup-steps must not be negative"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--momentum", "1.0", "--optimizer", "sgd"], "--momentum must be in [0, 1)"),
    (["--momentum", "0.9"], "--momentum applies to --optimizer sgd"),
    (["--quant-grid", "log"], "--quant-grid"),
    (["--precision", "fp8"], "--precision 'fp8' is not one of fp32, bf16, fp16"),
    (["--lora", "0"], "--lora (the adapters' rank) must be at least 1"),
    (["--lora-targets", "q_proj"], "add --lora R"),
    (["--lora", "4", "--lora-targets", "nope"], "names no module of gpt2-tiny"),
    (["--export-adapter"], "--export-adapter writes LoRA adapters: add --lora R"),
    (["--store-device", "tpu"], "--store-device 'tpu' is not one of cpu, cuda"),
    (["--store-device", "cuda", "--device", "cpu"], "needs --store memory and --device cuda"),
    (["--lora", "4", "--export-adapter"], "is initialized at random"),
    (["--fw", "rtq:9"], "bits must be an integer in 1..8"),
    (["--fw", "rtq"], "must look like rtq:B"),
    (["--fw", "tahq:4"], "tahq takes no parameters"),
    (["--bw", "tahq"], "not a backward codec"),
    (["--fw", "aqsgd-rtq:0"], "bits must be an integer in 1..8"),
    (["--bw", "aqsgd-rtq:3"], "not a backward codec"),
    (["--first-sight", "aqsgd:4"], "--first-sight 'aqsgd:4' is not a first-sight coder; use fp32, fp16, bf16"),
    (["--first-sight", "tahq"], "is not a first-sight coder"),
    (["--first-sight", "rtq:0"], "is not a first-sight coder"),
    (["--fw", "directq:4", "--first-sight", "rtq:4"], "codes the first sight of a sample on an AQ-SGD link"),
    (["--eval-codec", "aqsgd:4"], "--eval-codec 'aqsgd:4' is not an evaluation codec (one that codes each sample"),
    (["--eval-codec", "topk:0.1:4"], "is not an evaluation codec"),
    (["--eval-codec", "rtq:9"], "is not an evaluation codec"),
    (["--eval-samples", "0"], "--eval-samples must be at least 1"),
    (["--tied-exchange", "rows:fp8"],
     "--tied-exchange 'rows:fp8' is not one of rows, rows:bf16, rows:delta:B (B = 2..8 bits), dense"),
    (["--tied-exchange", "rows:delta:1"], "is not one of rows, rows:bf16, rows:delta:B"),
])
def test_bad_flags_exit_2_with_one_line(capsys, tmp_path, args, needle):
    code, err = run_cli(capsys, [*FAST, *args], tmp_path)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0] and lines[0].startswith("aqpipe: error:")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_hub_names_offline_get_a_clear_error(tmp_path):
    # In a fresh process: huggingface_hub reads HF_HUB_OFFLINE once, at import, and an earlier test may have
    # imported it here already (it then tries the network and waits for its time-outs).
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    def run(*args: str) -> tuple[int, str]:
        proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", *FAST, *args, "--out", str(tmp_path / "run")],
                              capture_output=True, text=True, env=env, timeout=120)
        return proc.returncode, proc.stderr

    code, err = run("--model", "no-such-org/no-such-model")
    assert code == 2 and "cannot fetch --model 'no-such-org/no-such-model'" in err and len(err.strip().splitlines()) == 1
    code, err = run("--data", "no_such_hub_dataset_xyz")
    # without the optional `datasets` package the error says to install the hub extra instead
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cannot load hub dataset 'no_such_hub_dataset_xyz'" in err or "install the 'hub' extra" in err


def test_data_directory_without_train_file(capsys, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "valid.txt").write_text("hello\n")
    code, err = run_cli(capsys, [*FAST, "--data", str(tmp_path / "d")], tmp_path)
    assert code == 2 and "has no train.* file" in err


@pytest.mark.parametrize("name,content,needle", [
    ("cfg.yaml", "pp: [1, 2\n", "not valid YAML"),
    ("cfg.json", "{\"pp\": 2,,}", "not valid JSON"),
    ("cfg.yaml", "- 1\n- 2\n", "must hold a mapping"),
    ("cfg.yaml", "pipeline_stages: 2\n", "unknown key(s): pipeline_stages"),
    ("cfg.yaml", "lr: fast\n", "--lr must be a number"),
])
def test_invalid_config_files(capsys, tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    code, err = run_cli(capsys, [str(path), *FAST], tmp_path)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_missing_and_unreadable_config_files(capsys, tmp_path):
    code, err = run_cli(capsys, [str(tmp_path / "absent.yaml")], tmp_path)
    assert code == 2 and "does not exist" in err
    code, err = run_cli(capsys, [str(tmp_path)], tmp_path)
    assert code == 2 and "not a file" in err


def test_config_file_values_and_flag_overrides(tmp_path):
    from aqpipe.compress.link.specs import DEFAULT_BW, DEFAULT_FW
    from aqpipe.config import build_config, load_config_file, resolve

    path = tmp_path / "cfg.yaml"
    path.write_text("pp: 2\nmicro-batches: 3\nlr: 0.01\n")
    cfg = resolve(build_config(load_config_file(str(path)), {"lr": "0.5", "pp": None}))
    assert (cfg.pp, cfg.micro_batches, cfg.lr) == (2, 3, 0.5)
    assert cfg.seq_len == 64 and (cfg.fw, cfg.bw) == (DEFAULT_FW, DEFAULT_BW)  # the preset's and the measured defaults


def test_unknown_flag_is_one_line_through_the_real_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", "--no-such-flag", "3"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "unrecognized arguments" in proc.stderr


def test_bench_with_a_bad_model_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["bench", "--model", "no-such-model", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown --model" in err[0]


@pytest.mark.parametrize("argv", [["--local_rank=1", "launch"], ["launch", "--local_rank=1"], ["launch", "--local-rank", "1"]],
                         ids=["deepspeed-module", "after-launch", "torch-launch"])
def test_the_local_rank_a_launcher_adds_is_accepted_where_it_puts_it(argv, tmp_path, capsys):
    """DeepSpeed's launcher runs `python -m aqpipe --local_rank=N launch ...` (its --module form puts the flag first);
    torch's old launcher adds `--local-rank N` at the end: both start a rank, with the flag ignored (the rank reads
    LOCAL_RANK)."""
    code = main([*argv, *FAST, "--dry-run", "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("flag, needle", [
    ("--overwrite", "--overwrite works only when aqpipe launch starts the ranks itself"),
    ("--bandwidth=100mbit", "--bandwidth works only when aqpipe launch starts the ranks itself"),
])
def test_what_only_aqpipe_launch_can_do_is_refused_under_torchrun(capsys, tmp_path, monkeypatch, flag, needle):
    """Under torchrun every restart runs the command again: an --overwrite there would delete the run each time, so
    it was ignored, and a rank refused over another run's files still advised it. Now it is refused, in one line."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("AQPIPE_CONFIG_JSON", raising=False)
    code, err = run_cli(capsys, ["--pp", "2", *FAST, flag], tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()


_TORN_DOWN = """
import sys
from aqpipe.cli import console

class Noted:
    def __del__(self):
        print("modules torn down", flush=True)

kept = Noted()  # (a module global: collected only when the interpreter tears its modules down)
sys.argv = ["aqpipe", *sys.argv[1:]]
console()
"""


@pytest.mark.parametrize("distributed", [False, True], ids=["alone", "rank-under-torchrun"])
def test_the_command_leaves_without_tearing_its_modules_down(tmp_path, distributed):
    """Tearing down torch and transformers' modules costs about a second of CPU per process for nothing: the command
    exits once its exit handlers ran, with its exit code — a rank started by torchrun or the DeepSpeed launcher too
    (its process groups are left before `main` returns)."""
    import os

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"} if distributed else dict(os.environ)
    if not distributed:
        env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-c", _TORN_DOWN, "store", "verify", str(tmp_path / "no-run")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "modules torn down" not in proc.stdout
