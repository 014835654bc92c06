"""--grad-sync specs: every method parses, every bad value gets a message naming the fix."""

import re

import pytest

from aqpipe.compress.grad import GradSpecError, build_grad_sync, check_pairing, parse_grad_spec
from aqpipe.compress.grad.base import PATTERNS, DPGroup
from aqpipe.compress.grad.methods import METHODS

EXAMPLES = ["none", "fp16", "bf16", "powersgd:2", "ef:4", "topk:0.01", "signsgd", "marsit:0", "marsit:100", "fft:0.9:10", "fft:0:32", "sidco:exp:0.01", "sidco:gamma:0.001", "sidco:gpareto:0.1", "qadam:4"]


@pytest.mark.parametrize("text", EXAMPLES)
def test_every_method_builds_and_declares_its_pattern(text):
    sync = build_grad_sync(text, DPGroup(None, (0,), 0))
    assert sync.pattern in PATTERNS
    assert sync.bytes_sent == 0 and isinstance(sync.state_dict(), dict)
    assert parse_grad_spec(text).method in METHODS


@pytest.mark.parametrize("text, message", [
    ("gzip", "not a gradient compressor"), ("powersgd", "write it as powersgd:R"), ("powersgd:0", "at least 1"),
    ("ef:9", "1..8 bits"), ("qadam:0", "1..8 bits"), ("ef:x", "must be a number"), ("topk:0", "(0, 1]"), ("topk:2", "(0, 1]"),
    ("marsit:-1", "K must be 0"), ("fft:1:8", "[0, 1)"), ("fft:0.5:20", "N must be 2..16"), ("fft:0.5", "THETA:N"),
    ("sidco:normal:0.1", "exp, gamma or gpareto"), ("sidco:exp:1", "(0, 1)"), ("sidco:exp", "DIST:F"), ("signsgd:3", "write it as signsgd"), ("none:1", "write it as none"),
])
def test_bad_specs_say_what_to_write(text, message):
    with pytest.raises(GradSpecError, match=re.escape(message)):
        parse_grad_spec(text)


def test_qadam_needs_adamw():
    check_pairing(parse_grad_spec("qadam:2"), "adamw")
    with pytest.raises(GradSpecError, match="use --optimizer adamw"):
        check_pairing(parse_grad_spec("qadam:2"), "sgd")


@pytest.mark.parametrize("text", ["signsgd", "marsit:10"])
def test_sign_methods_need_sgd(text):
    check_pairing(parse_grad_spec(text), "sgd")
    with pytest.raises(GradSpecError, match="use --optimizer sgd"):
        check_pairing(parse_grad_spec(text), "adamw")
