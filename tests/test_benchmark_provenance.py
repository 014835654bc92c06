"""What a results file records about where it ran (benchmarks/provenance.py): paths inside the checkout relative to
it, so that a results file says what was measured, not where the checkout happened to lie."""

from pathlib import Path

from benchmarks.provenance import ROOT, shown_path

RESULTS = ROOT / "benchmarks" / "results"


def test_a_path_inside_the_checkout_is_recorded_relative_to_it():
    assert shown_path(ROOT / "benchmarks" / "data" / "wikitext-2") == "benchmarks/data/wikitext-2"

    assert shown_path(Path("/srv/corpus.txt")) == "/srv/corpus.txt"  # outside the checkout: as given
    assert shown_path("fp32,aqsgd fw3 bw6") == "fp32,aqsgd fw3 bw6"  # text is text, wherever the script runs
    assert shown_path(64) == "64" and shown_path(None) == "None"


def test_no_results_file_records_the_checkouts_own_place():
    """Measured in this checkout, a results file names paths inside it relative to it (`shown_path`)."""
    place = f"{ROOT}/"
    found = []
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".md", ".txt", ".log", ".csv"):
            if place in path.read_text(errors="replace"):
                found.append(str(path.relative_to(ROOT)))
    assert found == [], f"these results files name the checkout's absolute path {place}: {found}"
