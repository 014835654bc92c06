"""The stage worker executes any schedule of the registry: 1F1B and eager 1F1B give GPipe's losses and parameters
bit for bit (all run backwards in forward order, so gradients accumulate in the same order), and all equal a single
process; the 1F1B family holds fewer activations, as the new metric shows."""

from pathlib import Path

import pytest
import torch

from aqpipe.config import RunConfig, resolve
from aqpipe.pipeline.vocab.schedule import SCHEDULES
from tests.distributed import run_ranks, worker_step
from tests.reference import train_single_process

STEPS = 4


def config(out: Path, pp: int, dp: int, micro_batches: int, schedule: str = "gpipe") -> RunConfig:
    return resolve(RunConfig(model="gpt2-tiny", seq_len=32, micro_batch_size=2, micro_batches=micro_batches,
                             steps=STEPS, lr=2e-3, warmup_steps=2, seed=1, max_samples=96, eval_samples=16, device="cpu", out=str(out),
                             clip=0.5, fw="fp32", bw="fp32", pp=pp, dp=dp, schedule=schedule))


def _train_each(rank: int, world: int, pp: int, dp: int, micro_batch_counts: list[int], out: str) -> dict:
    """On one rank: for each micro-batch count and schedule, assemble the stage afresh and train STEPS steps;
    returns {(m, schedule): (per-step loss sums, final state, peak activation bytes per step)}."""
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.plan import make_plan
    from aqpipe.runtime.rank.assemble import assemble_stage

    torch.set_num_threads(1)  # as each launched worker on these machines, and the single-process reference
    results = {}
    for m in micro_batch_counts:
        for schedule in SCHEDULES:
            plan = make_plan(config(Path(out) / f"{m}-{schedule}", pp, dp, m, schedule))
            torch.manual_seed(plan.cfg.seed)
            stage = assemble_stage(plan, Grid(pp, dp, rank), torch.device("cpu"), "gloo")
            epochs = plan.epoch_plan(stage.grid.replica)
            losses, peaks = [], []
            try:
                for step in range(STEPS):
                    stats = stage.worker.run_step(step, epochs.micro_batches_of(step))
                    losses.append(stats.loss_sum)
                    peaks.append(stats.peak_activation_bytes)
            finally:
                stage.worker.links.close()
            state = {k: v.detach().clone() for k, v in stage.worker.module.state_dict().items()}
            results[(m, schedule)] = (losses, state, peaks)
    return results


def _pipeline_runs(tmp_path, pp: int, dp: int, counts: list[int]) -> list[dict]:
    outcome = run_ranks(_train_each, pp * dp, pp, dp, counts, str(tmp_path))
    assert all(status == "ok" for status, _ in outcome), outcome
    return [value for _, value in outcome]


# Every pipeline depth from 2 to 4, and replicas: a stage's stream depends on pp and the micro-batch count only, so
# (2, 1) and (3, 2) would repeat what (2, 2) and (3, 1) show.
@pytest.mark.parametrize("pp,dp", [(3, 1), (4, 1), (2, 2)])
def test_every_schedule_equals_gpipe_bit_for_bit_and_1f1b_a_single_process(tmp_path, pp, dp):
    counts = [pp - 1, pp, 2 * pp + 1]
    ranks = _pipeline_runs(tmp_path, pp, dp, counts)
    for m in counts:
        for rank, result in enumerate(ranks):
            gpipe_losses, gpipe_state, _ = result[(m, "gpipe")]
            for schedule in SCHEDULES:
                losses, state, _ = result[(m, schedule)]
                assert losses == gpipe_losses, (m, rank, schedule)
                assert all(torch.equal(state[k], gpipe_state[k]) for k in state), (m, rank, schedule)
        ref_losses, ref_params, bounds = train_single_process(config(tmp_path / "ref", pp, dp, m))
        last_stage = [replica * pp + pp - 1 for replica in range(dp)]
        for step in range(STEPS):
            loss = sum(ranks[r][(m, "1f1b")][0][step] for r in last_stage) / (m * dp)
            assert abs(loss - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), (m, step)
        for stage in range(pp):
            for key, value in ranks[stage][(m, "1f1b")][1].items():
                local, _, rest = key.partition(".")
                want = ref_params[f"{bounds[stage] + int(local)}.{rest}"].double()
                error = float((value.double() - want).norm() / want.norm().clamp_min(1e-30))
                assert error <= 1e-5, (m, stage, key, error)


def test_1f1b_holds_pp_over_m_of_gpipes_activations_on_the_first_stage(tmp_path):
    """pp=4, m=9: stage 0 holds at most 4 micro-batches under 1F1B, 7 under eager 1F1B and all 9 under GPipe; the
    metric says so (1F1B within one micro-batch of pp/m of what GPipe holds)."""
    pp, m = 4, 9
    ranks = _pipeline_runs(tmp_path, pp, 1, [m])
    for stage, result in enumerate(ranks):
        gpipe = result[(m, "gpipe")][2]
        per_micro_batch = gpipe[-1] / m
        for schedule, held in (("1f1b", min(pp - stage, m)), ("eager-1f1b", min(2 * (pp - stage) - 1, m))):
            peaks = result[(m, schedule)][2]
            assert all(p > 0 for p in gpipe + peaks)
            for g, o in zip(gpipe, peaks):
                assert o <= g * held / m + per_micro_batch, (stage, schedule, g, o)
                assert o >= g * held / m - per_micro_batch, (stage, schedule, g, o)  # and it really holds that many
    assert ranks[0][(m, "1f1b")][2][-1] <= ranks[0][(m, "gpipe")][2][-1] * (pp / m) + ranks[0][(m, "gpipe")][2][-1] / m


def _evaluate_between_steps(rank: int, world: int, out: str) -> tuple[int, int]:
    """pp=2: train a step, evaluate, train another; returns what rank 1 counted as received in each step."""
    from aqpipe.pipeline.execution.evaluate import eval_batches, evaluate_stage
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.plan import make_plan
    from aqpipe.runtime.rank.assemble import assemble_stage

    plan = make_plan(config(Path(out), 2, 1, 2, "1f1b"))
    stage = assemble_stage(plan, Grid(2, 1, rank), torch.device("cpu"), "gloo")
    epochs = plan.epoch_plan(0)
    try:
        before = stage.worker.run_step(0, epochs.micro_batches_of(0))
        batches = eval_batches(len(plan.dataset.valid), 0, 1, 2)[:3]  # a few evaluation messages are enough
        evaluate_stage(stage.worker, 1, batches, plan.dataset.valid if rank in (0, 1) else None, 0)
        after = stage.worker.run_step(1, epochs.micro_batches_of(1))
    finally:
        stage.worker.links.close()
    return before.fwd_recv_bytes, after.fwd_recv_bytes


def test_evaluation_messages_are_not_counted_as_the_next_steps_link_traffic(tmp_path):
    outcome = run_ranks(_evaluate_between_steps, 2, str(tmp_path))
    assert all(status == "ok" for status, _ in outcome), outcome
    before, after = outcome[1][1]
    assert before > 0 and after == before


def _norm_the_sign_sync_sees(rank: int, world: int) -> float:
    """pp=1 × dp=2 with Marsit and --clip 1: gradients of norm 100 go through the worker's reduction; returns the
    norm the sync was handed (the input its compensation is formed from)."""
    from torch import nn

    from aqpipe.pipeline.world.grid import Grid

    module = nn.Linear(4, 4)
    for p in module.parameters():
        p.grad = torch.full_like(p, 100.0 / 20 ** 0.5)  # 20 elements: norm 100
    seen = []
    worker_step(Grid(1, world, rank), module, "marsit:10", lr=0.1, clip=1.0,
                before_sync=lambda params: seen.append(float(torch.cat([p.grad.reshape(-1) for p in params]).norm())))
    return seen[0]


def test_a_sign_method_is_handed_gradients_already_clipped():
    """Marsit forms its compensation from the gradient it is handed, so --clip must act before the sync (the
    paper's Algorithm 1); clipping after it would leave the compensation built from unclipped values."""
    results = run_ranks(_norm_the_sign_sync_sees, 2)
    assert all(status == "ok" for status, _ in results), results
    for _, norm in results:
        assert norm == pytest.approx(1.0, rel=1e-4)


def test_a_receive_waits_for_its_peer_only_until_the_message_arrives(monkeypatch):
    """A receive's time splits: blocked on the inbox is waiting for the peer; decoding (and, on a GPU, the work
    queued before it) is the stage's own. Counted together as waiting, a GPU's backward — queued, then waited for
    by the next receive — read as time lost to the link. (A stand-in clock: 2 s for the message, 3 s to decode.)"""
    from types import SimpleNamespace

    from aqpipe.pipeline.links import link_ends

    clock = [0.0]
    monkeypatch.setattr(link_ends.time, "perf_counter", lambda: clock[0])

    class Inbox:
        def get(self):
            clock[0] += 2.0
            return SimpleNamespace(header=SimpleNamespace(flags=0), payload=None, ids=None, wire_bytes=200,
                                   transfer_seconds=0.0, arrived_bytes=0)

    class Codec:
        def decode(self, header, payload, ids):
            clock[0] += 3.0
            return torch.zeros(1)

    end = link_ends.RecvEnd(0, 1, Codec(), Inbox(), torch.device("cpu"), 1)
    end._receive()
    end._receive()
    assert end.blocked_seconds == 4.0 and clock[0] == 10.0


def test_a_gpu_timer_times_nothing_on_the_host():
    from aqpipe.pipeline.execution.gpu_timing import GpuTimer

    timer = GpuTimer(torch.device("cpu"))
    with timer.span("forward_seconds"):
        torch.ones(3).sum()
    assert not timer.enabled and timer.settle() == {}


def test_a_step_settles_what_its_receiving_codecs_left_for_later():
    """An AQ-SGD receiver on a GPU checks its messages' checksums once their sums reach the host; the step's end
    makes the checks still left, on each receiving end (a sending end's codec leaves nothing)."""
    from types import SimpleNamespace

    from aqpipe.pipeline.links.link_ends import StageLinks

    settled = []

    def end(name):
        return SimpleNamespace(codec=SimpleNamespace(settle=lambda: settled.append(name)))

    StageLinks(act_in=end("activations in"), act_out=end("activations out"), grad_in=end("gradients in"),
               grad_out=end("gradients out")).settle()
    assert settled == ["activations in", "gradients in"]
    StageLinks().settle()  # (a one-stage pipeline: no ends)


def test_a_step_that_failed_names_a_divergence_its_late_checks_find_as_the_failures_cause():
    from types import SimpleNamespace

    from aqpipe.compress.link.specs import CodecError
    from aqpipe.pipeline.links.link_ends import StageLinks

    def links(trouble):
        def settle():
            raise trouble

        return StageLinks(act_in=SimpleNamespace(codec=SimpleNamespace(settle=settle)))

    failure = TimeoutError("the peer stopped sending")
    with pytest.raises(CodecError, match="diverged") as raised:
        links(CodecError("m(xi) diverged on link 0")).settle_after(failure)
    assert raised.value.__cause__ is failure
    links(RuntimeError("CUDA error: an illegal memory access")).settle_after(failure)  # (the step's own is raised)


def _aqsgd_steps(rank: int, world: int, out: str, late: bool, plant: bool) -> dict:
    """On one rank of a 2-stage AQ-SGD pipeline: train 4 steps (two epochs of two), the receiver of the activations
    checking late (`late`, as on a GPU); with `plant`, a divergence planted in its m(ξ) of a sample of the last
    step's last micro-batch. Returns the step losses, how many checks were left after each step, and the error a
    step raised."""
    from aqpipe.compress.link.late_checks import LateChecks
    from aqpipe.compress.link.specs import CodecError
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.plan import make_plan
    from aqpipe.runtime.rank.assemble import assemble_stage

    torch.set_num_threads(1)
    plan = make_plan(resolve(RunConfig(model="gpt2-tiny", seq_len=32, micro_batch_size=2, micro_batches=2, steps=4,
                                       lr=2e-3, seed=1, max_samples=8, device="cpu", out=out, fw="aqsgd:3",
                                       bw="directq:6", warmup_epochs=0, pp=2, dp=1)))
    torch.manual_seed(plan.cfg.seed)
    stage = assemble_stage(plan, Grid(2, 1, rank), torch.device("cpu"), "gloo")
    epochs = plan.epoch_plan(0)
    receiver = stage.worker.links.act_in.codec if rank == 1 else None
    if receiver is not None and late:
        receiver.late_checks = LateChecks(receiver._verify)
    result: dict = {"losses": [], "left": [], "error": None}
    try:
        for step in range(4):
            if plant and receiver is not None and step == 3:
                sample = int(epochs.micro_batches_of(step)[-1][0])
                receiver.view.put([sample], [receiver.view.get([sample])[0] + 1])
            try:
                result["losses"].append(stage.worker.run_step(step, epochs.micro_batches_of(step)).loss_sum)
            except CodecError as e:
                result["error"] = str(e)
            result["left"].append(len(receiver.late_checks) if receiver is not None and late else 0)
    finally:
        stage.worker.links.close()
    return result


def test_a_receiver_checking_late_trains_as_one_checking_at_once_and_refuses_a_divergence_in_its_step(tmp_path):
    """The activations' receiver checking each message's checksum once its sums reach the host (what a GPU
    receiver does) trains bit for bit as one checking at once, with no check left after any step; a divergence of
    its m(ξ) in the last micro-batch of a step is refused when that step ends, naming the message."""
    runs = {}
    for late, plant in ((False, False), (True, False), (True, True)):
        outcome = run_ranks(_aqsgd_steps, 2, str(tmp_path / f"{late}-{plant}"), late, plant)
        assert all(status == "ok" for status, _ in outcome), outcome
        runs[late, plant] = [value for _, value in outcome]
    at_once, late, planted = runs[False, False], runs[True, False], runs[True, True]
    assert [r["losses"] for r in at_once] == [r["losses"] for r in late] and len(at_once[1]["losses"]) == 4
    assert late[1]["left"] == [0, 0, 0, 0] and late[1]["error"] is None
    assert planted[1]["error"] is not None and "diverged on link 0" in planted[1]["error"], planted[1]
    assert "at step 3 micro-batch 1" in planted[1]["error"] and planted[1]["left"] == [0, 0, 0, 0]


def test_a_rank_reports_its_own_peak_memory_not_its_parents(tmp_path):
    """On the host a rank's peak memory is its own: a process started by vfork+exec (subprocess, the forkserver)
    reported its parent's peak through getrusage when that was higher."""
    import subprocess
    import sys

    child = ("from aqpipe.pipeline.execution.worker import peak_memory_bytes\nimport torch\n"
             "print(peak_memory_bytes(torch.device('cpu')))")
    parent = ("import subprocess, sys\n"
              "big = bytearray(800_000_000)\n"
              "big[::4096] = b'x' * len(range(0, len(big), 4096))\n"  # touch every page: 800 MB resident
              "del big\n"
              f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, check=True).stdout)")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.split()[0])
    assert 50e6 < peak < 600_000_000, f"the rank reported {peak / 1e6:.0f} MB (its parent peaked at 800 MB)"
