"""A tied input embedding and LM head on different stages, exchanged as rows: the lookup side computes on the owner's
current rows, the owner's gradient is exactly the dense sum, only the two stages holding copies send anything, and a
whole run is the dense exchange's bit for bit while sending a small fraction of its bytes."""

import json
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from aqpipe.config import RunConfig, resolve
from aqpipe.launch.job import run_job
from aqpipe.pipeline.links.tied_rows import FOR_EVALUATION, LOOKUP, OWNER, RowExchange, step_parts, step_rows, table_parameter
from aqpipe.pipeline.links.transport import HEADER_SIZE, Inbox, Outbox, TransportError
from tests import warm

VOCAB, WIDTH = 40, 6


def test_a_steps_rows_are_its_distinct_tokens_ascending():
    tokens = [torch.tensor([[5, 3, 5], [9, 3, 0]]), torch.tensor([[9, 7, 7]])]
    assert step_rows(tokens).tolist() == [0, 3, 5, 7, 9]
    assert step_rows([]).numel() == 0


def pair(owner_table: torch.Tensor, lookup_table: torch.Tensor) -> tuple[RowExchange, RowExchange]:
    """The owner's and the lookup side's ends over two local socket pairs (one per direction)."""
    rows_out, rows_in = socket.socketpair()
    grads_out, grads_in = socket.socketpair()
    owner = RowExchange(OWNER, "weight", nn.Parameter(owner_table.clone()), Outbox(rows_out, "lookup", 5.0),
                        Inbox(grads_in, "lookup", 5.0))
    lookup = RowExchange(LOOKUP, "weight", nn.Parameter(lookup_table.clone()), Outbox(grads_out, "owner", 5.0),
                         Inbox(rows_in, "owner", 5.0))
    return owner, lookup


def close(*ends: RowExchange) -> None:
    for end in ends:
        end.close(abort=True)


def test_a_steps_rows_are_split_by_first_use_and_by_the_backward_that_ends_their_gradient():
    tokens = [torch.tensor([[4, 1, 4]]), torch.tensor([[1, 17]]), torch.tensor([[2, 30, 17]])]
    parts = step_parts(tokens, backward_order=[2, 1, 0])
    assert parts.rows.tolist() == [1, 2, 4, 17, 30]
    assert [p.tolist() for p in parts.values] == [[1, 4], [17], [2, 30]]  # what forward k needs first
    assert [p.tolist() for p in parts.grads] == [[2, 30], [17], [1, 4]]  # final after the 1st, 2nd, 3rd backward
    ascending = step_parts(tokens, backward_order=[0, 1, 2])
    assert [p.tolist() for p in ascending.grads] == [[4], [1], [2, 17, 30]]
    with pytest.raises(ValueError, match="names each of the 3 micro-batches once"):
        step_parts(tokens, backward_order=[0, 0, 2])


def test_the_lookup_side_computes_on_the_owners_rows_and_the_owner_gets_the_dense_sum():
    generator = torch.Generator().manual_seed(0)
    current, stale = torch.randn(VOCAB, WIDTH, generator=generator), torch.randn(VOCAB, WIDTH, generator=generator)
    owner, lookup = pair(current, stale)
    try:
        tokens = [torch.tensor([[4, 1, 4, 30]]), torch.tensor([[1, 17, 2, 2]])]
        owner.begin(3, tokens, backward_order=[1, 0])
        lookup.begin(3, tokens, backward_order=[1, 0])
        lookup.ready(0)  # the first forward waits only for its own rows
        first = torch.tensor([1, 4, 30])
        assert torch.equal(lookup.table[first], current[first])
        assert torch.equal(lookup.table[[2, 17]], stale[[2, 17]])
        lookup.ready(1)
        used = torch.tensor([1, 2, 4, 17, 30])
        assert torch.equal(lookup.table[used], current[used])
        unused = torch.ones(VOCAB, dtype=torch.bool)
        unused[used] = False
        assert torch.equal(lookup.table[unused], stale[unused])  # only the step's rows travelled

        head_grad = torch.randn(VOCAB, WIDTH, generator=generator)  # a head's gradient is dense
        contributions = {index: torch.zeros(VOCAB, WIDTH) for index in (0, 1)}  # an embedding's: where looked up
        for index, batch in enumerate(tokens):
            contributions[index][batch.unique()] = torch.randn(len(batch.unique()), WIDTH, generator=generator)
        owner.table.grad = head_grad.clone()
        for index in (1, 0):  # the backwards, gradients accumulating as autograd does
            grad = contributions[index].clone() if lookup.table.grad is None else lookup.table.grad + contributions[index]
            lookup.table.grad = grad
            lookup.backward_done(3)
        embed_grad = contributions[1] + contributions[0]
        lookup.exchange_gradients()
        owner.exchange_gradients()
        assert torch.equal(owner.table.grad, head_grad + embed_grad)  # what the dense all-reduce forms, bit for bit
        assert lookup.table.grad is None  # the lookup side's optimizer does not hold the table
        assert float(lookup.sq_norm()) == 0.0
        assert float(owner.sq_norm()) == float((head_grad + embed_grad).double().pow(2).sum())
        messages = len(tokens) * HEADER_SIZE  # one a micro-batch each way
        assert lookup.bytes_sent == owner.bytes_sent == len(used) * (4 * WIDTH + 8) + messages
    finally:
        close(owner, lookup)


def test_the_owner_unscales_the_streamed_gradient_rows_as_the_lookup_side_would_have():
    owner, lookup = pair(torch.zeros(VOCAB, WIDTH), torch.zeros(VOCAB, WIDTH))
    try:
        tokens = [torch.tensor([[3, 5]])]
        for end in (owner, lookup):
            end.begin(0, tokens)
        lookup.ready(0)
        scaled = torch.randn(VOCAB, WIDTH) * 1024.0
        lookup.table.grad = scaled.clone()
        lookup.backward_done(0)
        owner.table.grad = torch.zeros(VOCAB, WIDTH)
        lookup.exchange_gradients()
        owner.exchange_gradients(unscale=1.0 / 1024.0)
        assert torch.equal(owner.table.grad[[3, 5]], scaled[[3, 5]].mul_(1.0 / 1024.0))

        for end in (owner, lookup):  # an overflowed step: the sent rows are received and dropped
            end.begin(1, tokens)
        lookup.ready(0)
        lookup.table.grad = torch.full((VOCAB, WIDTH), float("inf"))
        lookup.backward_done(1)
        owner.table.grad = None
        lookup.exchange_gradients(drop=True)
        owner.exchange_gradients(drop=True)
        assert owner.table.grad is None and lookup.table.grad is None
        for end in (owner, lookup):  # and the streams are in step for the next one
            end.begin(2, tokens)
        lookup.ready(0)
    finally:
        close(owner, lookup)


def test_a_backward_that_leaves_the_table_untouched_sends_zero_rows():
    owner, lookup = pair(torch.zeros(VOCAB, WIDTH), torch.zeros(VOCAB, WIDTH))
    try:
        tokens = [torch.tensor([[2, 7]])]
        for end in (owner, lookup):
            end.begin(0, tokens)
        lookup.ready(0)
        lookup.table.grad = None  # nothing upstream of the embedding trains, say
        lookup.backward_done(0)
        head = torch.randn(VOCAB, WIDTH)
        owner.table.grad = head.clone()
        lookup.exchange_gradients()
        owner.exchange_gradients()
        assert torch.equal(owner.table.grad, head)
    finally:
        close(owner, lookup)


def test_an_evaluation_fetches_its_own_rows():
    generator = torch.Generator().manual_seed(1)
    current = torch.randn(VOCAB, WIDTH, generator=generator)
    owner, lookup = pair(current, torch.zeros(VOCAB, WIDTH))
    try:
        tokens = [torch.tensor([[8, 9]])]
        owner.begin(5, tokens, FOR_EVALUATION)
        lookup.begin(5, tokens, FOR_EVALUATION)
        assert torch.equal(lookup.table[8:10], current[8:10]) and not lookup.table[:8].any()
    finally:
        close(owner, lookup)


def test_rows_of_other_tokens_are_refused_naming_the_peer():
    owner, lookup = pair(torch.zeros(VOCAB, WIDTH), torch.zeros(VOCAB, WIDTH))
    try:
        owner.begin(0, [torch.tensor([[1, 2]])])
        lookup.begin(0, [torch.tensor([[1, 3]])])
        with pytest.raises(TransportError, match="owner sent the rows of other tokens for tied table weight at step 1"):
            lookup.ready(0)
    finally:
        close(owner, lookup)


def test_a_stage_must_hold_exactly_one_copy_of_a_table_it_exchanges():
    from aqpipe.stages.llama import DecoderEmbedding, llama_config

    embedding = DecoderEmbedding(llama_config("llama-tiny", 50))
    name, table = table_parameter(nn.Sequential(embedding), "embed_tokens")
    assert name == "0.embed_tokens.weight" and table is embedding.embed_tokens.weight
    with pytest.raises(ValueError, match="exactly one copy"):
        table_parameter(nn.Sequential(embedding, DecoderEmbedding(llama_config("llama-tiny", 50))), "embed_tokens")


def tied_config(out, exchange: str, **kw) -> RunConfig:
    settings = dict(model="llama-tiny", pp=3, seq_len=32, micro_batch_size=2, micro_batches=3, steps=6, lr=2e-3,
                    warmup_steps=2, seed=1, max_samples=96, device="cpu", out=str(out), clip=0.5, fw="fp32", bw="fp32",
                    eval_every=3, eval_samples=16, tied_exchange=exchange, schedule="gpipe")
    settings.update(kw)
    return resolve(RunConfig(**settings))


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def rows_and_dense(tmp_path_factory):
    """The tied llama-tiny over 3 stages with fp32 links under GPipe, once exchanging rows and once all-reducing the
    table."""
    runs = {}
    for exchange in ("rows", "dense"):
        out = tmp_path_factory.mktemp(exchange) / "run"
        assert run_job(tied_config(out, exchange), progress=False, starter=warm.ranks()) == 0
        runs[exchange] = out
    return runs


def test_rows_train_the_dense_exchanges_model_bit_for_bit(rows_and_dense):
    rows, dense = (records(rows_and_dense[k]) for k in ("rows", "dense"))
    assert [r["loss"] for r in rows] == [r["loss"] for r in dense]
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in dense]
    assert [r["eval_loss"] for r in rows if "eval_loss" in r] == [r["eval_loss"] for r in dense if "eval_loss" in r]
    exported = [load_file(next((rows_and_dense[k] / "export").glob("*.safetensors"))) for k in ("rows", "dense")]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][key], exported[1][key]) for key in exported[0])
    final = rows_and_dense["rows"] / "checkpoints" / "final"
    first, last = (torch.load(final / f"stage-{k}.pt", weights_only=True) for k in (0, 2))
    head = next(v for k, v in last.items() if k.endswith("lm_head.weight"))
    assert torch.equal(first["0.embed_tokens.weight"], head)  # the first stage's final weights are whole


def test_only_the_two_stages_holding_copies_send_rows_and_far_fewer_bytes(rows_and_dense):
    rows, dense = (records(rows_and_dense[k]) for k in ("rows", "dense"))
    for record in rows:
        first, middle, last = record["stage_tied_bytes"]
        assert middle == 0 and first > 0 and last > 0
        assert record["tied_bytes"] == first + last
    for record in dense:
        assert record["stage_tied_bytes"][1] > 0  # the all-reduce runs through the middle stage too
    final = torch.load(rows_and_dense["rows"] / "checkpoints" / "final" / "stage-0.pt", weights_only=True)
    table = 4 * final["0.embed_tokens.weight"].numel()
    assert all(r["tied_bytes"] < table / 2 for r in rows)
    assert all(r["tied_bytes"] >= 2 * table for r in dense)  # a ring over 3 ranks sends 2·(3−1)/3 of it from each
    summary = json.loads((rows_and_dense["rows"] / "summary.json").read_text())
    assert summary["tied_bytes"] == sum(r["tied_bytes"] for r in rows)


def test_the_dry_run_predicts_the_rows_a_step_sends(rows_and_dense):
    from aqpipe.runtime.capacity.plan import plan_capacity
    from aqpipe.runtime.plan import make_plan

    capacity = plan_capacity(make_plan(tied_config(rows_and_dense["rows"].parent / "plan", "rows")))
    assert capacity.tied is not None and capacity.tied.how == "rows"
    measured = [r["tied_bytes"] for r in records(rows_and_dense["rows"])]
    # the plan counts the same steps of the same data order: their mean, to a row's rounding
    assert abs(capacity.tied.step_bytes - sum(measured) / len(measured)) <= 2 * (4 * 64 + 8)
    dense = plan_capacity(make_plan(tied_config(rows_and_dense["rows"].parent / "plan2", "dense"))).tied
    assert dense is not None and dense.how == "dense"
    assert dense.step_bytes == records(rows_and_dense["dense"])[0]["tied_bytes"]


@pytest.mark.parametrize("schedule", ["1f1b", "eager-1f1b"])
def test_every_schedule_streams_the_rows_into_the_same_run(rows_and_dense, tmp_path, schedule):
    """Under 1F1B the first stage's forwards wait for their rows between backwards that send gradient rows: the run
    is still the dense gpipe exchange's, bit for bit."""
    out = tmp_path / "run"
    assert run_job(tied_config(out, "rows", schedule=schedule), progress=False, starter=warm.ranks()) == 0
    got, dense = records(out), records(rows_and_dense["dense"])
    assert [r["loss"] for r in got] == [r["loss"] for r in dense]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in dense]
    exported = [load_file(next((run / "export").glob("*.safetensors"))) for run in (out, rows_and_dense["dense"])]
    assert all(torch.equal(exported[0][key], exported[1][key]) for key in exported[0])


def test_bf16_rows_halve_the_exchange_and_train_alike(rows_and_dense, tmp_path):
    out = tmp_path / "run"
    assert run_job(tied_config(out, "rows:bf16"), progress=False, starter=warm.ranks()) == 0
    half, whole = records(out), records(rows_and_dense["rows"])
    for h, w in zip(half, whole):  # values at 2 bytes instead of 4, ids and headers alike
        assert 0.5 < h["tied_bytes"] / w["tied_bytes"] < 0.62
        assert h["loss"] == pytest.approx(w["loss"], rel=0.01)
    assert half[-1]["loss"] < half[0]["loss"]


def test_a_resumed_run_fetches_its_rows_before_its_first_step(rows_and_dense, tmp_path):
    """The first stage's checkpointed table is stale outside the rows it last looked up: a run resumed from step 3
    must compute steps 4-6 exactly as the uninterrupted run did."""
    whole = tmp_path / "whole"
    assert run_job(tied_config(whole, "rows", checkpoint_every=3, eval_every=0), progress=False,
                   starter=warm.ranks()) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for later in ("step-00000006", "final"):
        shutil.rmtree(resumed / "checkpoints" / later)
    assert run_job(tied_config(resumed, "rows", checkpoint_every=3, eval_every=0, resume=str(resumed)),
                   progress=False, starter=warm.ranks()) == 0
    assert [r["loss"] for r in records(resumed)] == [r["loss"] for r in records(whole)]
    assert [r["grad_norm"] for r in records(resumed)] == [r["grad_norm"] for r in records(whole)]
    exported = [load_file(next((run / "export").glob("*.safetensors"))) for run in (whole, resumed)]
    assert all(torch.equal(exported[0][key], exported[1][key]) for key in exported[0])


def test_an_unknown_tied_exchange_is_refused():
    from aqpipe.config import ConfigError

    with pytest.raises(ConfigError, match="--tied-exchange 'sparse' is not one of rows, rows:bf16, rows:delta:B"):
        tied_config("x", "sparse")


def test_bf16_rows_travel_in_half_the_bytes_and_the_head_keeps_its_fp32_table():
    generator = torch.Generator().manual_seed(2)
    current = torch.randn(VOCAB, WIDTH, generator=generator)
    owner, lookup = pair(current, torch.zeros(VOCAB, WIDTH))
    for end in (owner, lookup):
        end.wire_dtype = torch.bfloat16
    try:
        tokens = [torch.tensor([[3, 9, 3]])]
        for end in (owner, lookup):
            end.begin(0, tokens)
        lookup.ready(0)
        assert torch.equal(lookup.table[[3, 9]], current[[3, 9]].bfloat16().float())  # computes on rounded rows
        embed = torch.zeros(VOCAB, WIDTH)
        embed[[3, 9]] = torch.randn(2, WIDTH, generator=generator)
        lookup.table.grad, owner.table.grad = embed.clone(), torch.zeros(VOCAB, WIDTH)
        lookup.backward_done(0)
        lookup.exchange_gradients()
        owner.exchange_gradients()
        assert torch.equal(owner.table.grad, embed.bfloat16().float())
        assert torch.equal(owner.table, current)  # the owner's table is untouched fp32
        assert owner.bytes_sent == lookup.bytes_sent == 2 * (2 * WIDTH + 8) + HEADER_SIZE
    finally:
        close(owner, lookup)


def test_the_plan_counts_what_a_dense_tied_table_sends_with_replicas(tmp_path):
    """With two replicas the copies sum their gradients before the sync and re-agree after it: two all-reduces of
    the table a step over each replica's pipeline, which the plan once counted as one. The run's records sum the
    replicas."""
    from aqpipe.runtime.capacity.plan import plan_capacity
    from aqpipe.runtime.plan import make_plan

    settings = dict(dp=2, steps=2, eval_every=0)
    assert run_job(tied_config(tmp_path / "run", "dense", **settings), progress=False, starter=warm.ranks()) == 0
    planned = plan_capacity(make_plan(tied_config(tmp_path / "plan", "dense", **settings))).tied
    assert planned is not None and planned.how == "dense"
    assert [r["tied_bytes"] for r in records(tmp_path / "run")] == [2 * planned.step_bytes] * 2
