"""End-to-end runs through the launcher: pipeline = single process, and the run directory docs/runs.md describes."""

import json

import pytest
import torch

from aqpipe.config import RunConfig, resolve
from aqpipe.launch.job import run_job
from tests import warm
from tests.reference import train_single_process


def small_config(out, **kw) -> RunConfig:
    settings = dict(model="gpt2-tiny", seq_len=32, micro_batch_size=2, micro_batches=3, steps=6, lr=2e-3,
                    warmup_steps=2, seed=1, max_samples=96, eval_samples=16, device="cpu", out=str(out), clip=0.5,
                    fw="fp32", bw="fp32")
    settings.update(kw)
    return resolve(RunConfig(**settings))


def pipeline_params(out, bounds) -> dict[str, torch.Tensor]:
    """The pipeline's final weights renamed to the single-process model's layer indices."""
    params = {}
    for stage in range(len(bounds) - 1):
        state = torch.load(out / "checkpoints" / "final" / f"stage-{stage}.pt", weights_only=True)
        for key, value in state.items():
            local, _, rest = key.partition(".")
            params[f"{bounds[stage] + int(local)}.{rest}"] = value
    return params


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# pp = 2 runs with replicas: (2, 1) would repeat its pipeline part.
@pytest.mark.parametrize("pp,dp", [(3, 1), (4, 1), (2, 2)])
def test_pipeline_matches_single_process(tmp_path, pp, dp):
    cfg = small_config(tmp_path / "run", pp=pp, dp=dp)
    ref_losses, ref_params, bounds = train_single_process(small_config(tmp_path / "ref", pp=pp, dp=dp))
    assert run_job(cfg, progress=False, starter=warm.ranks()) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == len(ref_losses) == 6
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    assert losses[-1] < losses[0]  # it trained
    params = pipeline_params(tmp_path / "run", bounds)
    assert params.keys() == ref_params.keys()
    for key, want in ref_params.items():
        assert relative_error(params[key], want) <= 1e-5, key


def test_pretrained_checkpoint_directory_trains_from_its_own_weights_and_tokenizer(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from aqpipe.data.corpus import builtin_corpus
    from aqpipe.data.tokenizer import train_bpe
    from aqpipe.runtime.plan import make_plan
    from aqpipe.stages.gpt2 import lm_loss

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    bpe = train_bpe(builtin_corpus(), 512)
    PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer).save_pretrained(ckpt)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    hf.save_pretrained(ckpt)
    cfg = small_config(tmp_path / "run", model=str(ckpt), pp=2, steps=3)
    assert run_job(cfg, progress=False, starter=warm.ranks()) == 0
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    plan = make_plan(small_config(tmp_path / "ref", model=str(ckpt), pp=2, steps=3))
    data = plan.dataset.train
    with torch.no_grad():
        losses = [float(lm_loss(hf(data.inputs(ids)).logits, data.targets(ids)))
                  for ids in plan.epoch_plan(0).micro_batches_of(0)]
    assert first["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_time_partition_is_resolved_before_the_workers_start(tmp_path):
    cfg = small_config(tmp_path / "run", pp=3, partition="time", steps=2)
    assert run_job(cfg, progress=False, starter=warm.ranks()) == 0
    bounds = json.loads((tmp_path / "run" / "config.json").read_text())["stage_bounds"]
    assert bounds[0] == 0 and bounds[-1] == 6 and len(bounds) == 4 and all(a < b for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("abort_fails", [False, True])
def test_a_rank_that_fails_aborts_its_process_group_instead_of_waiting_on_it(tmp_path, monkeypatch, abort_fails):
    """Under NCCL (torch >= 2.6) a graceful teardown waits for the work queued on the group: after a failure, a
    collective the other ranks will never join, so the rank would hang until the watchdog killed it and its error
    never reached the launcher. Simulated on gloo: a graceful teardown on the failure path fails the test. An abort
    that fails itself does not hide the run's error."""
    import torch.distributed as dist

    from aqpipe.runtime.rank import train

    # a store on a port the kernel picks as it binds (a port found free earlier may be taken by then)
    monkeypatch.setattr(train, "rendezvous_store", lambda rank, world, timeout: dist.TCPStore(
        "127.0.0.1", 0, world, True, timeout))
    destroy, threads = dist.destroy_process_group, torch.get_num_threads()

    def graceful_teardown_would_hang(*args, **kwargs):
        raise AssertionError("a graceful teardown after a failure waits for peers that will never come")

    def failing_plan(*args, **kwargs):
        assert dist.is_initialized()
        raise ValueError("the planning failed")

    def failing_abort(*args, **kwargs):
        raise RuntimeError("this backend cannot abort")

    monkeypatch.setattr(dist, "destroy_process_group", graceful_teardown_would_hang)
    monkeypatch.setattr(train, "make_plan", failing_plan)
    if abort_fails:
        monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", failing_abort)
    try:
        with pytest.raises(ValueError, match="the planning failed"), torch.random.fork_rng():  # (it seeds torch)
            train.run_worker(small_config(tmp_path / "run", pp=1), 0, 1)
        assert dist.is_initialized() == abort_fails
    finally:
        if dist.is_initialized():
            destroy()
        torch.set_num_threads(threads)


def test_a_rank_freezes_what_it_loaded_for_its_steps_and_the_process_gets_it_back_when_the_run_ends(tmp_path,
                                                                                                     monkeypatch):
    """No collection walks what a rank loaded before its first step (modules, the stage, its optimizer, its links),
    and however the run ends the process gets it all back under the collector: under the Python API the user's
    script goes on after `aqpipe.train` returns."""
    import gc

    import torch.distributed as dist

    from aqpipe.runtime.rank import train

    monkeypatch.setattr(train, "rendezvous_store", lambda rank, world, timeout: dist.TCPStore(
        "127.0.0.1", 0, world, True, timeout))
    before, frozen, threads = gc.get_freeze_count(), [], torch.get_num_threads()

    def steps(*args, **kwargs):
        frozen.append(gc.get_freeze_count())
        raise ValueError("the steps failed")

    monkeypatch.setattr(train, "train_steps", steps)
    try:
        with pytest.raises(ValueError, match="the steps failed"), torch.random.fork_rng():  # (it seeds torch)
            train.run_worker(small_config(tmp_path / "run", pp=1), 0, 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
    assert frozen and frozen[0] > before + 10_000, (before, frozen)
    assert gc.get_freeze_count() == 0


def test_a_rank_takes_omp_num_threads_where_set_else_its_share_of_the_hosts_cores():
    from aqpipe.runtime.rank.train import rank_threads

    assert rank_threads("3", cores=16, local_world=4) == 3
    assert rank_threads("", cores=16, local_world=4) == 4
    assert rank_threads("", cores=2, local_world=4) == 1  # (never none)
    assert rank_threads("0", cores=8, local_world=2) == rank_threads("x", cores=8, local_world=2) == 4
