"""What a results file records about where it ran (benchmarks/provenance.py): paths inside the checkout relative to
it, so that a results file says what was measured, not where the checkout happened to lie."""

import re
from pathlib import Path

from benchmarks.provenance import ROOT, recorded

RESULTS = ROOT / "benchmarks" / "results"
# An absolute path into some checkout's benchmark folders (this one's, or one a results file was made in elsewhere)
CHECKOUT_PATH = re.compile(r"(?<![\w.~-])/[^\s\"'`]*?/benchmarks/(results|data)/")


def test_a_path_inside_the_checkout_is_recorded_relative_to_it():
    corpus = ROOT / "benchmarks" / "data" / "wikitext-2"
    assert recorded(corpus) == recorded(str(corpus)) == "benchmarks/data/wikitext-2"
    assert recorded(Path("/srv/corpus.txt")) == "/srv/corpus.txt"  # outside the checkout: as given
    assert recorded("fp32,aqsgd fw3 bw6") == "fp32,aqsgd fw3 bw6"  # text is text, wherever the script runs
    assert recorded(64) == 64


def test_settings_and_summaries_are_recorded_with_their_paths_relative_and_the_rest_as_it_is():
    out = ROOT / "benchmarks" / "results" / "x"
    settings = {"data": ROOT / "benchmarks" / "data" / "wikitext-2", "out": str(out), "epochs": 3, "lr": 1e-3,
                "variants": "fp32,defaults", "runs": [{"export": str(out / "export"), "loss": 2.5}], "none": None,
                "elsewhere": "/srv/corpus.txt"}
    assert recorded(settings) == {"data": "benchmarks/data/wikitext-2", "out": "benchmarks/results/x", "epochs": 3,
                                  "lr": 1e-3, "variants": "fp32,defaults", "none": None, "elsewhere": "/srv/corpus.txt",
                                  "runs": [{"export": "benchmarks/results/x/export", "loss": 2.5}]}


def test_the_check_finds_a_checkouts_absolute_place_wherever_it_lay():
    assert CHECKOUT_PATH.search('"out": "/tmp/bench-tree7/benchmarks/results/throughput"')
    assert CHECKOUT_PATH.search(f'"data": "{ROOT}/benchmarks/data/wikitext-2"')
    assert not CHECKOUT_PATH.search('"out": "benchmarks/results/throughput", "data": "benchmarks/data/wikitext-2"')


def test_no_results_file_records_a_checkouts_absolute_place():
    """A results file names paths inside the checkout relative to it (`recorded`), wherever it was made."""
    found = []
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".md", ".txt", ".log", ".csv"):
            hit = CHECKOUT_PATH.search(path.read_text(errors="replace"))
            if hit:
                found.append(f"{path.relative_to(ROOT)}: {hit.group(0)}")
    assert found == [], f"these results files name a checkout's absolute place: {found}"
