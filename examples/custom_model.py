import torch.nn.functional as F
from torch import nn

import aqpipe


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def tiny_lm(vocab_size: int, width: int = 128) -> aqpipe.PipelineSpec:
    layers = [lambda: nn.Embedding(vocab_size, width)]  # factories: each rank builds only its own layers
    layers += [lambda: Block(width) for _ in range(4)]
    layers += [lambda: nn.Linear(width, vocab_size)]
    return aqpipe.PipelineSpec(layers, loss=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))


if __name__ == "__main__":
    raise SystemExit(aqpipe.train(tiny_lm, pp=3, steps=30, lr=1e-3, seq_len=32))
