"""The capacity plan's step time against --stall-timeout (aqpipe.runtime.capacity.plan): the least time the wire
allows each phase of a step still ahead (a warm-up's lossless links, an AQ-SGD first epoch's first sights, the grad
sync's fp32 first steps), counted per rank, and a run (or a resume) whose step would outlast the stall clock refused
up front with exit 2, naming both numbers."""

import pytest

from aqpipe.cli import main
from aqpipe.compress.grad.registry import sync_step_bytes
from aqpipe.runtime.capacity import plan as cap
from aqpipe.runtime.capacity.table import format_plan
from aqpipe.runtime.plan import make_plan
from tests.test_capacity import SMALL, flags_to_config


@pytest.mark.parametrize("extra, stall, refused", [
    (["--warmup-epochs", "1"], "3", "4.2 s per step during the warm-up (lossless links)"),
    (["--warmup-epochs", "0", "--first-sight", "fp32"], "1", "s per step during the first epoch (every sample a first"),
    (["--warmup-epochs", "0", "--first-sight", "rtq:4"], "0.5", "0.7 s per step during the first epoch"),
    (["--warmup-epochs", "1"], "30", None)])
def test_a_run_whose_links_keep_a_step_longer_than_the_stall_timeout_is_refused(tmp_path, capsys, extra, stall,
                                                                                  refused):
    """The launcher's stall clock and every collective of a step give up after --stall-timeout, so such a run would
    fail at its first slow step (after it had set everything up): it is refused up front, naming both numbers. The
    first epoch of an AQ-SGD run without a warm-up sends first sights, more than the deltas after it (0.66 s here)."""
    out = tmp_path / "run"
    for dry_run in (["--dry-run"], [] if refused else None):  # (an accepted run is not started: its plan says so)
        if dry_run is None:
            continue
        code = main(["launch", *SMALL, "--model", "gpt2-tiny", *extra, "--epochs", "2", "--bandwidth", "1mbit",
                     "--stall-timeout", stall, *dry_run, "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        if refused is None:
            assert code == 0, err
        else:
            assert code == 2 and len(err) == 1 and refused in err[0] and f"--stall-timeout ({stall} s" in err[0], err
            assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("warmup, first_sights, first_step, ahead", [
    ("1", "aqsgd:3", 0, ["warm-up", "steady"]), ("1", "aqsgd:3", 2, ["steady"]),
    ("0", "aqsgd:3", 0, ["first epoch", "steady"]), ("0", "aqsgd:3", 1, ["first epoch", "steady"]),
    ("0", "aqsgd:3", 2, ["steady"]), ("0", "directq:4", 0, ["steady"]), ("2", "aqsgd:3", 0, ["warm-up"]),
    ("0", "aqsgd:3", 4, [])])
def test_the_phases_a_run_still_has_ahead(tmp_path, warmup, first_sights, first_step, ahead):
    """What a (resumed) run's steps from `first_step` on send: a warm-up's lossless links, an AQ-SGD first epoch's
    first sights, then deltas; 2 epochs of 2 steps here. A resume past the warm-up is not refused for the warm-up."""
    cfg = flags_to_config([*SMALL, "--warmup-epochs", warmup, "--fw", first_sights, "--epochs", "2"], tmp_path)
    capacity = cap.plan_capacity(make_plan(cfg))
    assert (capacity.steps, capacity.steps_per_epoch) == (4, 2)
    assert capacity.phases_ahead(first_step) == ahead


@pytest.mark.parametrize("grad_sync, refused", [("none", "of it the grad sync's, --grad-sync none at --dp 2)"),
                                                ("powersgd:2", "of it the grad sync's in its first steps (fp32), "
                                                               "--grad-sync powersgd:2 at --dp 2)"),
                                                ("signsgd", None)])
def test_a_run_whose_grad_sync_keeps_a_step_longer_than_the_stall_timeout_is_refused(tmp_path, capsys, grad_sync,
                                                                                      refused):
    """Replicas all-reduce their stage's gradient after every step: fp32 at 1 Mbit/s that is 30 s for gpt2-tiny's first
    stage (and PowerSGD's first steps send fp32 too), where the links need under a second, so such a run failed at its
    first step after --stall-timeout. A compressed sync that fits is accepted; the plan shows each stage's bytes."""
    out = tmp_path / "run"
    code = main(["launch", "--model", "gpt2-tiny", "--pp", "2", "--dp", "2", "--grad-sync", grad_sync, "--optimizer",
                 "sgd", "--bandwidth", "1mbit", "--stall-timeout", "10", "--dry-run", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    if refused is None:
        assert code == 0, err
    else:
        assert code == 2 and len(err) == 1 and refused in err[0] and "--stall-timeout (10 s" in err[0], err
    cfg = flags_to_config(["--model", "gpt2-tiny", "--pp", "2", "--dp", "2", "--grad-sync", grad_sync, "--optimizer",
                           "sgd", "--bandwidth", "1mbit"], tmp_path)
    capacity = cap.plan_capacity(make_plan(cfg))
    first = capacity.stages[0]
    assert first.sync == sync_step_bytes(grad_sync, 2, first.synced_shapes) and first.sync.steady > 0
    assert "grad sync on the wire (per replica and step): stage 0 " in format_plan(capacity)
    seconds = capacity.step_wire_seconds("steady") - capacity.link_bound_step_seconds("steady")
    assert seconds == pytest.approx(8 * max(s.sync.steady for s in capacity.stages) / 1e6)


@pytest.mark.parametrize("method, costly_steps", [("powersgd:2", 2), ("fft:0.5:8", 3), ("qadam:4", None)])
def test_a_resume_is_refused_only_while_the_grad_sync_still_has_fp32_first_steps_ahead(tmp_path, method, costly_steps):
    """PowerSGD's first 2 steps, fft's 3 calibration steps and qadam's warm-up (until v freezes) exchange fp32 values:
    a run resumed before their end meets them again (their counters are checkpointed), one resumed after does not."""
    import dataclasses

    from aqpipe.compress.grad.qadam import freeze_step
    from aqpipe.runtime.checkpoints import parts as ck

    cfg = flags_to_config(["--model", "gpt2-tiny", "--pp", "2", "--dp", "2", "--grad-sync", method, "--optimizer",
                           "adamw" if method.startswith("qadam") else "sgd", "--bandwidth", "1mbit", "--stall-timeout",
                           "10", "--steps", "40"], tmp_path / "run")
    plan = make_plan(cfg)
    costly_steps = costly_steps or freeze_step(plan.total_steps, cfg.warmup_steps)
    capacity = cap.plan_capacity(plan)
    assert {s.sync.costly_steps for s in capacity.stages} == {costly_steps}
    assert "in its first steps (fp32)" in cap.steps_outlasting_the_stall_timeout(capacity)
    for step, refused in ((costly_steps - 1, True), (costly_steps, False)):
        run = tmp_path / f"resumed-{step}"
        for rank in range(cfg.world_size):
            ck.save_rank(run, step, rank, {}, {})
        ck.mark_complete(run, step, cfg.world_size, {})
        resumed = dataclasses.replace(capacity, cfg=dataclasses.replace(cfg, resume=str(run)))
        assert (cap.steps_outlasting_the_stall_timeout(resumed) is not None) == refused, (step, refused)
    # a resume that goes back past its newest checkpoint (not sound) to an older one meets what lies after that one
    assert cap.steps_outlasting_the_stall_timeout(resumed, first_step=costly_steps - 1) is not None


def test_a_resume_counts_the_fp16_steps_that_skipped_the_grad_sync(tmp_path):
    """Under fp16 a step whose gradients overflowed skips its update and the grad sync with it, so PowerSGD's two
    fp32 steps may still be ahead of a run resumed after step 2 (metrics.jsonl records each skipped step): the plan
    took the steps for syncs and let such a resume meet its costliest steps unannounced."""
    import dataclasses
    import json

    from aqpipe.runtime.checkpoints import parts as ck

    cfg = flags_to_config(["--model", "gpt2-tiny", "--pp", "2", "--dp", "2", "--grad-sync", "powersgd:2", "--optimizer",
                           "sgd", "--precision", "fp16", "--bandwidth", "1mbit", "--stall-timeout", "10", "--steps", "40"],
                          tmp_path / "run")
    capacity = cap.plan_capacity(make_plan(cfg))
    for skipped, refused in ((0, False), (1, True)):
        run = tmp_path / f"skipped-{skipped}"
        for rank in range(cfg.world_size):
            ck.save_rank(run, 2, rank, {}, {})
        ck.mark_complete(run, 2, cfg.world_size, {})
        records = [{"step": step, "skipped": step <= skipped} for step in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        resumed = dataclasses.replace(capacity, cfg=dataclasses.replace(cfg, resume=str(run)))
        assert (cap.steps_outlasting_the_stall_timeout(resumed) is not None) == refused, skipped


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_least_step_time_waits_for_each_stage_link_traffic_then_its_own_grad_sync(tmp_path, schedule):
    """A stage's grad sync begins after its last backward pass, which waits for its own link's traffic, not for every
    link: adding the slowest sync to the slowest link's time overstated the bound (and could refuse a run that fits).
    gpt2-tiny's last of 3 stages has the largest gradient."""
    cfg = flags_to_config(["--model", "gpt2-tiny", "--pp", "3", "--dp", "2", "--schedule", schedule, "--grad-sync",
                           "none", "--bandwidth", "1mbit"], tmp_path)
    capacity = cap.plan_capacity(make_plan(cfg))
    syncs = [8 * s.sync.steady / 1e6 for s in capacity.stages]
    assert syncs[2] == max(syncs)
    traffic = capacity.rank_traffic()
    if schedule == "gpipe":  # the slowest rank's forward half, then the last rank's backward half
        before = max(max(t.forward_out, t.forward_in) for t in traffic) + max(traffic[2].backward_out,
                                                                               traffic[2].backward_in)
    else:
        before = traffic[2].most_each_way
    seconds, sync = capacity.wire_bound()
    assert (seconds, sync) == pytest.approx((8 * before / 1e6 + syncs[2], syncs[2]))
    assert seconds <= capacity.link_bound_step_seconds() + max(syncs)  # (less under 1F1B: the middle rank is busiest)
    if schedule == "1f1b":
        assert seconds < capacity.link_bound_step_seconds() + max(syncs)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_least_step_time_counts_a_middle_ranks_two_links_and_the_tied_rows_on_one_link(tmp_path, schedule):
    """Each rank is behind a link of its own (a host's, or its namespace's under --bandwidth): a middle stage's
    activations to the next stage and gradients to the previous one share it, as the tied table's rows share the first
    and last stages'. The plan counted each stage-to-stage link apart, and no rows: a three-stage 1F1B run with fp32
    links measured 5.2-6.0 s per step at 4 Mbit/s against a least time of 2.1 s (now 4.2 s)."""
    cfg = flags_to_config(["--model", "llama-tiny", "--pp", "3", "--schedule", schedule, "--fw", "fp32", "--bw", "fp32",
                           "--bandwidth", "4mbit"], tmp_path)  # (llama-tiny ties its embedding and head, as SmolLM2)
    capacity = cap.plan_capacity(make_plan(cfg))
    links, tied = capacity.links, capacity.tied
    assert tied is not None and tied.how == "rows" and 0 < tied.row_bytes == tied.step_bytes
    middle_out = links[1].fwd_bytes + links[0].bwd_bytes  # rank 1's link, outbound, whatever the schedule
    first_in = links[0].bwd_bytes + tied.row_bytes // 2  # rank 0's link, inbound: gradients and the tied rows
    assert capacity.link_bound_step_seconds() >= 8 * max(middle_out, first_in) / 4e6
    if schedule == "1f1b":
        assert capacity.link_bound_step_seconds() == pytest.approx(8 * middle_out / 4e6)
