"""Model factories the benchmarks train through `--model benchmarks.models:<name>` (run from the repository root)."""

from transformers import GPT2Config

from aqpipe.stages.gpt2 import gpt2_spec


def gpt2_6x128(vocab_size: int, seq_len: int):
    """6 GPT-2 blocks of hidden 128 (4 heads), no dropout: the convergence benchmark's model."""
    config = GPT2Config(vocab_size=vocab_size, n_layer=6, n_embd=128, n_head=4, n_positions=max(seq_len, 128),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return gpt2_spec(config, name="gpt2-6x128")


def gpt2_2x128(vocab_size: int, seq_len: int):
    """2 GPT-2 blocks of hidden 128 (4 heads), no dropout: with --pp 2 one block per stage, the throughput
    benchmark's communication-bound model (comm/compute grows as hidden size and depth shrink)."""
    config = GPT2Config(vocab_size=vocab_size, n_layer=2, n_embd=128, n_head=4, n_positions=max(seq_len, 128),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return gpt2_spec(config, name="gpt2-2x128")


def gpt2_4x128(vocab_size: int, seq_len: int):
    """4 GPT-2 blocks of hidden 128 (4 heads), no dropout: with --pp 4 and --partition 2,1,1,2 one block per stage,
    the throughput benchmark's 4-stage model."""
    config = GPT2Config(vocab_size=vocab_size, n_layer=4, n_embd=128, n_head=4, n_positions=max(seq_len, 128),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return gpt2_spec(config, name="gpt2-4x128")


def llama_tied_4x128(vocab_size: int, seq_len: int):
    """4 Llama decoder layers of hidden 128 (4 heads, 2 KV heads), no dropout, with SmolLM2's real vocabulary of
    49,152 rows (rows past the run's tokenizer stay unused) and the input embedding tied to the LM head: the
    tied-embedding benchmark's model (with --pp 4 and --partition 2,1,1,2 one decoder layer per stage)."""
    from transformers import LlamaConfig

    from aqpipe.stages.llama import decoder_spec

    config = LlamaConfig(vocab_size=max(vocab_size, 49152), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(seq_len, 128),
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                         attention_dropout=0.0)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    spec = decoder_spec(config, name="llama-tied-4x128")
    # no HF export: the benchmark measures training steps, and at its 1 Mbit/s an export's gather of every stage's
    # weights to rank 0 would take minutes (only the head's tied table travels at the end, for stage 0's weights)
    del spec.extras["architecture"]
    return spec
