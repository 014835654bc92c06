"""Converting a GGUF file: what the conversion reads once. (The conversion of a real GGUF: tests/test_smollm2.py; a
GGUF's architecture and the errors a user may meet: tests/test_llama.py.)"""

import pytest

from aqpipe.stages import gguf as conversion

pytestmark = pytest.mark.needs("gguf")


def test_a_conversion_parses_a_files_metadata_once_and_builds_each_name_table_once(monkeypatch):
    """transformers parsed a GGUF's metadata for the config and again for the tokenizer, and gguf built its tensor
    name table once per module of the model: within a conversion each happens once, every caller gets a copy of its
    own, the weights' read is left alone, and afterwards both libraries are as they were."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    parses, tables = [], []

    def parse(path, return_tensors=False, model_to_load=None):
        parses.append((path, return_tensors))
        return {"config": {"model_type": "llama"}, "tokenizer": {"tokens": ["a", "b"]}}

    def names(arch, layers):
        tables.append((arch, layers))
        return object()

    monkeypatch.setattr(loader, "load_gguf_checkpoint", parse)
    monkeypatch.setattr(gguf, "get_tensor_name_map", names)
    with conversion._metadata_parsed_once():
        first, second = loader.load_gguf_checkpoint("m.gguf"), loader.load_gguf_checkpoint("m.gguf", return_tensors=False)
        assert first == second and first is not second and first["tokenizer"] is not second["tokenizer"]
        loader.load_gguf_checkpoint("m.gguf", return_tensors=True, model_to_load=None)
        assert gguf.get_tensor_name_map(1, 30) is gguf.get_tensor_name_map(1, 30)
        assert gguf.get_tensor_name_map(2, 30) is not gguf.get_tensor_name_map(1, 30)
    assert parses == [("m.gguf", False), ("m.gguf", True)]
    assert tables == [(1, 30), (2, 30)]
    assert loader.load_gguf_checkpoint is parse and gguf.get_tensor_name_map is names
