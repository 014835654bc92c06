"""A whole job from one process's point of view: validate, then either be a rank or start all the ranks."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aqpipe.config import ConfigError, ResolvedConfig
from aqpipe.launch import netns
from aqpipe.launch.env import CONFIG_ENV, in_distributed_env, rank_from_env
from aqpipe.launch.fork_safety import fork, unsafe_to_fork
from aqpipe.launch.forkserver import ForkServer, fork_safe_environment
from aqpipe.launch.gpu_sharing import local_sharing_note
from aqpipe.launch.local import INTERRUPTED, LaunchResult, RankStarter, launch_local
from aqpipe.launch.netns import format_rate
from aqpipe.launch.rundir import RunDirectory, existing_run
from aqpipe.launch.signals import INTERRUPTS, deferred_interrupts, ignore_interrupts, interrupts_raise
from aqpipe.metrics import write_json
from aqpipe.pipeline.world.grid import Grid
from aqpipe.runtime.capacity.plan import refuse_if_unfit
from aqpipe.runtime.plan import RunPlan, make_plan


def run_job(cfg: ResolvedConfig, spec_factory=None, script_command: list[str] | None = None, progress: bool = True,
            overwrite: bool = False, starter: RankStarter | None = None, restarted: bool = False,
            script_call: int = 1) -> int:
    """Run a resolved configuration; returns the exit code (0 done, 1 failed during the run).

    Inside torchrun or the DeepSpeed launcher this process is one rank. Otherwise the run directory is locked,
    every check runs here, then every rank starts: forked from a process that has imported what ranks need
    (launch/forkserver.py; `starter`, when the caller started one earlier, else one started here: with a
    `script_command`, the Python script that calls `aqpipe.train`, run once more as far as its `script_call`-th
    call). A run directory that holds another run is refused unless `overwrite`; one that holds this run continues
    it (`continue_in_place`: `restarted` when the caller found so). The starter is closed on return.
    """
    if in_distributed_env() and CONFIG_ENV not in os.environ:
        with fork_safe_environment():  # (its imports start no thread: it forks its copies' process below)
            from aqpipe.runtime.rank.train import run_worker
        if cfg.bandwidth is not None:
            raise ConfigError("--bandwidth works only when aqpipe launch starts the ranks itself, not under torchrun "
                              "or the DeepSpeed launcher; shape the hosts' links with tc instead")
        if overwrite:  # (every restart runs the command again: it would delete the run each time)
            raise ConfigError("--overwrite works only when aqpipe launch starts the ranks itself, not under torchrun "
                              "or the DeepSpeed launcher, whose restarts would delete the run; delete --out on every "
                              "host first instead")
        if cfg.checkpoint_replicas != 0 and unsafe_to_fork() is None:
            # before it meets the others (their groups start threads), with what it imported: see preforked's module
            from aqpipe.runtime.checkpoints.copier import serve
            from aqpipe.runtime.checkpoints.preforked import prefork

            prefork(fork, serve)
        from aqpipe.runtime.checkpoints.parts import CheckpointError

        rank, world_size = rank_from_env()
        try:
            run_worker(cfg, rank, world_size, spec_factory)
        except CheckpointError as e:  # every rank finds the same: one line each, exit 2
            raise ConfigError(str(e)) from None
        return 0
    netns.require_throttling(cfg.bandwidth)
    if cfg.checkpoint_replicas:
        raise ConfigError(f"--checkpoint-replicas {cfg.checkpoint_replicas} keeps copies of each rank's checkpoint "
                          "part on other hosts, but a local launch runs every rank on this one; use it with torchrun "
                          "across hosts")
    again = restarted or continue_in_place(cfg, overwrite)
    if starter is None:  # started before planning, so that its imports run while this process plans
        starter = (ForkServer.for_script(script_command, cfg.lora, cfg.store, script_call) if script_command
                   else ForkServer.for_run(cfg.model, cfg.lora, cfg.store))
    try:
        return _claim_and_run(cfg, spec_factory, starter, progress, overwrite, again)
    finally:
        starter.close()


def continue_in_place(cfg: ResolvedConfig, overwrite: bool) -> bool:
    """A local launch over an --out that holds a run: the same run continues from its newest complete checkpoint
    (`cfg.resume` set, as with --resume), or starts again where it completed none (its state is cleared once the
    directory is locked, its logs and count of restarts kept); another run's state is refused (ConfigError, exit 2).
    Returns whether the run starts again over its own state; nothing to decide after --resume or --overwrite."""
    if cfg.resume is not None or overwrite or not existing_run(Path(cfg.out)):
        return False
    RunDirectory(cfg.out).refuse_if_in_use()  # (another launch may be writing what it holds)
    from aqpipe.runtime.checkpoints.parts import CheckpointError
    from aqpipe.runtime.checkpoints.restart import choose_start, holding

    settings = cfg.fixed_settings()
    try:
        start = choose_start([holding(cfg.out, rank, settings) for rank in range(cfg.world_size)], cfg.out,
                             explicit=False)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if start.fresh:
        print(f"aqpipe: {cfg.out} holds this run with no complete checkpoint yet: it starts again from the first step",
              file=sys.stderr, flush=True)
    else:
        cfg.resume = cfg.out
    return True


def _claim_and_run(cfg: ResolvedConfig, spec_factory, starter: RankStarter, progress: bool, overwrite: bool,
                   again: bool) -> int:
    """Lock the run directory, plan and check the run, then run its ranks (`again`: the run starts again over its
    own state, and counts it)."""
    run_dir = RunDirectory(cfg.out)
    run_dir.claim(resuming=cfg.resume is not None or again, overwrite=overwrite)
    try:
        plan = make_plan(cfg, spec_factory)
        cfg.stage_bounds = plan.bounds
        point = _resume_point(cfg, explicit=not again) if cfg.resume is not None else None
        # exit 2 with the plan's numbers rather than running out of memory (or time) mid-run
        refuse_if_unfit(plan, point.step if point is not None else None)
        if point is not None:
            _take(cfg, point, again)
            _drop_damaged_stores(cfg)
    except BaseException:
        run_dir.release(failed_before_start=True)
        raise
    try:
        run_dir.clear_previous()
        if again:
            _start_again(cfg)
        return _run_ranks(cfg, plan, starter, progress)
    finally:
        run_dir.release()


def _run_ranks(cfg: ResolvedConfig, plan, starter: RankStarter, progress: bool) -> int:
    """Start every rank with the resolved configuration, wait for the run to end, and report how it ended."""
    out = Path(cfg.out)
    write_json(out / "config.json", cfg.to_dict())
    _announce(cfg, plan)
    grid = Grid(cfg.pp, cfg.dp, 0)

    def launch(**topology) -> LaunchResult:
        # The workers get the configuration from here, never from a file another process could rewrite meanwhile.
        env = {CONFIG_ENV: json.dumps(cfg.to_dict())}
        return launch_local(starter, cfg.world_size, grid.describe, env, plan.total_steps, cfg.stall_timeout, cfg.port,
                            progress, log_dir=out / "logs", **topology)

    # SIGTERM, and SIGINT even when the parent ignores it (a shell's background job, nohup: Python then leaves
    # it ignored, and `kill -INT` would do nothing), take the interrupt path that stops the ranks and cleans up.
    previous = {sig: signal.getsignal(sig) for sig in INTERRUPTS}
    interrupts_raise()
    try:
        if cfg.bandwidth is None:
            result = _restarting(cfg, launch)
        else:
            with _topology(cfg) as topology:
                result = _restarting(cfg, functools.partial(launch, topology=topology))
    except KeyboardInterrupt:  # while the namespaces were being built or removed: nothing is left running
        result = LaunchResult(1, INTERRUPTED, interrupted=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if result.interrupted:  # on the way out: a further Ctrl-C must not turn the one-line exit into a traceback
        ignore_interrupts()
    if result.code != 0:
        print(f"aqpipe: run failed: {result.message}{_continue_hint(cfg) if result.disk_full else ''}", file=sys.stderr)
        return 1
    summary = result.summary or json.loads((out / "summary.json").read_text())
    rates = summary.get("link_rate", {}).get("fwd_bytes_per_second", [])
    links = f"; links ran at {', '.join(format_rate(8 * r) for r in rates)}" if cfg.bandwidth and rates else ""
    print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
          f"{summary['samples_per_second']:.1f} samples/s, {summary['wall_seconds']:.0f} s{links}; run directory {out}")
    if summary.get("sample"):
        print(f"held-out prompt: {summary['sample']['question']!r} -> model: {summary['sample']['answer']!r}")
    return 0


def _restarting(cfg: ResolvedConfig, launch) -> LaunchResult:
    """`launch()` of every rank, then after a failure every rank again from the newest complete checkpoint
    (from the first step where there is none), at most --max-restarts times; an interrupt, a full disk or a
    checkpoint that cannot be resumed from ends the run instead."""
    restarts = 0
    while True:
        result = launch()
        if result.code == 0 or result.interrupted or result.disk_full or restarts >= cfg.max_restarts:
            return result
        restarts += 1
        try:
            step = _restart_point(cfg)
        except ConfigError as e:
            return LaunchResult(1, f"{result.message}; no restart: {e}")
        print(f"aqpipe: {result.message}; restart {restarts} of {cfg.max_restarts}, every rank from "
              f"{f'the checkpoint of step {step}' if step else 'the first step (no checkpoint was complete)'}",
              file=sys.stderr, flush=True)


def _restart_point(cfg: ResolvedConfig) -> int | None:
    """Make the run directory ready for every rank to start again: the newest complete checkpoint checked (and
    `cfg.resume` set), or, with none, this run's state removed; returns that checkpoint's step (None: none)."""
    from aqpipe.runtime.checkpoints.parts import latest_step

    step = latest_step(cfg.out)
    cfg.resume = cfg.out if step is not None else None
    if step is not None:
        _take(cfg, _resume_point(cfg, explicit=False), say=False)  # (the restart's own line says it)
        _drop_damaged_stores(cfg)
    _start_again(cfg)
    write_json(Path(cfg.out) / "config.json", cfg.to_dict())
    return step


def _start_again(cfg: ResolvedConfig) -> None:
    """A start over the run's own state, counted in restarts.jsonl: from its newest checkpoint (`cfg.resume` set),
    or, with none, from the first step over that state cleared (its logs and count kept)."""
    from aqpipe.runtime.checkpoints.parts import latest_step
    from aqpipe.runtime.checkpoints.restart import clear_run_state, record_restart

    if cfg.resume is None:
        clear_run_state(cfg.out)
    record_restart(cfg.out, latest_step(cfg.out) if cfg.resume else None)


def _continue_hint(cfg: ResolvedConfig) -> str:
    """What to do after a run stopped on a full disk: resume from its last complete checkpoint, or start again."""
    from aqpipe.runtime.checkpoints.parts import latest_step

    step = latest_step(cfg.out)
    if step is None:
        return "; no checkpoint was complete yet: free some space and launch again with --overwrite"
    return f"; free some space, then `aqpipe launch --resume {cfg.out}` continues after step {step}"


@dataclass
class ResumePoint:
    """The checkpoint a resume continues from, and the newer one it passes over (not sound: `problem`), if any."""

    step: int
    unsound: int | None = None
    problem: str = ""


def _resume_point(cfg: ResolvedConfig, explicit: bool) -> ResumePoint:
    """The checkpoint the run to resume continues from, checked before any worker starts, nothing changed: the newest
    complete one, undamaged and written with this configuration. Where that one is not sound, `explicit` (--resume
    given) takes the newest older one that is; a restart or the same command typed again never goes back quietly:
    refused, naming it. Raises ConfigError (exit 2)."""
    from aqpipe.runtime.checkpoints.parts import CheckpointError, complete_steps, verify
    from aqpipe.runtime.checkpoints.restart import damaged

    run = cfg.resume
    if run is None:
        raise ConfigError("not a resumed run: there is no checkpoint to check")
    steps = complete_steps(run)
    if not steps:
        raise ConfigError(f"--resume {run}: no complete checkpoint under {run}/checkpoints "
                          "(the run stopped before its first --checkpoint-every)")
    settings = cfg.fixed_settings()

    def unsound(step: int) -> str | None:
        try:
            verify(run, step, cfg.world_size, settings)
        except CheckpointError as e:
            return str(e)
        return None

    problem = unsound(steps[0])
    if problem is None:
        return ResumePoint(steps[0])
    older = next((s for s in steps[1:] if unsound(s) is None), None)
    if older is None:
        raise ConfigError(f"--resume: {problem}")
    if not explicit:
        raise ConfigError(str(damaged(steps[0], problem, run, older)))
    return ResumePoint(older, steps[0], problem)


def _take(cfg: ResolvedConfig, point: ResumePoint, again: bool = False, say: bool = True) -> None:
    """Ready the run directory (locked: nothing else writes it) for the ranks to load `point`: the checkpoints after
    it set aside, incomplete ones removed; says where the run continues (`again`: over its own directory without
    --resume) unless not to `say`."""
    from aqpipe.runtime.checkpoints.parts import remove_incomplete, set_aside_steps_after
    from aqpipe.runtime.checkpoints.restart import going_back

    run = cfg.resume
    assert run is not None, "a resumed run names its run directory"
    if point.unsound is not None:
        aside = set_aside_steps_after(run, point.step)
        said = going_back(point.step, point.unsound, f"is not sound ({point.problem})")
        print(f"aqpipe: {run}: {said}; set aside: {', '.join(str(p) for p in aside)}", file=sys.stderr, flush=True)
        say = False
    for directory in remove_incomplete(run):
        print(f"aqpipe: removed {directory}, a checkpoint its run did not finish writing", file=sys.stderr, flush=True)
    if say:
        step = point.step
        said = f"{run} holds this run: it continues after step {step}" if again else f"resuming {run} after step {step}"
        print(f"aqpipe: {said}", file=sys.stderr, flush=True)


def _drop_damaged_stores(cfg: ResolvedConfig) -> None:
    """Before a resume: every rank's LMDB m(ξ) store opens and walks, or it is removed (m(ξ) can always be rebuilt:
    the resumed ranks find its samples on one side of their links only and re-seed them at full precision)."""
    if cfg.store != "lmdb":
        return
    from aqpipe.storage.health import drop_if_damaged
    from aqpipe.storage.lmdb_store import store_path

    for rank in range(cfg.world_size):
        drop_if_damaged(store_path(cfg.out, rank), rank)


@contextlib.contextmanager
def _topology(cfg: ResolvedConfig):
    """The throttled namespaces of a --bandwidth run; a failure to build them is a configuration error."""
    # named here, so that a signal between the topology's being built and its being handed over (create's own
    # clean-up over, ours not begun) still finds it to remove; a name clash (another launch's) is not ours to remove
    name, ours = netns.new_name(), True
    assert cfg.bandwidth_bits is not None, "a topology is built for a --bandwidth run only"
    try:
        try:
            topology = netns.create(cfg.world_size, cfg.bandwidth_bits, name=name)
        except netns.NetnsError as e:
            ours = False  # (create left nothing behind)
            raise ConfigError(f"--bandwidth {cfg.bandwidth}: {e}") from None
        print(f"aqpipe: every rank in its own network namespace (aqpipe-{topology.name}-*), links shaped to "
              f"{format_rate(topology.rate_bits)} by tc tbf", file=sys.stderr, flush=True)
        yield topology
    finally:
        if ours:
            with deferred_interrupts():  # a second Ctrl-C must not leave namespaces behind
                start = time.monotonic()
                if netns.registered(name):
                    netns.destroy(name)
                if time.monotonic() - start > 2.0:  # the kernel can be slow to tear namespaces down; say so
                    print(f"aqpipe: removing the network namespaces took {time.monotonic() - start:.0f} s",
                          file=sys.stderr, flush=True)


def _announce(cfg: ResolvedConfig, plan) -> None:
    sizes = [plan.bounds[i + 1] - plan.bounds[i] for i in range(cfg.pp)]
    print(f"aqpipe: {cfg.model} ({len(plan.spec)} layers as {sizes} over {cfg.pp} stages) x {cfg.dp} replica(s) "
          f"on {cfg.device}; {len(plan.dataset.train)} samples of {cfg.seq_len} tokens, {plan.total_steps} steps; "
          f"fw {cfg.fw}, bw {cfg.bw}; run directory {cfg.out}", file=sys.stderr, flush=True)
    for note in (warmup_note(plan), local_sharing_note(cfg.device, cfg.world_size)):
        if note:
            print(f"aqpipe: note: {note}", file=sys.stderr, flush=True)


def warmup_note(plan: RunPlan) -> str | None:
    """What to tell a user whose lossy --fw/--bw never applies because every step lies in the fp32 warm-up."""
    cfg, total_steps = plan.cfg, plan.total_steps
    if (cfg.fw_spec.lossless and cfg.bw_spec.lossless) or total_steps <= 0 or plan.compresses(total_steps - 1):
        return None
    return (f"all {total_steps} steps lie in the first {cfg.warmup_epochs} epoch(s) of {plan.steps_per_epoch} steps, "
            f"which --warmup-epochs sends in fp32 (AQ-SGD fills m(xi) then): the links never compress with "
            f"--fw {cfg.fw} --bw {cfg.bw}; train longer (--epochs, --steps) or lower --warmup-epochs")
