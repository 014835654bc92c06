"""Evaluation metrics and which held-out samples each replica evaluates."""

import math

import pytest
import torch

from aqpipe.pipeline.evaluate import classification_metrics, eval_batches


def test_binary_mcc_matches_its_textbook_formula():
    tp, tn, fp, fn = 30, 50, 10, 5
    confusion = torch.tensor([[tn, fp], [fn, tp]])  # rows: true 0, true 1
    got = classification_metrics(confusion)
    expected = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert got["accuracy"] == pytest.approx(80 / 95)
    assert got["mcc"] == pytest.approx(expected)


def test_mcc_is_one_for_perfect_minus_one_for_inverted_and_zero_for_constant_predictions():
    assert classification_metrics(torch.tensor([[7, 0], [0, 3]]))["mcc"] == pytest.approx(1.0)
    assert classification_metrics(torch.tensor([[0, 7], [3, 0]]))["mcc"] == pytest.approx(-1.0)
    constant = classification_metrics(torch.tensor([[0, 7], [0, 3]]))  # always predicts class 1
    assert constant["mcc"] == 0.0 and constant["accuracy"] == pytest.approx(0.3)


def test_multiclass_mcc_of_a_random_classifier_is_near_zero():
    g = torch.Generator().manual_seed(0)
    truth, guess = torch.randint(0, 3, (30000,), generator=g), torch.randint(0, 3, (30000,), generator=g)
    confusion = torch.bincount(truth * 3 + guess, minlength=9).view(3, 3)
    assert abs(classification_metrics(confusion)["mcc"]) < 0.02


def test_replicas_evaluate_every_held_out_sample_exactly_once():
    seen = torch.cat([torch.cat(eval_batches(103, r, 3, 8)) for r in range(3)])
    assert sorted(seen.tolist()) == list(range(103))
    batches = eval_batches(10, 0, 1, 4)
    assert [b.numel() for b in batches] == [4, 4, 2]  # the last micro-batch may be short, never dropped
