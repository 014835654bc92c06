"""Text from a fine-tuned causal LM: the HF checkpoint a run exported, prompted (through its chat template when it
has one) and decoded greedily or by sampling."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class GenerateError(ValueError):
    """A run directory or option `aqpipe generate` cannot use (exit 2)."""


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens: greedy unless `sample`; then temperature and nucleus (top-p) sampling, seeded."""

    max_new_tokens: int = 64
    sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0


def exported_model_dir(path: str) -> Path:
    """The HF checkpoint to generate with: `<run>/export`, or `path` itself when it is one."""
    base = Path(path)
    for candidate in (base / "export", base):
        if (candidate / "config.json").is_file() and any(candidate.glob("*.safetensors")):
            return candidate
    if not base.exists():
        raise GenerateError(f"{path!r} does not exist")
    raise GenerateError(f"{path!r} holds no exported model (a finished run of a causal LM writes RUN_DIR/export)")


def load_model(directory: Path):
    """The exported causal LM (eval mode) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GenerateError(f"cannot load the model in {directory}: {first}") from None
    return model.eval(), tokenizer


def prompt_text(tokenizer, prompt: str, raw: bool = False) -> str:
    """The text the model continues: the prompt as a user turn of the chat template (unless `raw`), else as is."""
    if raw or not getattr(tokenizer, "chat_template", None):
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def complete(model, tokenizer, text: str, sampling: Sampling = Sampling()) -> str:
    """The model's continuation of `text` (special tokens removed), up to its end-of-turn token or the limit."""
    import torch

    if sampling.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be at least 1, got {sampling.max_new_tokens}")
    if sampling.sample and not (sampling.temperature > 0 and 0 < sampling.top_p <= 1):
        raise GenerateError("--temperature must be positive and --top-p in (0, 1]")
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=not getattr(tokenizer, "chat_template", None))
    options = dict(max_new_tokens=sampling.max_new_tokens, do_sample=sampling.sample, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    if sampling.sample:
        options.update(temperature=sampling.temperature, top_p=sampling.top_p)
    else:
        options.update(temperature=None, top_p=None, top_k=None)
    torch.manual_seed(sampling.seed)
    with torch.no_grad():
        out = model.generate(**encoded, **options)
    return tokenizer.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def generate(path: str, prompt: str, sampling: Sampling = Sampling(), raw: bool = False) -> str:
    """`aqpipe generate`: the answer of the model exported by the run at `path` to `prompt`."""
    model, tokenizer = load_model(exported_model_dir(path))
    return complete(model, tokenizer, prompt_text(tokenizer, prompt, raw), sampling)
