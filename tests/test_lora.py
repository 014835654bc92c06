"""LoRA (aqpipe.stages.lora): adapters per layer seeded by the layer's index, so a pipeline trains what one process
trains; the base stays frozen and out of the optimizer, the grad sync and the checkpoints; the merge reproduces the
adapted stage; resume and export work; bad settings are clear errors."""

import json
import os
from pathlib import Path

import pytest
import torch

from aqpipe.config import ConfigError, RunConfig, resolve
from aqpipe.runtime.plan import make_plan
from aqpipe.stages.lora import apply_lora, merged_state, training_state
from aqpipe.stages.spec import Stage
from tests import warm
from tests.distributed import run_ranks
from tests.reference import train_single_process

STEPS = 4


def config(out: Path, pp: int, dp: int = 1, model: str = "llama-tiny", **extra) -> RunConfig:
    values = dict(model=model, seq_len=32, micro_batch_size=2, micro_batches=3, steps=STEPS, lr=5e-3, warmup_steps=1,
                  seed=3, max_samples=96, eval_samples=16, device="cpu", out=str(out), fw="fp32", bw="fp32", pp=pp, dp=dp, lora=4,
                  lora_dropout=0.0)  # bit-for-bit comparisons: dropout masks depend on each process's RNG stream
    values.update(extra)
    return resolve(RunConfig(**values))


def _train(rank: int, world: int, pp: int, dp: int, partition: str, out: str) -> dict:
    from aqpipe.pipeline.world.grid import Grid
    from aqpipe.runtime.rank.assemble import assemble_stage

    torch.set_num_threads(1)
    plan = make_plan(config(Path(out), pp, dp, partition=partition))
    torch.manual_seed(plan.cfg.seed)
    stage = assemble_stage(plan, Grid(pp, dp, rank), torch.device("cpu"), "gloo")
    worker = stage.worker
    before = {k: v.clone() for k, v in worker.module.state_dict().items()}
    epochs = plan.epoch_plan(stage.grid.replica)
    losses = []
    try:
        for step in range(STEPS):
            losses.append(worker.run_step(step, epochs.micro_batches_of(step)).loss_sum)
    finally:
        worker.links.close()
    optimized = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    names = {id(p): n for n, p in worker.module.named_parameters()}
    return {"losses": losses, "before": before, "after": {k: v.clone() for k, v in worker.module.state_dict().items()},
            "optimized": sorted(names[i] for i in optimized), "checkpoint": sorted(training_state(worker.module)),
            "merged": merged_state(worker.module)}


@pytest.mark.needs("peft")
@pytest.mark.parametrize("pp,dp,partition", [(3, 1, "2,2,2"), (2, 2, "parameters"),
                                             (3, 1, "parameters")])  # the last: stage 0 is the embedding alone
def test_lora_pipeline_equals_one_process_and_trains_only_the_adapters(tmp_path, pp, dp, partition):
    outcome = run_ranks(_train, pp * dp, pp, dp, partition, str(tmp_path))
    assert all(status == "ok" for status, _ in outcome), outcome
    ranks = [value for _, value in outcome]
    ref_losses, ref_params, bounds = train_single_process(config(tmp_path / "ref", pp, dp, partition=partition))
    for step in range(STEPS):
        loss = sum(ranks[r * pp + pp - 1]["losses"][step] for r in range(dp)) / (3 * dp)
        assert abs(loss - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), step
    for rank, result in enumerate(ranks):
        stage = rank % pp
        adapters = [k for k in result["after"] if ".lora_" in k]
        assert result["optimized"] == sorted(adapters) == result["checkpoint"]  # none on an embedding-only stage
        for key, value in result["after"].items():
            if ".lora_" not in key:  # the base never moves
                assert torch.equal(value, result["before"][key]), key
            local, _, rest = key.partition(".")
            want = ref_params[f"{bounds[stage] + int(local)}.{rest}"].double()
            error = float((value.double() - want).norm() / want.norm().clamp_min(1e-30))
            assert error <= 1e-5, (rank, key, error)
        moved = [k for k in adapters if "lora_B" in k and not torch.equal(result["after"][k], result["before"][k])]
        assert bool(moved) == bool(adapters), "the adapters trained"
    with_adapters = sum(bool(r["checkpoint"]) for r in ranks)
    assert with_adapters == (pp * dp if partition != "parameters" or pp == 2 else dp), with_adapters
    for result in ranks:  # the merged weights differ from the base exactly where adapters sit
        merged, before = result["merged"], result["before"]
        assert not any(".lora_" in k or ".base_layer." in k for k in merged)
        changed = {k for k in merged if not torch.equal(merged[k], before.get(k, before.get(k.replace(
            ".weight", ".base_layer.weight"))))}
        assert bool(changed) == bool(result["checkpoint"]) and all(k.endswith("_proj.weight") for k in changed)


@pytest.mark.needs("peft")
@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
def test_merged_weights_give_the_adapted_stages_output(tmp_path, model):
    """GPT-2's Conv1D keeps its weight transposed (peft's fan_in_fan_out): the merge must follow it."""
    plan = make_plan(config(tmp_path, 1, model=model))
    stage = plan.spec.build_stage(0, len(plan.spec), 0)
    plain = plan.spec.build_stage(0, len(plan.spec), 0)
    apply_lora(stage, 0, plan.lora, 0)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    stage.eval()
    plain.eval()
    plain.load_state_dict(merged_state(stage))
    x = plan.dataset.train.inputs(torch.arange(2))
    with torch.no_grad():
        adapted, merged = stage(x), plain(x)
    assert not torch.allclose(adapted, plan.spec.build_stage(0, len(plan.spec), 0).eval()(x), atol=1e-3)
    assert torch.allclose(adapted, merged, atol=1e-5, rtol=1e-5)


@pytest.mark.needs("peft")
def test_a_classifier_head_trains_whole_and_nothing_else_but_adapters(tmp_path):
    plan = make_plan(config(tmp_path, 1, model="bert-tiny", task="classify"))
    stage = plan.spec.build_stage(0, len(plan.spec), 0)
    apply_lora(stage, 0, plan.lora, 0)
    head = stage[len(stage) - 1]
    assert all(p.requires_grad for p in head.parameters())
    others = [(n, p) for n, p in stage.named_parameters() if not n.startswith(f"{len(stage) - 1}.")]
    assert all(p.requires_grad == (".lora_" in n) for n, p in others)
    assert any(".lora_" in n for n, _ in others)


def _launch(out: Path, *extra: str) -> tuple[int, str]:
    proc = warm.run("launch", "--model", "llama-tiny", "--pp", "2",
                           "--max-samples", "64", "--seq-len", "32", "--micro-batch-size", "2", "--micro-batches", "2",
                           "--fw", "fp32", "--bw", "fp32", "--lora", "4", "--eval-samples", "16", "--out", str(out),
                           "--no-progress", *extra)
    return proc.returncode, proc.stderr


@pytest.mark.needs("peft")
def test_lora_resume_continues_exactly_and_the_export_is_merged(tmp_path):
    code, err = _launch(tmp_path / "whole", "--steps", "6")
    assert code == 0, err
    code, err = _launch(tmp_path / "cut", "--steps", "3", "--checkpoint-every", "3")
    assert code == 0, err
    rank_state = torch.load(next((tmp_path / "cut" / "checkpoints").glob("step-*/rank-0.pt")), weights_only=False)
    assert rank_state["model"] and all(".lora_" in k for k in rank_state["model"])  # the base is not in checkpoints
    code, err = _launch(tmp_path / "cut", "--resume", str(tmp_path / "cut"), "--steps", "6")
    assert code == 0, err
    read = [[json.loads(line)["loss"] for line in open(tmp_path / run / "metrics.jsonl")] for run in ("whole", "cut")]
    assert read[0] == read[1]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "cut" / "export")
    final = torch.load(tmp_path / "cut" / "checkpoints" / "final" / "stage-0.pt", weights_only=True)
    q = next(k for k in final if k.endswith("self_attn.q_proj.weight"))
    layer = int(q.split(".")[0]) - 1  # stage 0's layer 0 is the embedding
    assert torch.equal(model.model.layers[layer].self_attn.q_proj.weight, final[q])


@pytest.mark.parametrize("extra,message", [
    (dict(lora_targets="nope_proj"), "names no module of"),
    (dict(lora=0), "at least 1"),
    (dict(lora=None, lora_alpha=8.0), "add --lora R"),
    (dict(lora_alpha=-1.0), "must be positive"),
    (dict(lora_dropout=1.5), "in [0, 1)"),
])
def test_bad_lora_settings_are_clear_errors(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        make_plan(config(tmp_path, 2, **extra))


def test_a_custom_model_must_name_its_targets(tmp_path):
    with pytest.raises(ConfigError, match="--lora-targets"):
        make_plan(config(tmp_path, 2, model="tests.test_lora:tiny_spec", lora_targets=None))


def tiny_spec(vocab_size: int, seq_len: int):
    from aqpipe.stages.spec import PipelineSpec

    return PipelineSpec([lambda: torch.nn.Embedding(vocab_size, 8), lambda: torch.nn.Linear(8, vocab_size)],
                        loss=lambda out, target: torch.nn.functional.cross_entropy(out.transpose(1, 2), target))


def test_lora_without_peft_exits_2_before_any_rank_starts(tmp_path):
    """peft is optional (the llm extra): without it `--lora` is refused with the install command, not a rank's
    traceback."""
    import subprocess
    import sys

    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text("import sys\nsys.modules['peft'] = None  # as if not installed\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "hide"), str(Path(__file__).parents[1])])}
    proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", "--model", "llama-tiny", "--pp", "2", "--lora", "4",
                           "--steps", "1", "--seq-len", "16", "--max-samples", "32", "--no-progress",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "aqpipe: error: --lora needs peft: pip install peft (aqpipe's llm extra)"
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.needs("peft")
def test_a_stage_without_targets_is_left_whole_but_frozen():
    stage = Stage(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    from aqpipe.stages.lora import LoraSettings

    assert apply_lora(stage, 0, LoraSettings(2, 4.0, 0.0, ("q_proj",)), 0) == 0
    assert not any(p.requires_grad for p in stage.parameters())


@pytest.mark.needs("peft")
def test_lora_dropout_reaches_the_adapters(tmp_path):
    """--lora-dropout P puts a dropout of P on every adapter's input (peft's lora_dropout), and none without it."""
    for p in (0.0, 0.3):
        plan = make_plan(config(tmp_path, 1, lora_dropout=p))
        stage = plan.spec.build_stage(0, len(plan.spec), 0)
        apply_lora(stage, 0, plan.lora, 0)
        dropouts = [m for name, m in stage.named_modules() if name.endswith("lora_dropout.default")]
        assert dropouts, "no adapter found"
        if p == 0.0:
            assert all(isinstance(m, torch.nn.Identity) for m in dropouts)
        else:
            assert all(isinstance(m, torch.nn.Dropout) and m.p == p for m in dropouts)


@pytest.mark.needs("peft")
@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_the_adapter_directory_loads_with_peft_on_the_base(tmp_path, architecture):
    """export_adapter's directory, loaded by peft onto the base checkpoint, computes what the pipeline's adapted
    stages compute (two stages; GPT-2's Conv1D adapters are stored fan-in-fan-out)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from aqpipe.stages.export import export_adapter
    from aqpipe.stages.lora import LoraSettings, adapter_state

    torch.manual_seed(0)
    if architecture == "llama":
        from aqpipe.stages.llama import FAMILIES, llama_config, pretrained_decoder_spec

        FAMILIES["llama"].cls("ForCausalLM")(llama_config("llama-tiny", vocab_size=97)).save_pretrained(tmp_path / "base")
        spec = pretrained_decoder_spec(str(tmp_path / "base"))
        settings = LoraSettings(4, 8.0, 0.0, ("q_proj", "v_proj", "down_proj"))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        from aqpipe.stages.gpt2 import pretrained_gpt2_spec

        GPT2LMHeadModel(GPT2Config(vocab_size=97, n_layer=3, n_embd=32, n_head=4, n_positions=64)).save_pretrained(
            tmp_path / "base")
        spec = pretrained_gpt2_spec(str(tmp_path / "base"), dropout=0.0)
        settings = LoraSettings(4, 8.0, 0.0, ("c_attn", "c_fc"), fan_in_fan_out=True)
    bounds = [0, 2, len(spec)]
    stages = [spec.build_stage(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    for stage, lo in zip(stages, bounds):
        apply_lora(stage, lo, settings, seed=1)
        with torch.no_grad():
            for name, p in stage.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
        stage.eval()
    export_adapter([adapter_state(s) for s in stages], bounds, architecture, settings, str(tmp_path / "base"),
                   tmp_path / "adapter")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        pipeline = stages[1](stages[0](ids))
        loaded = model.eval()(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()(input_ids=ids).logits
    assert not torch.allclose(pipeline, plain, atol=1e-3)  # the adapters change the function
    torch.testing.assert_close(loaded, pipeline, rtol=1e-5, atol=1e-5)


@pytest.mark.needs("peft")
def test_a_launch_with_export_adapter_writes_a_peft_adapter_for_its_base(tmp_path):
    """End to end on a small pretrained Llama checkpoint (with its own tokenizer) over 2 ranks: the run's
    export-adapter/ loads with peft onto the base and computes what the merged export/ computes, the adapters moved,
    and summary.json names the directory (SmolLM2's version of this runs under -m slow)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from aqpipe.data.corpus import builtin_corpus
    from aqpipe.data.tokenizer import train_bpe
    from aqpipe.stages.llama import FAMILIES, llama_config

    base = tmp_path / "base"
    PreTrainedTokenizerFast(tokenizer_object=train_bpe(builtin_corpus(), 512).tokenizer).save_pretrained(base)
    torch.manual_seed(0)
    FAMILIES["llama"].cls("ForCausalLM")(llama_config("llama-tiny", vocab_size=512)).save_pretrained(base)
    out = tmp_path / "run"
    proc = warm.run("launch", "--model", str(base), "--pp", "2", "--steps", "2", "--warmup-steps", "0", "--lr", "1e-2",
                    "--seq-len", "32", "--max-samples", "32", "--lora", "4", "--export-adapter", "--eval-every", "0",
                    "--no-progress", "--out", str(out), env=dict(os.environ, AQPIPE_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = out / "export-adapter"
    assert json.loads((out / "summary.json").read_text())["export_adapter"] == str(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()(input_ids=ids)
        merged = AutoModelForCausalLM.from_pretrained(out / "export").eval()(input_ids=ids)
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids)
    torch.testing.assert_close(loaded.logits, merged.logits, rtol=1e-5, atol=1e-4)
    assert (loaded.logits - plain.logits).abs().max() > 1e-3  # the trained steps moved the adapters
