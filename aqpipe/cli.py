"""The `aqpipe` command: launch a run, and the tools around runs."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from aqpipe.config import ConfigError, ResolvedConfig, build_config, load_config_file, resolve, resume_values, settings
from aqpipe.config.reference import flag, flag_help, shown_default, value_name
from aqpipe.config.settings import LAUNCH_SWITCHES, SECTIONS
from aqpipe.config.values import one_line
from aqpipe.disk import DiskFullError
from aqpipe.launch.env import in_distributed_env
from aqpipe.launch.rundir import RunDirectory
from aqpipe.launch.signals import dump_stacks_on_sigusr1, ignore_interrupts, interrupts_raise
from aqpipe.lifetime import leave


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"aqpipe: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aqpipe", description="Pipeline-parallel training over slow networks with AQ-SGD.")
    # A launcher's rank flag, ignored (a rank reads LOCAL_RANK): DeepSpeed's `--module aqpipe` puts it before the
    # command, torch's old launcher after every argument
    parser.add_argument("--local_rank", "--local-rank", dest="_local_rank", help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    launch = sub.add_parser("launch", help="train a model split into pipeline stages")
    groups = _add_run_flags(launch)
    launch.add_argument("--local_rank", "--local-rank", dest="_local_rank", help=argparse.SUPPRESS)
    for name, section, text in LAUNCH_SWITCHES:
        groups[section].add_argument(flag(name), dest=name, action="store_true", help=_escaped(text))
    store = sub.add_parser(
        "store", help="inspect the activation store of a run (verify, stats, digest)",
        description="verify: compare both copies of m(xi) on every link (a side whose store is on another host is "
                    "read from the DIGESTS file `aqpipe store digest` wrote there). stats: entries, bytes and "
                    "compression per link and side, and the rewind journals' bytes. digest: write a digest of every "
                    "m(xi) value of the stores on this host (to --out, default stdout) for a verify on another host.")
    store.add_argument("action", choices=["verify", "stats", "digest"])
    store.add_argument("run_dir")
    store.add_argument("digests", nargs="*", metavar="DIGESTS", help="digest files of the other hosts (verify)")
    store.add_argument("--out", dest="digest_out", help="where `digest` writes (default: standard output)")
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


def _add_run_flags(command: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """A config file argument and one flag per setting, grouped by section (launch and bench read the same run);
    returns the groups by section."""
    command.add_argument("config", nargs="?", help="YAML or JSON file of flag values (flags override it)")
    groups = {section: command.add_argument_group(title) for section, title in SECTIONS.items()}
    for name, setting in settings().items():
        default = shown_default(name)
        text = _escaped(flag_help(name) + (f" (default: {default})" if default else "")).replace("`", "")
        metavar = value_name(name)
        if metavar is None:  # a switch: present means on (a config file may say true/false)
            groups[setting.section].add_argument(flag(name), dest=name, default=None, action="store_const",
                                                 const=True, help=text)
        else:
            groups[setting.section].add_argument(flag(name), dest=name, default=None, metavar=metavar, help=text)
    return groups


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def console() -> NoReturn:
    """The `aqpipe` command (and `python -m aqpipe`): run `main`, then leave without tearing down what it imported
    (`lifetime.leave`): a launcher, and a rank under torchrun or the DeepSpeed launcher alike (a rank has left its
    process groups before `main` returns)."""
    leave(main())


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


def _store(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from aqpipe.storage.inspect import DamagedStore, InspectError, digests, stats, verify

    try:
        if args.digests and args.action != "verify":
            raise InspectError(f"only `aqpipe store verify` takes digest files, not `{args.action}`")
        if args.action == "digest":
            text = json.dumps(digests(args.run_dir), sort_keys=True) + "\n"
            if args.digest_out:
                Path(args.digest_out).write_text(text)
            else:
                sys.stdout.write(text)
            return 0
        if args.action == "verify":
            compared, problems = verify(args.run_dir, args.digests)
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
        if rows[-1]["journal_checkpoints"]:
            steps = ", ".join(map(str, rows[-1]["journal_checkpoints"]))
            print(f"rewind journals: {rows[-1]['journal_bytes'] / 1e6:.3f} MB; every store here rewinds to the checkpoint(s) "
                  f"of step(s) {steps}")
        if rows[-1]["elsewhere"]:
            print(f"not on this host (another host's, or missing): the stores of rank(s) "
                  f"{', '.join(map(str, rows[-1]['elsewhere']))}")
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
            nccl = " ".join(f"{name}={value}" for name, value in netns.THROTTLED_NCCL.items())
            print(f"run rank K with: ip netns exec {topo.namespace(0)[:-1]}K <command>  "
                  f"(MASTER_ADDR={topo.address(0)}, GLOO_SOCKET_IFNAME={netns.INTERFACE}; with a GPU per rank also "
                  f"{nccl}); remove with: aqpipe netns down {topo.name}")
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


def _resolve(file_values: dict, flags: dict, resume: str | None) -> ResolvedConfig:
    """The run's configuration, resolved and checked. A resumed run's recorded settings that no longer hold
    together were edited after its last checkpoint: the refusal names the edited setting (the cause), not what the
    edit broke (a --first-sight left by an --fw edited away from AQ-SGD)."""
    try:
        return resolve(build_config(file_values, flags))
    except ConfigError:
        if resume:
            _refuse_an_edited_config(str(resume), file_values)
        raise


def _refuse_an_edited_config(run: str, values: dict) -> None:
    """Raise a ConfigError naming the first setting of `values` (a resumed run's config.json) that differs from
    what its newest checkpoint was written with; nothing if none does or the checkpoint cannot say."""
    import json

    from aqpipe.config.settings import RESUME_MAY_CHANGE
    from aqpipe.runtime.checkpoints.parts import CheckpointError, changed_setting, latest_step

    step = latest_step(run)
    if step is None:
        return
    fixed = json.loads(json.dumps({k: v for k, v in values.items() if k not in RESUME_MAY_CHANGE}))
    try:
        changed = changed_setting(run, step, fixed)
    except CheckpointError:
        return  # (the resume's own checks name a damaged checkpoint once the configuration resolves)
    if changed:
        raise ConfigError(f"--resume: {changed}")


def _launch(args: argparse.Namespace) -> int:
    dump_stacks_on_sigusr1()
    flags, file_values = _run_values(args)
    resume = flags.get("resume") or file_values.get("resume")
    if resume:
        file_values, flags = resume_values(str(resume), file_values, flags), {}
    from aqpipe.launch.netns import require_throttling

    if args.dry_run or in_distributed_env():
        from aqpipe.launch.forkserver import fork_safe_environment

        with fork_safe_environment():  # (a rank forks its checkpoint copies' process once its imports are done)
            cfg = _resolve(file_values, flags, resume)
            from aqpipe.launch.job import run_job
        if args.dry_run:
            return _dry_run(cfg)
        return run_job(cfg, progress=not args.no_progress, overwrite=args.overwrite)
    from aqpipe.launch.forkserver import ForkServer, fork_safe_environment

    with fork_safe_environment():  # no CUDA driver initialised by asking whether there is a GPU
        cfg = _resolve(file_values, flags, resume)
    require_throttling(cfg.bandwidth)
    from aqpipe.launch.job import continue_in_place

    run_dir = RunDirectory(cfg.out)
    run_dir.refuse_if_in_use()  # (before what the directory holds is read: another launch may be writing it)
    again = continue_in_place(cfg, args.overwrite)
    run_dir.precheck(resuming=cfg.resume is not None or again, overwrite=args.overwrite)
    # Before anything else starts a thread: import what the ranks need here (planning needs the same modules), then
    # fork the server the ranks will be forked from.
    starter = ForkServer.forked_here(cfg.model, cfg.lora, cfg.store)
    try:
        from aqpipe.launch.job import run_job

        return run_job(cfg, progress=not args.no_progress, overwrite=args.overwrite, starter=starter, restarted=again)
    finally:
        starter.close()


def _run_values(args: argparse.Namespace) -> tuple[dict, dict]:
    """The run's settings as given: the flags (None where not given) and the config file's values."""
    flags = {name: getattr(args, name) for name in settings()}
    return flags, load_config_file(args.config) if args.config else {}


def _bench(args: argparse.Namespace) -> int:
    """Measure what the plan of this run needs on this machine and recommend link codecs."""
    from aqpipe.bench import format_bench, run_bench
    from aqpipe.config.checks import bandwidth_bits
    from aqpipe.runtime.plan import make_plan

    flags, file_values = _run_values(args)
    rate = flags.pop("bandwidth", None) or file_values.pop("bandwidth", None)  # a rate to plan for, not to shape
    planned = bandwidth_bits(str(rate)) if rate else None
    cfg = resolve(build_config(file_values, flags))
    print(format_bench(run_bench(make_plan(cfg), planned), cfg), flush=True)
    return 0


def _dry_run(cfg: ResolvedConfig) -> int:
    """Print the capacity plan of a launch and start nothing (the run directory is not touched); exit 2 when the
    run would not fit."""
    from aqpipe.runtime.capacity.plan import TraceError, plan_capacity, steps_outlasting_the_stall_timeout
    from aqpipe.runtime.capacity.table import format_plan
    from aqpipe.runtime.plan import check_store_capacity, make_plan

    plan = make_plan(cfg, check_store=False, planning=True)  # a store that does not fit is one of the plan's findings
    try:
        capacity = plan_capacity(plan)
    except TraceError as e:
        raise ConfigError(f"--dry-run: {e}") from None
    try:
        check_store_capacity(cfg, plan.spec, len(plan.dataset.train))
    except ConfigError as e:
        capacity.problems.append(str(e))
    slow = steps_outlasting_the_stall_timeout(capacity)
    if slow is not None:
        capacity.problems.append(slow)
    print(format_plan(capacity), flush=True)
    if capacity.problems:
        raise ConfigError("the run does not fit: " + "; ".join(capacity.problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
