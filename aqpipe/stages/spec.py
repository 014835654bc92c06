"""`PipelineSpec`: a model as an ordered list of layers plus a loss, built stage by stage."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

LayerSource = nn.Module | Callable[[], nn.Module]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def host_rng(seed: int) -> Iterator[None]:
    """Run a block under the host's default generator seeded with `seed`, restored afterwards. Only the host's: a
    model is initialised on the host, and `torch.manual_seed` would also reseed every CUDA generator, leaving the
    GPUs' dropout and stochastic rounding streams at the last initialiser's seed instead of `--seed`'s."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield


class SpecError(ValueError):
    """A pipeline specification that cannot be run as written."""


class Stage(nn.Sequential):
    """Consecutive layers run as one stage; a layer with `takes_mask = True` is called as layer(x, mask).

    The mask (e.g. BERT's attention mask [B, T]) is per-sample side information that travels with the
    activations losslessly; layers without the attribute see only the tensor.

    With `recompute` set, each layer keeps only its input for backward and runs its forward again there
    (non-reentrant `torch.utils.checkpoint`, which restores the RNG so dropout draws the same mask); `on_held`, when
    set, is told of each such input (what the stage then holds for backward, which autograd's hooks no longer see).
    """

    recompute: bool = False
    adapted: bool = False  # LoRA adapters were added (aqpipe.stages.lora)
    on_held: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        recompute = self.recompute and torch.is_grad_enabled()
        for layer in self:
            if recompute:
                if self.on_held is not None:
                    self.on_held(x)
                x = checkpoint(_call, layer, x, mask, use_reentrant=False)
            else:
                x = _call(layer, x, mask)
        return x


def _call(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return layer(x, mask) if getattr(layer, "takes_mask", False) else layer(x)


@dataclass
class PipelineSpec:
    """An ordered list of layers (modules, or zero-argument factories building one) and a loss.

    Each layer maps one tensor to one tensor (a layer may also take the sample's mask, see `Stage`);
    `loss(output_of_last_layer, target)` returns a scalar. Factories let a rank build only its own layers.
    """

    layers: Sequence[LayerSource]
    loss: LossFn
    name: str = "custom"
    extras: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = list(self.layers)
        if not self.layers:
            raise SpecError("a PipelineSpec needs at least one layer")
        for i, layer in enumerate(self.layers):
            if not (isinstance(layer, nn.Module) or callable(layer)):
                raise SpecError(f"layer {i} is neither an nn.Module nor a callable building one: {type(layer).__name__}")
        if not callable(self.loss):
            raise SpecError("the loss of a PipelineSpec must be callable as loss(output, target)")

    def __len__(self) -> int:
        return len(self.layers)

    def build_layer(self, index: int, seed: int = 0) -> nn.Module:
        """Materialise layer `index`; a factory runs under an RNG seeded by (seed, index), so the same layer
        gets the same initial weights on whichever rank builds it."""
        source = self.layers[index]
        if isinstance(source, nn.Module):
            return source
        with host_rng(seed * 1_000_003 + index):
            layer = source()
        if not isinstance(layer, nn.Module):
            raise SpecError(f"the factory of layer {index} returned {type(layer).__name__}, not an nn.Module")
        return layer

    def build_stage(self, start: int, end: int, seed: int = 0) -> Stage:
        """The layers [start, end) as one module."""
        return Stage(*(self.build_layer(i, seed) for i in range(start, end)))

    def parameter_counts(self) -> list[int]:
        """Parameters per layer, counted on the meta device so nothing is allocated."""
        counts = []
        for i, source in enumerate(self.layers):
            if isinstance(source, nn.Module):
                counts.append(sum(p.numel() for p in source.parameters()))
                continue
            try:
                with torch.device("meta"):
                    layer = source()
            except Exception:  # noqa: BLE001 - a factory that cannot run on meta is built for real
                layer = self.build_layer(i)
            counts.append(sum(p.numel() for p in layer.parameters()))
            del layer
        return counts
