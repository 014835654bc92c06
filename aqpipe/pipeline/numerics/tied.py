"""Parameters that are one tensor in the model but have a copy on several layers or stages (DeBERTa's relative
position table): their gradients are summed over every copy, so each copy takes the same update."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aqpipe.pipeline.vocab.tied_exchanges import TiedExchange
from aqpipe.pipeline.world import comm


@dataclass(frozen=True)
class TiedGroup:
    """One tied tensor group: its parameters' shapes and how many copies the whole model holds."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    copies: int
    # An input embedding and the head that uses it (`extras["tied_rows"]`): its gradient's norm is counted on the
    # stage holding the head, whole, as with a row exchange (so the two exchanges clip alike, bit for bit).
    head_owned: bool = False


def tied_groups(extras: dict) -> list[TiedGroup]:
    """The tied groups a spec declares (`extras["tied"]`: name → shapes, `extras["tied_copies"]`: name → count)."""
    shapes, copies, head_owned = extras.get("tied", {}), extras.get("tied_copies", {}), extras.get("tied_rows", [])
    return [TiedGroup(name, tuple(tuple(s) for s in shapes[name]), int(copies[name]), name in head_owned)
            for name in sorted(shapes)]


def row_tables(extras: dict, pp: int, exchange: TiedExchange) -> list[str]:
    """The tied groups kept equal by exchanging rows (`aqpipe.pipeline.links.tied_rows`) rather than by summing whole
    gradients: those a spec declares as an input embedding on the first stage and a head on the last
    (`extras["tied_rows"]`), when those are two stages and `--tied-exchange rows` asks for it."""
    if not exchange.by_rows or pp < 2:
        return []
    return sorted(extras.get("tied_rows", []))


def local_copies(module: nn.Module) -> dict[str, list[list[nn.Parameter]]]:
    """The copies this stage holds, by group name (each copy: its parameters in declaration order)."""
    found: dict[str, list[list[nn.Parameter]]] = {}
    for sub in module.modules():
        declare = getattr(sub, "tied_parameters", None)
        if callable(declare):
            for name, params in declare().items():
                found.setdefault(name, []).append(list(params))
    return found


def tied_ids(module: nn.Module) -> set[int]:
    """`id()` of every parameter that belongs to a tied copy (kept out of the plain gradient norm)."""
    return {id(p) for copies in local_copies(module).values() for copy in copies for p in copy}


def sum_tied_grads(module: nn.Module, groups: list[TiedGroup], group, pp: int, device: torch.device) -> None:
    """Give every copy of each tied group the sum of all copies' gradients (all stages must call this; `device`: where
    the pipeline group's collectives take their tensors)."""
    _combine_copies(module, groups, group, pp, device, mean=False)


def agree_tied_grads(module: nn.Module, groups: list[TiedGroup], group, pp: int, device: torch.device) -> None:
    """After the grad sync, give every copy the mean of the copies' synchronized gradients (all stages must call
    this): a compressor that selects or randomizes per coordinate (top-k, Marsit's transient bits, PowerSGD's
    projections) can treat two copies differently, and the copies must stay one tensor — in every replica too
    (`added_in_order`)."""
    _combine_copies(module, groups, group, pp, device, mean=True)


def added_in_order(tied: TiedGroup) -> bool:
    """Whether the copies' re-agreement after the sync adds the stages' terms in stage order (`comm.ordered_sum`, an
    all-gather) rather than all-reducing them: where three copies or more may be summed, since a float sum of three
    terms depends on the order the backend adds them in, which NCCL may pick apart for each replica's pipeline (two
    add alike in either order, the other stages' zeros exactly). Before the sync the order does not matter: the sync
    makes the replicas' gradients one."""
    return tied.copies >= 3


def tied_sq_norm(module: nn.Module, groups: list[TiedGroup], last_stage: bool = True) -> torch.Tensor:
    """This stage's share of the tied gradients' squared norm: each group's (common) gradient counted once over the
    whole model, split over the copies (a head-owned group: whole on the last stage)."""
    copies = local_copies(module)
    share = torch.zeros((), dtype=torch.float64)  # float64 sums on the gradients' device: nothing is read here
    for tied in groups:
        if tied.head_owned:
            held = copies.get(tied.name, [])
            if last_stage and held:
                share = share + sum(p.grad.double().pow(2).sum() for p in held[-1] if p.grad is not None)
            continue
        for copy in copies.get(tied.name, []):
            grads = [p.grad for p in copy if p.grad is not None]
            share = share + sum(g.double().pow(2).sum() for g in grads) / tied.copies
    return share


def _combine_copies(module: nn.Module, groups: list[TiedGroup], group, pp: int, device: torch.device,
                    mean: bool) -> None:
    """Every copy of each group gets the sum (or mean) over the whole pipeline of the copies' gradients (a stage
    without copies, or without any parameter, still adds its zeros)."""
    copies = local_copies(module)
    for tied in groups:
        mine = copies.get(tied.name, [])
        total = [torch.zeros(shape, dtype=torch.float32, device=device) for shape in tied.shapes]
        for copy in mine:
            for acc, p in zip(total, copy):
                if p.grad is not None:
                    acc.add_(p.grad.to(device, torch.float32))
        flat = torch.cat([t.reshape(-1) for t in total])
        if pp > 1 and mean and added_in_order(tied):
            comm.ordered_sum(flat, comm.TIED, group=group)
        elif pp > 1:
            comm.all_reduce(flat, comm.TIED, group=group)
        if mean:
            flat.div_(tied.copies)
        pieces = list(flat.split([t.numel() for t in total]))
        for copy in mine:
            for p, piece, shape in zip(copy, pieces, tied.shapes):
                p.grad = piece.view(shape).to(p.device, p.dtype, copy=True)
