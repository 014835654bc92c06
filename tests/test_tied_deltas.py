"""Delta-coded tied rows (`--tied-exchange rows:delta:B`): the owner's mirror and the lookup side's cache stay one
tensor bit for bit, rows the digests do not vouch for go exactly once, gradient rows lose nothing over the steps (error
feedback), bad payloads are refused, and a whole run sends a quarter of the exact rows' bytes or less, trains close to
them and resumes bit for bit."""

import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from aqpipe.launch.job import run_job
from aqpipe.pipeline.links.tied_deltas import RowDeltas, table_digest
from aqpipe.pipeline.links.tied_rows import LOOKUP, OWNER, RowExchange
from aqpipe.pipeline.links.transport import Inbox, Outbox, TransportError
from tests import warm
from tests.test_tied_rows import records, tied_config

VOCAB, WIDTH = 50, 96


def pair(owner_table: torch.Tensor, lookup_table: torch.Tensor, bits: int = 4) -> tuple[RowExchange, RowExchange]:
    """The owner's and the lookup side's delta-coded ends over two local socket pairs."""
    rows_out, rows_in = socket.socketpair()
    grads_out, grads_in = socket.socketpair()
    owner = RowExchange(OWNER, "weight", nn.Parameter(owner_table.clone()), Outbox(rows_out, "lookup", 5.0),
                        Inbox(grads_in, "lookup", 5.0), deltas=RowDeltas(bits, WIDTH))
    lookup = RowExchange(LOOKUP, "weight", nn.Parameter(lookup_table.clone()), Outbox(grads_out, "owner", 5.0),
                         Inbox(rows_in, "owner", 5.0), deltas=RowDeltas(bits, WIDTH))
    return owner, lookup


def step(owner: RowExchange, lookup: RowExchange, index: int, tokens: list[torch.Tensor],
         embed_grads: list[torch.Tensor] | None = None) -> None:
    """One step of both ends: rows to the lookup side, its gradient rows (given per micro-batch) to the owner."""
    for end in (lookup, owner):  # (one thread: the lookup side's digest must be on its way before the owner waits)
        end.begin(index, tokens)
    for mb in range(len(tokens)):
        lookup.ready(mb)
    lookup.table.grad = None
    for mb in range(len(tokens)):
        grad = torch.zeros(VOCAB, WIDTH) if embed_grads is None else embed_grads[mb]
        lookup.table.grad = grad.clone() if lookup.table.grad is None else lookup.table.grad + grad
        lookup.backward_done(index)
    owner.table.grad = torch.zeros(VOCAB, WIDTH)
    lookup.exchange_gradients()
    owner.exchange_gradients()


def test_the_mirror_and_the_cache_stay_one_tensor_while_the_head_trains():
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, WIDTH, generator=generator)
    owner, lookup = pair(table, table)
    try:
        for index in range(6):
            tokens = [torch.randint(0, VOCAB, (2, 5), generator=generator) for _ in range(2)]
            step(owner, lookup, index, tokens)
            used = torch.unique(torch.cat([t.reshape(-1) for t in tokens]))
            assert torch.equal(owner.deltas.mirror, lookup.table.detach())  # bit for bit, every row
            assert torch.equal(table_digest(owner.deltas.mirror), table_digest(lookup.table))
            # the rows looked up are within a quantization step of a small change of the head's current rows
            error = (lookup.table.detach()[used] - owner.table.detach()[used]).abs().max()
            assert float(error) < 0.05
            with torch.no_grad():  # the head's update: a learning rate's worth on every row
                owner.table.add_(0.01 * torch.randn(VOCAB, WIDTH, generator=generator))
        assert bool(owner.deltas.known.all())
    finally:
        for end in (owner, lookup):
            end.close(abort=True)


def test_rows_the_digests_do_not_vouch_for_go_exactly_once():
    generator = torch.Generator().manual_seed(1)
    current, stale = torch.randn(VOCAB, WIDTH, generator=generator), torch.randn(VOCAB, WIDTH, generator=generator)
    owner, lookup = pair(current, stale)
    try:
        tokens = [torch.tensor([[3, 7, 7, 11]])]
        step(owner, lookup, 0, tokens)
        first = lookup.bytes_sent, owner.bytes_sent
        assert torch.equal(lookup.table.detach()[[3, 7, 11]], current[[3, 7, 11]])  # exact: fp32, once
        assert not bool(owner.deltas.known[0]) and bool(owner.deltas.known[[3, 7, 11]].all())
        with torch.no_grad():
            owner.table.add_(0.01)
        step(owner, lookup, 1, tokens)  # the same rows again: their changes, coded
        assert owner.bytes_sent - first[1] < (first[1]) / 4
        known = owner.deltas.known
        assert torch.equal(owner.deltas.mirror[known], lookup.table.detach()[known])  # the rows it vouches for
    finally:
        for end in (owner, lookup):
            end.close(abort=True)


def test_gradient_rows_lose_nothing_over_the_steps_and_a_non_finite_one_goes_exactly():
    generator = torch.Generator().manual_seed(2)
    table = torch.randn(VOCAB, WIDTH, generator=generator)
    owner, lookup = pair(table, table, bits=3)
    try:
        tokens = [torch.tensor([[1, 2, 5]]), torch.tensor([[5, 9]])]
        sent = torch.zeros(VOCAB, WIDTH, dtype=torch.float64)
        added = torch.zeros(VOCAB, WIDTH, dtype=torch.float64)
        for index in range(5):
            grads = [torch.zeros(VOCAB, WIDTH) for _ in tokens]
            for mb, batch in enumerate(tokens):
                grads[mb][batch.unique()] = torch.randn(len(batch.unique()), WIDTH, generator=generator)
            step(owner, lookup, index, tokens, grads)
            sent += sum(grads).double()
            added += owner.table.grad.double()
        # what arrived plus what the errors still hold is every gradient the lookup side computed
        assert torch.allclose(added + lookup.deltas.residual.double(), sent, atol=1e-4)
        assert float(lookup.deltas.residual.abs().max()) > 0  # (they were coded, not sent exactly)
        residual = lookup.deltas.residual.clone()
        inf = [torch.full((VOCAB, WIDTH), float("inf")) for _ in tokens]
        step(owner, lookup, 5, tokens, inf)
        assert torch.isinf(owner.table.grad[[1, 2, 5, 9]]).all()  # exact: the owner sees the overflow and drops it
        assert torch.equal(lookup.deltas.residual, residual)
    finally:
        for end in (owner, lookup):
            end.close(abort=True)


def test_a_payload_of_the_wrong_length_is_refused():
    deltas = RowDeltas(4, WIDTH)
    rows = torch.tensor([1, 2])
    with pytest.raises(TransportError, match="rows arrived as"):
        deltas.decode_rows(rows, torch.zeros(2 + 10, dtype=torch.uint8), torch.zeros(VOCAB, WIDTH))
    with pytest.raises(TransportError, match="coded gradient rows arrived as"):
        deltas.decode_grads(rows, torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2..8 bits"):
        RowDeltas(1, WIDTH)


def test_a_delta_coded_run_sends_a_quarter_of_the_exact_rows_bytes_and_resumes_bit_for_bit(tmp_path):
    runs = {}
    for exchange in ("rows", "rows:delta:4"):
        runs[exchange] = tmp_path / exchange.replace(":", "-")
        assert run_job(tied_config(runs[exchange], exchange, checkpoint_every=3), progress=False,
                       starter=warm.ranks()) == 0
    exact, coded = records(runs["rows"]), records(runs["rows:delta:4"])
    assert sum(r["tied_bytes"] for r in coded) * 4 <= sum(r["tied_bytes"] for r in exact)
    for e, c in zip(exact, coded):
        assert c["loss"] == pytest.approx(e["loss"], rel=0.02)
    assert coded[-1]["loss"] < coded[0]["loss"]
    # the checkpoint of step 3: the head's mirror is the first stage's cache, bit for bit
    parts = sorted((runs["rows:delta:4"] / "checkpoints" / "step-00000003").glob("rank-*.pt"))
    states = [torch.load(p, weights_only=False) for p in parts if not p.name.endswith(".store.pt")]
    lookup = next(s for s in states if s.get("tied_rows", {}).get("residual") is not None)
    owner = next(s for s in states if s.get("tied_rows", {}).get("mirror") is not None)
    cache = next(v for k, v in lookup["model"].items() if k.endswith("embed_tokens.weight"))
    assert torch.equal(cache, owner["tied_rows"]["mirror"])
    # resumed from step 3: steps 4-6 exactly as the uninterrupted run
    whole = runs["rows:delta:4"]
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for later in ("step-00000006", "final"):
        shutil.rmtree(resumed / "checkpoints" / later)
    assert run_job(tied_config(resumed, "rows:delta:4", checkpoint_every=3, resume=str(resumed)), progress=False,
                   starter=warm.ranks()) == 0
    assert [r["loss"] for r in records(resumed)] == [r["loss"] for r in records(whole)]
    exported = [load_file(next((run / "export").glob("*.safetensors"))) for run in (whole, resumed)]
    assert all(torch.equal(exported[0][key], exported[1][key]) for key in exported[0])


def test_a_skipped_step_leaves_the_gradient_errors_as_they_were_and_a_scaled_gradient_goes_unscaled():
    generator = torch.Generator().manual_seed(3)
    table = torch.randn(VOCAB, WIDTH, generator=generator)
    owner, lookup = pair(table, table)
    tokens = [torch.tensor([[1, 2]]), torch.tensor([[7, 8]])]

    def grads(scale: float, overflow_in: int | None = None) -> list[torch.Tensor]:
        out = [torch.zeros(VOCAB, WIDTH) for _ in tokens]
        for mb, batch in enumerate(tokens):
            out[mb][batch.unique()] = torch.randn(len(batch.unique()), WIDTH, generator=generator) * scale
        if overflow_in is not None:
            out[overflow_in][tokens[overflow_in].unique()[0], 0] = float("inf")
        return out

    def run(index: int, embed: list[torch.Tensor], scale: float, drop: bool) -> None:
        for end in (lookup, owner):
            end.begin(index, tokens)
        for mb in range(len(tokens)):
            lookup.ready(mb)
        lookup.table.grad = None
        for mb in range(len(tokens)):
            lookup.table.grad = embed[mb].clone() if lookup.table.grad is None else lookup.table.grad + embed[mb]
            lookup.backward_done(index, scale)
        owner.table.grad = torch.zeros(VOCAB, WIDTH)
        lookup.exchange_gradients(drop=drop)
        owner.exchange_gradients(unscale=1.0 / scale, drop=drop)

    try:
        first = grads(1024.0)
        run(0, first, 1024.0, drop=False)
        # the owner's gradient is the unscaled one, within a 4-bit code of it; the errors are in unscaled units
        sent = (first[0] + first[1]) / 1024.0
        used = torch.tensor([1, 2, 7, 8])
        assert torch.allclose(owner.table.grad[used] + lookup.deltas.residual[used], sent[used], atol=1e-5)
        assert float(lookup.deltas.residual.abs().max()) < 0.5
        before = lookup.deltas.residual.clone()
        run(1, grads(2048.0, overflow_in=1), 2048.0, drop=True)  # micro-batch 0's rows were coded, then skipped
        assert torch.equal(lookup.deltas.residual, before)
    finally:
        for end in (owner, lookup):
            end.close(abort=True)


def test_an_evaluation_changes_nothing_in_a_delta_coded_runs_training(tmp_path):
    runs = {}
    for every in (0, 2):
        runs[every] = tmp_path / f"every-{every}"
        assert run_job(tied_config(runs[every], "rows:delta:4", fw="aqsgd:4", bw="rtq:4", eval_every=every),
                       progress=False, starter=warm.ranks()) == 0
    assert [r["loss"] for r in records(runs[0])] == [r["loss"] for r in records(runs[2])]
    assert sum("eval_loss" in r for r in records(runs[2])) == 3  # (after steps 2, 4 and 6)
    exported = [load_file(next((run / "export").glob("*.safetensors"))) for run in runs.values()]
    assert all(torch.equal(exported[0][key], exported[1][key]) for key in exported[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_delta_coded_rows_on_a_gpu_keep_the_mirror_and_the_cache_one_tensor():
    device = torch.device("cuda")
    table = torch.randn(VOCAB, WIDTH, device=device)
    owner, lookup = RowDeltas(4, WIDTH), RowDeltas(4, WIDTH)
    owner.start_owner(table, table_digest(table))
    cache = table.clone()
    rows = torch.tensor([3, 9, 11])
    current = table[rows.to(device)] + 0.01
    owner.known[9] = False  # (a row the mirror does not vouch for: it goes exactly)
    payload = owner.encode_rows(rows, current)
    assert payload.device.type == "cuda"  # (the outbox copies it to the host without the step waiting)
    cache[rows.to(device)] = lookup.decode_rows(rows, payload.cpu(), cache)  # (as it arrives: host bytes)
    assert torch.equal(owner.mirror, cache) and bool(owner.known[rows].all())
    assert torch.equal(cache[9], current[1])
    grads = torch.randn(len(rows), WIDTH, device=device)
    coded = lookup.encode_grads(rows, grads, VOCAB)
    assert coded.device.type == "cuda" and int(coded[0]) == 0  # (coded, not exact)
    decoded = owner.decode_grads(rows, coded.cpu())
    assert torch.allclose(decoded.to(device) + lookup.residual[rows.to(device)], grads, atol=1e-5)
