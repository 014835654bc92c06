"""Corpora, tokenization, samples with stable ids, shards and the per-epoch shuffle."""

import os

import pytest
import torch

from aqpipe.data import DataError, EpochPlan, load_corpus, prepare_lm_dataset, shard
from aqpipe.data.samples import chunk, epoch_order

WIKITEXT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "wikitext-2")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))


def test_builtin_corpus_is_offline_prose():
    corpus = load_corpus("builtin")
    assert len(corpus.train) > 300_000 and len(corpus.valid) > 20_000
    assert "the" in corpus.train and corpus.train != corpus.valid


def test_text_file_and_directory(tmp_path):
    text = "".join(f"line {i} of some text\n" for i in range(100))
    (tmp_path / "corpus.txt").write_text(text)
    corpus = load_corpus(str(tmp_path / "corpus.txt"))
    assert corpus.train + corpus.valid == text and corpus.valid.startswith("line 90 ")
    d = tmp_path / "d"
    d.mkdir()
    (d / "train.txt").write_text("train text\n")
    (d / "valid.txt").write_text("valid text\n")
    corpus = load_corpus(str(d))
    assert (corpus.train, corpus.valid) == ("train text\n", "valid text\n")


def test_a_real_corpus_file_tokenizes_into_samples():
    data = prepare_lm_dataset(WIKITEXT + "/valid.txt", 64, vocab_size=1024)
    assert len(data.train) > 1000 and len(data.valid) > 100 and data.vocab_size == 1024


def test_empty_file_and_absent_paths(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(str(tmp_path / "nope.txt"))


def test_chunks_are_consecutive_windows():
    samples = chunk(list(range(23)), 5)
    assert len(samples) == 4
    assert samples.tokens[1].tolist() == [5, 6, 7, 8, 9, 10]
    ids = torch.tensor([1])
    assert samples.inputs(ids).tolist() == [[5, 6, 7, 8, 9]] and samples.targets(ids).tolist() == [[6, 7, 8, 9, 10]]


def test_shards_are_disjoint_equal_and_cover_the_data():
    shards = [shard(103, r, 4) for r in range(4)]
    assert len({len(s) for s in shards}) == 1
    joined = torch.cat(shards)
    assert joined.unique().numel() == joined.numel() == 100


def test_epoch_shuffle_is_seeded_and_changes_per_epoch():
    ids = torch.arange(50)
    assert torch.equal(epoch_order(ids, 3, 1), epoch_order(ids, 3, 1))
    assert not torch.equal(epoch_order(ids, 3, 1), epoch_order(ids, 3, 2))
    assert sorted(epoch_order(ids, 3, 1).tolist()) == list(range(50))


def test_epoch_plan_visits_each_sample_once_per_epoch():
    plan = EpochPlan(shard(100, 1, 2), seed=0, micro_batch_size=3, micro_batches=2)
    assert plan.steps_per_epoch == 8
    seen = torch.cat([ids for step in range(8) for ids in plan.micro_batches_of(step)])
    assert seen.unique().numel() == 48 and set(seen.tolist()) <= set(range(1, 100, 2))
    assert all(len(ids) == 3 for ids in plan.micro_batches_of(9))


def test_bpe_is_trained_once_and_cached(tmp_path):
    first = prepare_lm_dataset("builtin", 32, vocab_size=512)
    assert first.vocab_size == 512 and int(first.train.tokens.max()) < 512
    cached = list((tmp_path / "cache").iterdir())
    assert any(p.name.startswith("bpe-") for p in cached) and any(p.name.startswith("samples-") for p in cached)
    again = prepare_lm_dataset("builtin", 32, vocab_size=512)
    assert torch.equal(first.train.tokens, again.train.tokens)


def test_model_tokenizer_is_used_when_the_checkpoint_has_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "text.txt").write_text("hello world " * 200 + "\n")
    data = prepare_lm_dataset(str(tmp_path / "text.txt"), 8, tokenizer_dir=str(tmp_path / "tok"))
    assert data.vocab_size == 3 and set(data.train.tokens.unique().tolist()) == {1, 2}


def test_too_little_data_for_one_sample(tmp_path):
    (tmp_path / "tiny.txt").write_text("a b\n")
    with pytest.raises(DataError, match="too short"):
        prepare_lm_dataset(str(tmp_path / "tiny.txt"), 64)


def test_bpe_training_on_long_unbroken_text_finishes_quickly(tmp_path, monkeypatch):
    """A 300,000-character run without a break trains BPE quickly: every pre-token is bounded in length (an unbounded
    one makes BPE training crawl: 100K characters take 8 s, 2 MB over 200 s)."""
    import time

    from aqpipe.data.corpus import Corpus
    from aqpipe.data.tokenizer import MAX_PRETOKEN_CHARS, bounded_pretokens, train_bpe

    assert max(len(w) for w in bounded_pretokens("x" * 1000 + " ok").split()) == MAX_PRETOKEN_CHARS
    assert bounded_pretokens("ordinary words stay as they are") == "ordinary words stay as they are"
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path))
    start = time.monotonic()
    tok = train_bpe(Corpus("long", "a" * 300_000 + "\nsome ordinary text\n", "a" * 100), 300)
    assert time.monotonic() - start < 20
    assert len(tok.encode("a" * 1000)) < 100  # it learned merges of the long run


def test_a_binary_data_file_is_refused_with_exit_2(capsys, tmp_path):
    from aqpipe.cli import main

    binary = tmp_path / "program"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 20)
    assert main(["launch", "--data", str(binary), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "is not text" in err and str(binary) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def _counting_encoders(monkeypatch) -> list[int]:
    """Count the characters every tokenizer is asked to encode (single texts and batches)."""
    from aqpipe.data.tokenizer import BPETokenizer

    seen: list[int] = []
    single, batch = BPETokenizer.encode, getattr(BPETokenizer, "encode_batch", None)

    def encode(self, text):
        seen.append(len(text))
        return single(self, text)

    def encode_batch(self, texts):
        seen.append(sum(len(t) for t in texts))
        return batch(self, texts)

    monkeypatch.setattr(BPETokenizer, "encode", encode)
    if batch is not None:
        monkeypatch.setattr(BPETokenizer, "encode_batch", encode_batch)
    return seen


def test_max_samples_tokenizes_only_what_it_needs(tmp_path, monkeypatch):
    """--max-samples 16 of a 3 MB file tokenizes the training text only until enough samples are there, not all of
    it (2 MB of one character would take past 200 s)."""
    lines = [f"line {i} says something about topic {i % 97} and more words follow here\n" for i in range(48_000)]
    path = tmp_path / "big.txt"
    path.write_text("".join(lines))
    seen = _counting_encoders(monkeypatch)
    data = prepare_lm_dataset(str(path), 32, vocab_size=512, max_samples=16)
    assert len(data.train) == 16
    valid_chars = len(load_corpus(str(path)).valid)
    assert sum(seen) - valid_chars < 300_000, sum(seen)  # 16 samples x 33 tokens need a few KB of text


def test_cut_short_samples_are_the_first_samples_of_the_whole_text(tmp_path):
    """Tokenizing piece by piece and stopping early gives exactly the windows of tokenizing the whole text at once."""
    from aqpipe.data.samples import chunk
    from aqpipe.data.tokenizer import train_bpe

    text = open(WIKITEXT + "/valid.txt").read()
    (tmp_path / "corpus.txt").write_text(text)
    corpus = load_corpus(str(tmp_path / "corpus.txt"))
    whole = chunk(train_bpe(corpus, 1024).encode(corpus.train), 64)
    full = prepare_lm_dataset(str(tmp_path / "corpus.txt"), 64, vocab_size=1024)
    assert torch.equal(full.train.tokens, whole.tokens)
    first = prepare_lm_dataset(str(tmp_path / "corpus.txt"), 64, vocab_size=1024, max_samples=40)
    assert torch.equal(first.train.tokens, whole.tokens[:40])


def test_preparing_a_large_corpus_keeps_memory_bounded(tmp_path):
    """Memory stays a small multiple of the text (tokenized in one piece, 20 MB of text would take 2-3 GB, 200 MB
    12 GB)."""
    import subprocess
    import sys

    path = tmp_path / "big.txt"
    with open(path, "w") as f:
        for i in range(6):
            f.write("a" * 1_000_000 + "\n")  # long unbroken runs
        for i in range(60_000):
            f.write(f"sentence number {i} is about subject {i % 1013}, with a few more words\n")
    # The child's own peak (VmHWM): getrusage's ru_maxrss would start at this pytest worker's peak, which it inherits
    # through subprocess's vfork+exec (908 MB in a CI run, whatever the tokenizing took).
    script = ("from aqpipe.data import prepare_lm_dataset\n"
              f"d = prepare_lm_dataset({str(path)!r}, 64, vocab_size=1024)\n"
              "peak = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:')).split()[1]\n"
              "print(len(d.train), peak)")
    env = dict(os.environ, AQPIPE_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    samples, peak_kb = map(int, out.stdout.split())
    assert samples > 1000
    assert peak_kb < 900_000, f"peak RSS {peak_kb / 1e3:.0f} MB for {path.stat().st_size / 1e6:.0f} MB of text"
