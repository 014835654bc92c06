"""Llama-family decoders as pipeline layers: equal to `transformers`' own models, pipeline = single process, tied
embeddings kept one tensor across stages, export round trip, and the bad inputs a user can give."""

import json
from pathlib import Path

import pytest
import torch

from aqpipe.config import RunConfig, resolve
from aqpipe.launch.job import run_job
from aqpipe.stages.llama import FAMILIES, PRESETS, decoder_spec, llama_config, pretrained_decoder_spec
from aqpipe.stages.models import build_spec, classify_model
from aqpipe.stages.spec import SpecError
from tests import warm
from tests.reference import train_single_process
from tests.test_train import pipeline_params, relative_error


def padded_batch(vocab: int, batch: int = 3, length: int = 20, seed: int = 0):
    """Token ids and a right-padding mask (the second row ends early)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.uint8)
    mask[1, length - 6:] = 0
    return ids, mask


def run_stages(spec, bounds, ids, mask):
    hidden = ids
    for start, end in zip(bounds, bounds[1:]):
        hidden = spec.build_stage(start, end)(hidden, mask)
    return hidden


def assert_export_matches_the_final_stages(run, preset: str) -> None:
    """The exported HF model's logits on a padded batch equal those of the run's final stages."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(run / "export").eval()
    spec = build_spec(preset, hf.config.vocab_size, 32)
    bounds = json.loads((run / "config.json").read_text())["stage_bounds"]
    stages = [spec.build_stage(a, b) for a, b in zip(bounds, bounds[1:])]
    for k, stage in enumerate(stages):
        stage.load_state_dict(torch.load(run / "checkpoints" / "final" / f"stage-{k}.pt", weights_only=True))
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        hidden = ids
        for stage in stages:
            hidden = stage(hidden, mask)
        want = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)


def qwen2_sliding_config():
    """A Qwen2 whose last two layers attend within a window of 8 (shorter than the test sequences)."""
    config = FAMILIES["qwen2"].cls("Config")(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                             sliding_window=8, max_window_layers=2)
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    return config


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "mistral-tiny", "qwen2-sliding"])
def test_each_family_loads_a_checkpoint_and_matches_the_hf_model(tmp_path, preset):
    """A Llama-, Qwen2- and Mistral-shaped model saved by transformers, loaded stage by stage, gives the HF model's
    logits on a padded batch, padded positions included (Mistral's and one Qwen2's with a sliding window shorter
    than the sequence); the padding mask matters (without it the padded positions differ)."""
    config = qwen2_sliding_config() if preset == "qwen2-sliding" else llama_config(preset, vocab_size=97)
    family = FAMILIES[config.model_type]
    torch.manual_seed(0)
    hf = family.cls("ForCausalLM")(config).eval()
    hf.save_pretrained(tmp_path / "ckpt")
    spec = pretrained_decoder_spec(str(tmp_path / "ckpt"))
    ids, mask = padded_batch(97)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        got = run_stages(spec, [0, 2, 4, len(spec)], ids, mask)
        unmasked = run_stages(spec, [0, 2, 4, len(spec)], ids, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[1, -6:], want[1, -6:], atol=1e-3)


@pytest.mark.parametrize("preset", ["qwen2-tiny", "mistral-tiny"])
def test_qwen2_and_mistral_shaped_models_train_through_the_launcher(tmp_path, preset):
    assert run_job(llama_config_for(tmp_path / "run", model=preset, pp=2, fw="aqsgd:4", bw="directq:8"),
                   progress=False, starter=warm.ranks()) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert json.loads((tmp_path / "run" / "export" / "config.json").read_text())["model_type"] == preset.split("-")[0]
    assert_export_matches_the_final_stages(tmp_path / "run", preset)


def test_a_stage_needs_only_hidden_states_and_the_mask_from_its_peer():
    """Rotary positions come from the sequence length on each stage: a later stage fed the earlier stage's hidden
    states and the mask (all a link carries) computes what the whole model computes."""
    spec = decoder_spec(llama_config("llama-tiny", 50))
    ids, mask = padded_batch(50)
    with torch.no_grad():
        hidden = spec.build_stage(0, 3)(ids, mask)
        assert hidden.shape == (3, 20, PRESETS["llama-tiny"]["hidden_size"])
        split = spec.build_stage(3, len(spec))(hidden.clone(), mask.clone())
        whole = spec.build_stage(0, len(spec))(ids, mask)
    torch.testing.assert_close(split, whole, rtol=0, atol=0)


@pytest.mark.parametrize("cache_name", ["cache", "past_key_values"])
def test_a_stage_builds_its_mask_with_either_name_of_the_masking_cache_argument(monkeypatch, cache_name):
    """transformers renamed create_causal_mask's fourth parameter (past_key_values up to 5.17, cache later); a stage
    works with both (transformers 5.17 on a GPU machine failed with `unexpected keyword argument 'cache'`)."""
    import transformers.masking_utils as masking

    # The stage is built first: a transformers module first imported while the stand-in is in place would keep it
    # (`from ..masking_utils import create_causal_mask`) for the tests that run after this one.
    stage = decoder_spec(llama_config("llama-tiny", 50)).build_stage(0, 2)
    calls: list = []
    namespace: dict = {}
    exec(f"def shaped(config, inputs_embeds, attention_mask, {cache_name}, position_ids=None):\n"
         f"    calls.append({cache_name!r})\n"
         f"    return real(config, inputs_embeds, attention_mask, {cache_name}, position_ids=position_ids)",
         {"real": masking.create_causal_mask, "calls": calls}, namespace)
    monkeypatch.setattr(masking, "create_causal_mask", namespace["shaped"])
    ids, mask = padded_batch(50)
    with torch.no_grad():
        assert stage(ids, mask).shape[:2] == ids.shape
    assert calls == [cache_name]  # the stage called the stand-in


def test_a_stage_run_after_the_plans_fake_trace_of_the_same_shape_computes_real_values():
    """The layers of a stage share one causal mask; one built inside the capacity plan's trace (fake tensors,
    `FakeTensorMode`) in the same process is never taken for a real forward's (whose output would be fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = decoder_spec(llama_config("llama-tiny", 50))
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            spec.build_stage(0, 3)(mode.from_tensor(ids), None)
        got = spec.build_stage(0, 3)(ids, None)
        want = spec.build_stage(0, 3)(ids, torch.ones_like(ids))  # (no padding: the same causal mask, built anew)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, want)


def test_the_layers_of_a_stage_build_one_causal_mask_per_forward(monkeypatch):
    import transformers.masking_utils as masking

    spec = decoder_spec(llama_config("llama-tiny", 50))
    stage = spec.build_stage(0, len(spec))
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    real, built = masking.create_causal_mask, []
    monkeypatch.setattr(masking, "create_causal_mask", lambda *a, **kw: built.append(1) or real(*a, **kw))
    with torch.no_grad():
        stage(ids, torch.ones_like(ids))
        stage(ids, torch.ones_like(ids))  # (another padding mask: another causal mask)
    assert len(spec) > 3 and len(built) == 2


def test_a_random_init_tied_model_starts_with_equal_copies_on_different_ranks():
    spec = decoder_spec(llama_config("llama-tiny", 80))
    embed, head = spec.build_layer(0, seed=3), spec.build_layer(len(spec) - 1, seed=3)
    assert torch.equal(embed.embed_tokens.weight, head.lm_head.weight)
    assert spec.extras["tied"] == {"embed_tokens": [(80, 64)]} and spec.extras["tied_copies"] == {"embed_tokens": 2}


def llama_config_for(out, **kw) -> RunConfig:
    settings = dict(model="llama-tiny", seq_len=32, micro_batch_size=2, micro_batches=3, steps=6, lr=2e-3,
                    warmup_steps=2, seed=1, max_samples=96, eval_samples=16, device="cpu", out=str(out), clip=0.5, fw="fp32", bw="fp32")
    settings.update(kw)
    return resolve(RunConfig(**settings))


@pytest.mark.parametrize("pp", [2, 3])  # the tied copies on neighbouring stages, and across a middle stage
def test_llama_pipeline_matches_single_process(tmp_path, pp):
    """Plain-text LM training of the tied llama-tiny: losses and every parameter equal the single-process run."""
    ref_losses, ref_params, bounds = train_single_process(llama_config_for(tmp_path / "ref", pp=pp))
    assert run_job(llama_config_for(tmp_path / "run", pp=pp), progress=False, starter=warm.ranks()) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    params = pipeline_params(tmp_path / "run", bounds)
    assert params.keys() == ref_params.keys()
    for key, want in ref_params.items():
        assert relative_error(params[key], want) <= 1e-5, key


@pytest.mark.parametrize("pp,dp", [(3, 1), (2, 2)])
def test_instruction_pipeline_matches_single_process(tmp_path, monkeypatch, pp, dp):
    """Instruction data (padding masks on the links, response-only token-weighted loss, each replica's own token
    count) with fp32 links."""
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    kw = dict(data="builtin-instruct", pp=pp, dp=dp, seq_len=48)
    ref_losses, ref_params, bounds = train_single_process(llama_config_for(tmp_path / "ref", **kw))
    assert run_job(llama_config_for(tmp_path / "run", **kw), progress=False, starter=warm.ranks()) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    params = pipeline_params(tmp_path / "run", bounds)
    for key, want in ref_params.items():
        assert relative_error(params[key], want) <= 1e-5, key


def test_tied_embedding_stays_one_tensor_under_aqsgd_and_the_export_matches_the_pipeline(tmp_path, monkeypatch, capsys):
    """pp=3 with AQ-SGD links: the embedding (stage 0) and LM head (stage 2) end bit-identical and trained; the
    export is tied, loads with AutoModelForCausalLM, and its logits equal the pipeline's on a padded batch."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    cfg = llama_config_for(tmp_path / "run", data="builtin-instruct", pp=3, fw="aqsgd:3", bw="directq:6",
                           warmup_epochs=0, steps=8)
    assert run_job(cfg, progress=False, starter=warm.ranks()) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line.startswith("held-out prompt: ") and " -> model: " in last_line
    final = tmp_path / "run" / "checkpoints" / "final"
    first, last = (torch.load(final / f"stage-{k}.pt", weights_only=True) for k in (0, 2))
    embed, head = first["0.embed_tokens.weight"], last[f"{len(last) and max(int(k.split('.')[0]) for k in last)}.lm_head.weight"]
    assert torch.equal(embed, head)
    spec = build_spec("llama-tiny", embed.shape[0], 32)
    assert not torch.equal(embed, spec.build_layer(0, seed=1).embed_tokens.weight)  # it trained

    export = tmp_path / "run" / "export"
    hf = AutoModelForCausalLM.from_pretrained(export).eval()
    from transformers import AutoTokenizer

    assert "### Instruction" in AutoTokenizer.from_pretrained(export).chat_template  # the template it trained with
    assert hf.config.tie_word_embeddings and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # written once
    assert_export_matches_the_final_stages(tmp_path / "run", "llama-tiny")

    from aqpipe.cli import main
    from aqpipe.generate import Sampling, complete, load_model, prompt_text

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    question = summary["sample"]["question"]
    assert question in last_line and repr(summary["sample"]["answer"]) in last_line
    model, tokenizer = load_model(export)
    text = prompt_text(tokenizer, question)
    assert text.startswith("### Instruction:\n" + question)
    greedy = complete(model, tokenizer, text, Sampling(max_new_tokens=6))
    assert greedy == complete(model, tokenizer, text, Sampling(max_new_tokens=6))  # greedy is deterministic
    sampled = [complete(model, tokenizer, text, Sampling(max_new_tokens=6, sample=True, temperature=2.0, seed=s))
               for s in range(4)]
    assert len(set(sampled)) > 1  # sampling at a high temperature varies with the seed
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", question, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == greedy
    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "x"]) == 2


def test_a_checkpoint_of_an_uncovered_architecture_exits_2_naming_it(tmp_path, capsys):
    from aqpipe.cli import main

    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(SpecError, match="t5.*llama, qwen2, qwen3, mistral, gemma3_text, phi3, olmo2, gpt_neox"):
        classify_model(str(tmp_path / "t5"))
    assert main(["launch", "--model", str(tmp_path / "t5"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "is a t5 checkpoint" in err and "llama, qwen2, qwen3, mistral" in err and "Traceback" not in err
    assert "module:function" in err


def test_a_gguf_file_without_the_gguf_package_names_the_install(tmp_path, monkeypatch):
    from aqpipe.stages.gguf import gguf_architecture

    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # as if not installed
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(SpecError, match=r"is a GGUF file: install the gguf package \(pip install gguf accelerate\)"):
        gguf_architecture(str(tmp_path / "m.gguf"))


@pytest.mark.needs("gguf")
def test_a_gguf_of_an_uncovered_architecture_exits_2_naming_it(tmp_path, capsys):
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from aqpipe.cli import main

    assert main(["launch", "--model", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "'phi2'" in err and "llama, qwen2, qwen3, mistral, gemma3, phi3" in err and "Traceback" not in err
    assert "module:function" in err


@pytest.mark.needs("gguf")
def test_a_gguf_files_architecture_is_read_without_parsing_its_whole_metadata(tmp_path, monkeypatch):
    """gguf's reader parses every field, a tokenizer's whole vocabulary included: 4-5 s for SmolLM2's file before a
    conversion could start. The architecture comes from transformers' reader, which leaves string arrays unread."""
    import gguf

    from aqpipe.stages.gguf import gguf_architecture

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(1000)])
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def refuse(*args, **kwargs):
        raise AssertionError("gguf's reader parsed the whole file")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    assert gguf_architecture(str(path)) == "llama"


def test_seq_len_beyond_the_context_exits_2(tmp_path, capsys):
    from aqpipe.cli import main

    assert main(["launch", "--model", "llama-tiny", "--seq-len", "1024", "--out", str(tmp_path / "run")]) == 2
    assert "exceeds" in capsys.readouterr().err
    with pytest.raises(SpecError, match="512 positions"):
        build_spec("llama-tiny", 100, 513)


def test_each_stage_reads_only_its_own_tensors(tmp_path):
    """The embedding, a decoder layer and the head ask the checkpoint only for their own prefixes (tied head: the
    embedding's tensor, once)."""
    from aqpipe.stages.hf_weights import CheckpointWeights

    config = llama_config("llama-tiny", vocab_size=97)
    FAMILIES["llama"].cls("ForCausalLM")(config).save_pretrained(tmp_path / "ckpt")
    spec = pretrained_decoder_spec(str(tmp_path / "ckpt"))
    asked: list[str] = []
    original = CheckpointWeights.__call__

    def recording(self, prefix):
        asked.append(prefix)
        return original(self, prefix)

    CheckpointWeights.__call__ = recording
    try:
        read = {}
        for index in (0, 2, len(spec) - 1):
            asked.clear()
            spec.build_layer(index)
            read[index] = list(asked)
    finally:
        CheckpointWeights.__call__ = original
    assert read == {0: ["model.embed_tokens."], 2: ["model.layers.1."],
                    len(spec) - 1: ["model.norm.", "model.embed_tokens."]}


def test_architecture_presets_have_their_real_shapes_for_planning():
    """Llama 3.2 1B: 16 layers of 60.8M parameters and a 128,256 × 2,048 embedding, tied (so held twice, once on
    each end of the pipeline), whatever tokenizer the run trains."""
    counts = build_spec("llama-3.2-1b-arch", 4096, 128).parameter_counts()
    assert len(counts) == 18 and counts[0] == counts[-1] - 2048 == 128256 * 2048
    assert counts[1] == 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert sum(counts) - counts[-1] + 2048 == pytest.approx(1.236e9, rel=1e-3)  # the published 1.24B


def test_a_hub_repository_with_pytorch_pickles_only_is_fetched_with_them(tmp_path, monkeypatch):
    """Safetensors first; a repository that has none is fetched again with its pytorch_model*.bin files."""
    import fnmatch

    import huggingface_hub

    from aqpipe.stages.models import hub_snapshot

    files = {"old/org": ["config.json", "pytorch_model.bin", "tokenizer.json"],
             "new/org": ["config.json", "model.safetensors", "pytorch_model.bin"]}
    calls = []

    def fake_download(repo_id, allow_patterns):
        calls.append(repo_id)
        directory = tmp_path / repo_id.replace("/", "--") / str(len(calls))
        directory.mkdir(parents=True)
        for name in files[repo_id]:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (directory / name).write_text("x")
        return str(directory)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    old = hub_snapshot("old/org")
    assert sorted(p.name for p in Path(old).iterdir()) == ["config.json", "pytorch_model.bin", "tokenizer.json"]
    new = hub_snapshot("new/org")
    assert sorted(p.name for p in Path(new).iterdir()) == ["config.json", "model.safetensors"]  # no pickles needed
    assert calls == ["old/org", "old/org", "new/org"]


@pytest.mark.needs("peft")
def test_building_stages_never_reseeds_a_cuda_generator(monkeypatch):
    """A stage is initialised under the host's generator only: `torch.manual_seed` inside the initialisers would
    also reseed every CUDA generator, leaving a GPU's dropout and stochastic rounding at the last layer's
    seed instead of `--seed`'s. Its host stream is unchanged: the same layer gets the same weights."""
    import torch

    from aqpipe.stages.llama import decoder_spec, llama_config
    from aqpipe.stages.lora import LoraSettings, apply_lora

    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: reseeded.append(seed))
    spec = decoder_spec(llama_config("llama-tiny", 50))
    stage = spec.build_stage(0, len(spec), seed=3)
    apply_lora(stage, 0, LoraSettings(4, 8.0, 0.0, ("q_proj",)), seed=3)
    again = spec.build_stage(0, len(spec), seed=3)
    assert torch.equal(stage[1].layer.self_attn.k_proj.weight, again[1].layer.self_attn.k_proj.weight)
    assert reseeded == []
