"""Every decoder family of the registry (aqpipe.stages.llama.FAMILIES) beyond the Llama-shaped ones test_llama.py
covers — Qwen3, Gemma 3, Phi-3, OLMo 2, GPT-NeoX — from a tiny random checkpoint saved by transformers: stage by stage
equal to the HF model, pipelined equal to one process (fp32 links, GPipe and 1F1B), exported back to a model
transformers loads with the same logits, trained under LoRA, and planned by --dry-run."""

import json

import pytest
import torch

from aqpipe.config import RunConfig, resolve
from aqpipe.launch.job import run_job
from aqpipe.stages.llama import FAMILIES, pretrained_decoder_spec
from aqpipe.stages.models import build_spec
from tests import warm
from tests.reference import train_single_process
from tests.test_llama import padded_batch, run_stages
from tests.test_train import pipeline_params, relative_error

VOCAB = 512
COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, pad_token_id=0,
              bos_token_id=0, eos_token_id=0, max_position_embeddings=128)
# each family's tiny shape: what sets it apart from Llama is switched on (Gemma 3's local layers slide within 8
# positions, shorter than the sequences)
SHAPES = {
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    "gemma3_text": dict(num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "phi3": dict(num_key_value_heads=2),
    "olmo2": dict(num_key_value_heads=2),
    "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True),
}


def checkpoint(root, kind: str, vocab: int = VOCAB):
    """A tiny random `kind` model saved by transformers (with aqpipe's BPE as its tokenizer when `vocab` is VOCAB):
    its directory and the model."""
    from transformers import PreTrainedTokenizerFast

    from aqpipe.data.corpus import builtin_corpus
    from aqpipe.data.tokenizer import train_bpe

    family = FAMILIES[kind]
    torch.manual_seed(0)
    model = family.cls("ForCausalLM")(family.config_class()(vocab_size=vocab, **COMMON, **SHAPES[kind])).eval()
    directory = root / kind
    model.save_pretrained(directory)
    if vocab == VOCAB:
        PreTrainedTokenizerFast(tokenizer_object=train_bpe(builtin_corpus(), VOCAB).tokenizer).save_pretrained(directory)
    return directory, model


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_each_family_loaded_stage_by_stage_gives_the_hf_models_logits(tmp_path, kind):
    directory, model = checkpoint(tmp_path, kind, vocab=97)
    spec = pretrained_decoder_spec(str(directory))
    ids, mask = padded_batch(97)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = run_stages(spec, [0, 2, 4, len(spec)], ids, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert spec.extras["architecture"] == kind


def config(out, model: str, **kw) -> RunConfig:
    settings = dict(model=model, seq_len=32, micro_batch_size=2, micro_batches=3, steps=4, lr=2e-3, warmup_steps=1,
                    seed=1, max_samples=64, eval_samples=16, device="cpu", out=str(out), fw="fp32", bw="fp32")
    settings.update(kw)
    return resolve(RunConfig(**settings))


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("pp,schedule", [(2, "gpipe"), (3, "1f1b")])
def test_each_family_pipelined_trains_as_one_process_and_exports_the_same_model(tmp_path, monkeypatch, kind, pp,
                                                                                 schedule):
    """fp32 links: losses and every trained parameter equal the single-process run; the export, loaded by
    transformers, gives the final stages' logits."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    directory, _ = checkpoint(tmp_path, kind)
    kw = dict(pp=pp, schedule=schedule)
    ref_losses, ref_params, bounds = train_single_process(config(tmp_path / "ref", str(directory), **kw))
    assert run_job(config(tmp_path / "run", str(directory), **kw), progress=False, starter=warm.ranks()) == 0
    run = tmp_path / "run"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    params = pipeline_params(run, bounds)
    for key, want in ref_params.items():
        assert relative_error(params[key], want) <= 1e-5, key

    hf = AutoModelForCausalLM.from_pretrained(run / "export").eval()
    assert hf.config.model_type == kind
    spec = build_spec(str(directory), VOCAB, 32)
    stages = [spec.build_stage(a, b) for a, b in zip(bounds, bounds[1:])]
    for k, stage in enumerate(stages):
        stage.load_state_dict(torch.load(run / "checkpoints" / "final" / f"stage-{k}.pt", weights_only=True))
    ids, mask = padded_batch(VOCAB)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        assert not torch.allclose(want, AutoModelForCausalLM.from_pretrained(directory).eval()(
            input_ids=ids, attention_mask=mask).logits)  # (it trained)
        hidden = ids
        for stage in stages:
            hidden = stage(hidden, mask)
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)


@pytest.mark.needs("peft")
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_each_family_trains_under_lora_in_bf16_with_recomputation_over_compressed_links(tmp_path, monkeypatch, kind):
    """Its default LoRA targets exist and train; bf16 autocast and recomputation run through its layers."""
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    directory, _ = checkpoint(tmp_path, kind)
    cfg = config(tmp_path / "run", str(directory), pp=2, steps=6, lora=4, lr=1e-2, fw="aqsgd:4", bw="directq:8",
                 warmup_epochs=0, precision="bf16", recompute=True, export_adapter=True)
    assert run_job(cfg, progress=False, starter=warm.ranks()) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    from safetensors import safe_open

    adapter = tmp_path / "run" / "export-adapter"
    targets = set(FAMILIES[kind].lora_targets)
    assert set(json.loads((adapter / "adapter_config.json").read_text())["target_modules"]) == targets
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        adapted = {key.split(".lora_A")[0].rsplit(".", 1)[-1] for key in f.keys() if ".lora_A" in key}
    assert adapted == targets, adapted


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_each_family_is_planned_by_dry_run(tmp_path, monkeypatch, capsys, kind):
    from aqpipe.cli import main

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    directory, _ = checkpoint(tmp_path, kind)
    assert main(["launch", "--model", str(directory), "--pp", "3", "--seq-len", "32", "--max-samples", "64",
                 "--dry-run", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "stage" in out and "parameters" in out.lower(), out[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_config_alone_is_planned_by_dry_run_and_refused_for_training(tmp_path, monkeypatch, capsys):
    """A checkpoint directory holding only config.json (a model to size before downloading it): --dry-run plans it
    with aqpipe's own tokenizer for the data, a launch exits 2 before anything starts."""
    from aqpipe.cli import main

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    family = FAMILIES["gemma3_text"]
    family.config_class()(vocab_size=VOCAB, **COMMON, **SHAPES["gemma3_text"]).save_pretrained(tmp_path / "gemma")
    args = ["launch", "--model", str(tmp_path / "gemma"), "--pp", "2", "--seq-len", "32", "--max-samples", "64",
            "--out", str(tmp_path / "run")]
    assert main([*args, "--dry-run"]) == 0
    assert "capacity plan" in capsys.readouterr().out
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds a config.json but no weights" in err and "--dry-run" in err and err.strip().count("\n") == 0
    assert not (tmp_path / "run").exists()


def test_a_chunked_gguf_package_is_assembled_and_hashed_once(tmp_path, monkeypatch):
    """Its assemble() hashes the whole file (240 MB for Gemma 3 270M) on every call, and every process asks for the
    model several times: once assembled and checked under $AQPIPE_CACHE, the file is taken as it is."""
    import sys
    import types

    from aqpipe.stages import models

    calls = []

    def assemble(path):
        calls.append(path)
        path.write_bytes(b"GGUF")
        return path

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "chunked_gguf_x", types.SimpleNamespace(assemble=assemble))
    monkeypatch.setitem(models.PACKAGED_GGUF, "chunked-x", models.PackagedGGUF("chunked_gguf_x", "pip install x"))
    first = models.packaged_gguf("chunked-x")
    assert models.packaged_gguf("chunked-x") == first and len(calls) == 1
    assert open(first, "rb").read() == b"GGUF"
