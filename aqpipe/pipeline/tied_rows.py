"""A tied input embedding and LM head on different stages, kept one tensor by exchanging rows, not the table.

SmolLM2, Qwen2.5-0.5B and Llama 3.2 use one matrix as the input embedding (first stage) and as the LM head (last
stage). Megatron and DeepSpeed's pipeline engine keep the two copies equal by all-reducing the whole table's
gradient between them every step: 113 MB for SmolLM2, about 1 GB for Llama 3.2 1B, far more than the compressed
activations the links carry. The step needs much less:

- the head (the *owner*) uses every row, so it holds the table and its optimizer state and takes every update;
- the embedding (the *lookup* side) reads only the rows of the tokens its micro-batches hold, and its gradient is
  non-zero only there.

So at the start of a step the owner sends the current values of those rows (it holds the same samples: its targets
are the tokens), the lookup side writes them into its copy, and after the backward the lookup side sends its
gradient's rows, which the owner adds to the head's gradient before clipping, the grad sync and the optimizer.
The owner's gradient is then exactly the sum the dense all-reduce forms (one addition per element; adding the other
stages' zeros changes nothing), and the lookup side computes on exactly the owner's rows: with fp32 links the run is
the dense exchange's, bit for bit. Bytes per step scale with the distinct tokens of the step, not the vocabulary,
and only the two stages holding copies send any.

The lookup side's table is therefore a cache: rows it has not looked up lately are stale, its optimizer does not
hold it, its resumable checkpoints carry it only as the rows it last read (a resumed step fetches its rows first),
and the replica digest leaves it out. At the end, rank 0 (replica 0's first stage) receives every stage's final
weights for the export anyway, and takes the whole table from the head's before it writes its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aqpipe.pipeline.tied import local_copies
from aqpipe.pipeline.transport import HEADER_SIZE, KIND_TIED_GRADS, KIND_TIED_ROWS, Expect, Header, Inbox, Outbox, TransportError

# What a rows message is for, in its header's micro-batch field: a training step's rows, or an evaluation pass's.
FOR_TRAINING = 0
FOR_EVALUATION = 1

OWNER, LOOKUP = "owner", "lookup"


def step_rows(tokens: list[torch.Tensor]) -> torch.Tensor:
    """The distinct token ids of a step's (or evaluation pass's) micro-batches, ascending (int64, on the host)."""
    if not tokens:
        return torch.zeros(0, dtype=torch.int64)
    return torch.unique(torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in tokens]), sorted=True)


def table_parameter(module: nn.Module, group: str) -> tuple[str, nn.Parameter]:
    """The one copy of tied group `group` a first or last stage holds, with its parameter name in `module`."""
    copies = local_copies(module).get(group, [])
    if len(copies) != 1 or len(copies[0]) != 1:
        raise ValueError(f"a stage exchanging tied table {group} by rows holds exactly one copy of it, "
                         f"this one holds {len(copies)}")
    table = copies[0][0]
    name = next(n for n, p in module.named_parameters() if p is table)
    return name, table


@dataclass
class RowExchange:
    """One end of a replica's row exchange of one tied table: `owner` (the last stage's LM head) sends rows and
    receives gradient rows, `lookup` (the first stage's embedding) the other way round. Both ends are called with
    the same token batches at the same points of a step."""

    role: str
    name: str  # the table's parameter name in its stage module (state dict key)
    table: nn.Parameter
    outbox: Outbox
    inbox: Inbox
    bytes_sent: int = 0
    _rows: torch.Tensor | None = None  # the current step's rows

    def __post_init__(self) -> None:
        if self.role not in (OWNER, LOOKUP):
            raise ValueError(f"a row exchange end is {OWNER!r} or {LOOKUP!r}, not {self.role!r}")

    def begin(self, step: int, tokens: list[torch.Tensor], purpose: int = FOR_TRAINING) -> None:
        """Bring the lookup side's copy of the rows `tokens` use up to date: the owner sends them (and returns at
        once), the lookup side waits for them and writes them into its table."""
        rows = step_rows(tokens)
        if purpose == FOR_TRAINING:
            self._rows = rows
        if self.role == OWNER:
            values = self.table.detach()[rows.to(self.table.device)]
            self._send(KIND_TIED_ROWS, step, purpose, rows, values)
            return
        values = self._receive(KIND_TIED_ROWS, step, purpose, rows)
        with torch.no_grad():
            self.table.index_copy_(0, rows.to(self.table.device), values.to(self.table.device, self.table.dtype))

    def exchange_gradients(self, step: int) -> None:
        """After the backward (and any loss-scale unscaling): the lookup side sends its gradient's rows and lets go
        of its gradient (its optimizer does not hold the table); the owner adds them to the head's gradient."""
        rows = self._rows
        if rows is None:
            raise RuntimeError("exchange_gradients before begin: the step's rows are not known")
        if self.role == LOOKUP:
            grad = self.table.grad
            values = torch.zeros(len(rows), self.table.shape[1], dtype=self.table.dtype) if grad is None \
                else grad.detach()[rows.to(grad.device)]
            self._send(KIND_TIED_GRADS, step, FOR_TRAINING, rows, values)
            self.table.grad = None
            return
        values = self._receive(KIND_TIED_GRADS, step, FOR_TRAINING, rows)
        if self.table.grad is None:
            self.table.grad = torch.zeros_like(self.table)
        self.table.grad.index_add_(0, rows.to(self.table.device), values.to(self.table.device, self.table.grad.dtype))

    def sq_norm(self) -> torch.Tensor:
        """The table's share of the whole model's squared gradient norm (float64): all of it on the owner, whose
        gradient is the whole one after `exchange_gradients`, none on the lookup side."""
        grad = self.table.grad
        if self.role == LOOKUP or grad is None:
            return torch.zeros((), dtype=torch.float64)
        return torch.tensor(float(grad.detach().double().pow(2).sum()), dtype=torch.float64)

    def flush(self) -> None:
        """Wait until everything this end sent has left (raising why it could not)."""
        self.outbox.flush()

    def close(self, abort: bool = False) -> None:
        """Stop receiving, then send what is queued and close (with `abort`, close at once)."""
        self.inbox.close()
        self.outbox.close(abort)

    def _send(self, kind: int, step: int, purpose: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        values = values.contiguous().cpu()
        header = Header(kind, step, purpose, tuple(values.shape), values.dtype, len(rows), 0)
        self.outbox.send(header, rows, values)
        self.bytes_sent += HEADER_SIZE + values.numel() * values.element_size() + 8 * len(rows)

    def _receive(self, kind: int, step: int, purpose: int, rows: torch.Tensor) -> torch.Tensor:
        self.inbox.expect(Expect(kind, step, purpose, len(rows)))
        message = self.inbox.get()
        if not torch.equal(message.ids, rows):
            raise TransportError(f"{self.inbox.peer_name} sent the rows of other tokens for tied table {self.name} "
                                 f"at step {step + 1} (the two stages disagree on the step's samples)")
        width = self.table.shape[1]
        if message.header.shape != (len(rows), width) or message.header.dtype != self.table.dtype \
                or message.payload.numel() != len(rows) * width * self.table.element_size():
            raise TransportError(f"{self.inbox.peer_name} sent rows of shape {message.header.shape} "
                                 f"{message.header.dtype} for tied table {self.name}, expected "
                                 f"{(len(rows), width)} {self.table.dtype}")
        return message.payload.view(self.table.dtype).view(len(rows), width)
