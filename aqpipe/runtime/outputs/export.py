"""Rank 0's exports of a finished run: the merged Hugging Face checkpoint, the LoRA adapter as a peft directory, and
the exported model's answer to a held-out question."""

from __future__ import annotations

import shutil
from pathlib import Path

from aqpipe.data.dataset import export_tokenizer
from aqpipe.disk import DiskFullError, writing
from aqpipe.pipeline import present
from aqpipe.runtime.outputs.final_weights import FinalWeights
from aqpipe.runtime.plan import RunPlan
from aqpipe.stages.export import export_adapter, export_hf
from aqpipe.stages.models import tokenizer_directory


def export_model(plan: RunPlan, final: FinalWeights | None) -> str | None:
    """Merge the final stage weights into an HF checkpoint directory `<out>/export` (None for custom models)."""
    architecture = plan.spec.extras.get("architecture")
    if architecture is None or final is None:  # a custom model (no export), or not rank 0
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with the launcher's output
    out = Path(plan.cfg.out)
    states = final.states
    tokenizer = export_tokenizer(plan.cfg.task, plan.cfg.data, tokenizer_directory(plan.cfg.model), plan.cfg.vocab_size)
    try:
        with writing(out / "export", sum(t.numel() * t.element_size() for s in states for t in s.values())):
            path = export_hf(states, plan.bounds, architecture, plan.spec.extras["hf_config"], out / "export",
                             tokenizer, plan.dataset.label_names)
    except DiskFullError:
        shutil.rmtree(out / "export", ignore_errors=True)  # a partial export must not look like a model
        raise
    return str(path)


SAMPLE_TOKENS = 48


def held_out_answer(export_dir: str, valid) -> dict:
    """The exported model's greedy answer to the first held-out conversation, beside the reference answer."""
    from aqpipe.generate import Sampling, complete, load_model

    model, tokenizer = load_model(Path(export_dir))
    answer = complete(model, tokenizer, valid.prompts[0], Sampling(max_new_tokens=SAMPLE_TOKENS))
    return {"question": valid.questions[0], "answer": answer, "reference": valid.answers[0]}


def export_adapter_dir(plan: RunPlan, final: FinalWeights) -> str:
    """Write the LoRA adapters of every stage as a peft adapter directory `<out>/export-adapter`."""
    out = Path(plan.cfg.out)
    states = present(final.adapters, "the stages' LoRA adapters")
    try:
        with writing(out / "export-adapter", sum(t.numel() * t.element_size() for s in states for t in s.values())):
            path = export_adapter(states, plan.bounds, plan.spec.extras["architecture"], plan.lora,
                                  plan.spec.extras["base_model"], out / "export-adapter")
    except DiskFullError:
        shutil.rmtree(out / "export-adapter", ignore_errors=True)
        raise
    return str(path)
