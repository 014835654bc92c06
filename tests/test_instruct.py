"""Instruction data: the formats read, response-only targets, truncation, the built-in set's held-out split, the
token-weighted step loss, and a clear error for every bad record."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from aqpipe.data.builtin_instruct import builtin_instructions
from aqpipe.data.chat import bpe_chat_tokenizer, encode_conversations
from aqpipe.data.corpus import Corpus, DataError
from aqpipe.data.instruct import IGNORE, is_instruction_data, load_instructions, read_table
from aqpipe.data.tokenizer import train_bpe
from aqpipe.pipeline.execution.worker import StageWorker
from aqpipe.stages.gpt2 import lm_loss


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # (the test tokenizer is cached in a folder of its own)
        patch.setenv("AQPIPE_CACHE", str(tmp_path_factory.mktemp("cache")))
        text = "What is the capital of France? Paris is. Name a colour. Blue and red and green. " * 50
        return bpe_chat_tokenizer(train_bpe(Corpus("t", text, ""), 300))


def conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_every_record_format_reads_as_a_conversation(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "p1", "response": "r1"},
        {"instruction": "i2", "input": "extra", "output": "o2"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u3"},
                      {"role": "assistant", "content": "a3"}]},
        {"question": "q4", "answer": "a4", "system": "be brief"},
    ]))
    rows = read_table(str(tmp_path / "a.jsonl"))
    assert rows[0] == conversation("p1", "r1")
    assert rows[1] == conversation("i2\n\nextra", "o2")
    assert rows[2][0] == {"role": "system", "content": "s"} and rows[2][2]["content"] == "a3"
    assert rows[3][0] == {"role": "system", "content": "be brief"}
    (tmp_path / "b.csv").write_text("prompt,response\nhello,world\n")
    assert read_table(str(tmp_path / "b.csv")) == [conversation("hello", "world")]
    (tmp_path / "c.tsv").write_text("instruction\toutput\nx\ty\n")
    assert read_table(str(tmp_path / "c.tsv")) == [conversation("x", "y")]
    assert is_instruction_data(str(tmp_path / "a.jsonl")) and not is_instruction_data("builtin")


@pytest.mark.parametrize("content,where,problem", [
    ('{"prompt": "p", "response": "r"}\n{"prompt": "only"}\n', "a.jsonl:2", "missing fields"),
    ('{"prompt": "p", "response": "r"}\nnot json\n', "a.jsonl:2", "not valid JSON"),
    ('{"messages": [{"role": "user", "content": "u"}]}\n', "a.jsonl:1", "no assistant message"),
    ('{"messages": "text"}\n', "a.jsonl:1", "list of"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, content, where, problem):
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(DataError, match=problem) as error:
        read_table(str(tmp_path / "a.jsonl"))
    assert where in str(error.value)


def test_a_bad_line_exits_2_through_the_launcher(tmp_path, capsys):
    from aqpipe.cli import main

    (tmp_path / "d.jsonl").write_text('{"prompt": "p", "response": "r"}\n{"instruction": "x"}\n')
    assert main(["launch", "--model", "llama-tiny", "--data", str(tmp_path / "d.jsonl"), "--out",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl:2" in err and "missing fields" in err and "Traceback" not in err


def test_loss_terms_are_the_response_tokens_only(tokenizer):
    samples = encode_conversations([conversation("What is the capital of France?", "Paris.")], tokenizer, 64)
    ids, targets, mask = samples.input_ids[0], samples.target_ids[0], samples.attention[0]
    length = int(mask.sum())
    answer = tokenizer("Paris." + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    kept = targets[targets != IGNORE].tolist()
    assert kept[: len(answer)] == answer  # the answer and its end-of-turn token are learned
    assert (targets[length:] == IGNORE).all() and (mask[length:] == 0).all()  # padding: no loss, masked
    first = int((targets != IGNORE).nonzero()[0])
    assert (targets[:first] == IGNORE).all()  # the prompt and the template: no loss
    positions = (targets[: length - 1] != IGNORE).nonzero().flatten()
    assert torch.equal(targets[positions], ids[positions + 1])  # each target is the next input token


def test_a_changed_prompt_token_changes_no_loss_term_and_a_changed_response_token_does(tokenizer):
    """With the model's outputs held fixed, the loss depends on response tokens only."""
    base = encode_conversations([conversation("What is the capital of France?", "Paris is.")], tokenizer, 64)
    other_prompt = encode_conversations([conversation("What is the colour of France?", "Paris is.")], tokenizer, 64)
    other_answer = encode_conversations([conversation("What is the capital of France?", "Blue is.")], tokenizer, 64)
    logits = torch.randn(1, 64, len(tokenizer), generator=torch.Generator().manual_seed(0))

    def terms(samples):  # per-position loss terms of the fixed logits
        return F.cross_entropy(logits[0], samples.target_ids[0], ignore_index=IGNORE, reduction="none")

    assert not torch.equal(base.input_ids, other_prompt.input_ids)
    prompt_len = int((base.target_ids[0] != IGNORE).nonzero()[0])
    shift = int((other_prompt.target_ids[0] != IGNORE).nonzero()[0]) - prompt_len
    assert shift == 0  # same token count, so the positions line up
    assert torch.equal(terms(base), terms(other_prompt))
    assert lm_loss(logits, base.target_ids) == lm_loss(logits, other_prompt.target_ids)
    assert not torch.equal(terms(base), terms(other_answer))


def test_long_conversations_are_truncated_and_counted_and_answerless_ones_dropped(tokenizer):
    long_answer = "Blue and red and green. " * 30
    samples = encode_conversations([conversation("Name a colour.", long_answer),
                                    conversation("Name a colour. " * 40, "Blue."),
                                    conversation("What is it?", "Paris.")], tokenizer, 50)
    # the long prompt leaves no response token within 50: dropped, not counted again as truncated
    assert samples.truncated == 1 and samples.dropped == 1 and len(samples) == 2
    assert int(samples.attention[0].sum()) == 50  # cut to the sequence length
    assert samples.questions == ["Name a colour.", "What is it?"] and samples.answers[1] == "Paris."
    assert samples.head(1).truncated == 1


def test_the_truncation_count_is_of_the_samples_the_run_uses(tmp_path, monkeypatch):
    """--max-samples keeps the first N training conversations: the summary counts the cuts among those (and the
    held-out ones), not among conversations the run never sees."""
    from aqpipe.data.dataset import prepare_instruct_dataset

    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    long = "Blue and red and green. " * 30
    rows = [{"prompt": f"Name colour {i}.", "response": long if i >= 4 else "Blue."} for i in range(20)]
    (tmp_path / "f.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    full = prepare_instruct_dataset(str(tmp_path / "f.jsonl"), 48, vocab_size=300)
    head = prepare_instruct_dataset(str(tmp_path / "f.jsonl"), 48, vocab_size=300, max_samples=4)
    assert full.info["truncated"] == 16  # 14 of 18 training rows and both held-out rows (9, 19) are long
    assert head.info["truncated"] == 2  # the first 4 training rows are short; only the held-out ones count


def test_the_step_loss_is_a_mean_over_response_tokens_not_over_micro_batches():
    """Micro-batches with 3 and 1 response tokens: weights 3/4 and 1/4."""
    targets = torch.full((2, 4), IGNORE)
    targets[0, :3] = 1
    targets[1, 0] = 1
    samples = SimpleNamespace(loss_tokens=lambda ids: int((targets[ids] != IGNORE).sum()))
    worker = SimpleNamespace(samples=samples, grid=SimpleNamespace(dp=1))
    assert StageWorker._loss_weights(worker, [torch.tensor([0]), torch.tensor([1])]) == [0.75, 0.25]
    assert StageWorker._loss_weights(SimpleNamespace(samples=object()), [torch.tensor([0])]) is None


def test_the_builtin_set_is_real_and_its_held_out_answers_never_appear_in_training():
    train, valid = builtin_instructions()
    assert len(train) > 1000 and len(valid) > 40
    assert ("What is the Unicode name of the character 'é'?", "'é' is U+00E9, LATIN SMALL LETTER E WITH ACUTE.") in \
        train + valid
    norm = lambda text: " ".join(text.lower().split())  # noqa: E731
    train_answers, train_questions = {norm(a) for _, a in train}, {q for q, _ in train}
    assert not any(norm(a) in train_answers for _, a in valid)
    assert not any(q in train_questions for q, _ in valid)
    assert builtin_instructions() == (train, valid)  # the same on every call
    data = load_instructions("builtin-instruct")
    assert len(data.train) == len(train) and data.valid[0][-1]["content"] == valid[0][1]


def test_a_file_holds_out_every_tenth_example_and_a_directory_its_valid_table(tmp_path):
    rows = [json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(20)]
    (tmp_path / "f.jsonl").write_text("\n".join(rows))
    data = load_instructions(str(tmp_path / "f.jsonl"))
    assert len(data.train) == 18 and [c[0]["content"] for c in data.valid] == ["p9", "p19"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text("\n".join(rows[:5]))
    (tmp_path / "d" / "valid.jsonl").write_text("\n".join(rows[5:7]))
    data = load_instructions(str(tmp_path / "d"))
    assert len(data.train) == 5 and len(data.valid) == 2 and is_instruction_data(str(tmp_path / "d"))


@pytest.mark.needs("datasets")
def test_a_hub_dataset_with_instruction_columns_is_read_as_conversations(monkeypatch):
    import datasets

    fake = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"instruction": [f"i{k}" for k in range(4)], "input": ["", "x", "", ""],
                                             "output": [f"o{k}" for k in range(4)]}),
        "test": datasets.Dataset.from_dict({"instruction": ["t"], "output": ["u"]}),
    })
    monkeypatch.setattr(datasets, "load_dataset", lambda path, config=None: fake)
    assert is_instruction_data("someone/alpaca-like")
    data = load_instructions("someone/alpaca-like")
    assert data.train[1] == conversation("i1\n\nx", "o1") and data.valid == [conversation("t", "u")]
    plain = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c"]})})
    monkeypatch.setattr(datasets, "load_dataset", lambda path, config=None: plain)
    assert not is_instruction_data("someone/wikitext-like")


def test_a_quoted_csv_cell_keeps_its_line_breaks_and_a_bom_is_ignored(tmp_path):
    (tmp_path / "m.csv").write_bytes('\ufeffprompt,response\n"two\nlines","a\nb"\n'.encode())
    assert read_table(str(tmp_path / "m.csv")) == [conversation("two\nlines", "a\nb")]


@pytest.mark.parametrize("record,message", [
    ({"prompt": "p", "response": 3}, "field 'response' is int"),
    ({"prompt": "", "response": "r"}, "field 'prompt' is empty"),
])
def test_a_field_of_the_wrong_kind_is_named(tmp_path, record, message):
    (tmp_path / "w.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=message) as error:
        read_table(str(tmp_path / "w.jsonl"))
    assert "w.jsonl:1" in str(error.value)
