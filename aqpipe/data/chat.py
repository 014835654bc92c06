"""Conversations to training samples: rendered with a chat template, tokenized, and the assistant's tokens marked
as the only loss terms.

Every conversation goes through a `transformers` tokenizer's `apply_chat_template`: the model's own template, or, for
a tokenizer without one (aqpipe's BPE, base models), PLAIN_TEMPLATE's "### Instruction / ### Response" layout, which
the exported tokenizer then carries so generation prompts look like training prompts.
"""

from __future__ import annotations

import torch

from aqpipe.data.corpus import DataError
from aqpipe.data.instruct import IGNORE, InstructSamples, Message

PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n### Response:\n' }}"
    "{% else %}{{ message['content'] + eos_token + '\n\n' }}{% endif %}"
    "{% endfor %}"
)


def with_chat_template(tokenizer):
    """`tokenizer` (an HF tokenizer) with a chat template and a padding token: its own, or the plain ones."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_TEMPLATE
    if tokenizer.eos_token is None:
        raise DataError("the tokenizer has no end-of-sequence token, which instruction data needs to end a response")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def bpe_chat_tokenizer(bpe):
    """aqpipe's byte-level BPE as an HF tokenizer with the plain chat template (<|endoftext|> ends a response)."""
    from transformers import PreTrainedTokenizerFast

    special = "<|endoftext|>"
    return with_chat_template(PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer, eos_token=special,
                                                      pad_token=special, unk_token=special))


def render(messages: list[Message], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as text, and the character spans of the assistant's turns (template parts included, so the
    model learns to end its turn)."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:j], tokenize=False, add_generation_prompt=True) if j else ""
        through = tokenizer.apply_chat_template(messages[: j + 1], tokenize=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError("the tokenizer's chat template renders a conversation differently from its beginning, so "
                            "the response tokens cannot be told apart; give plain text data or another tokenizer")
        spans.append((len(before), len(through)))
    return full, spans


def last_exchange(messages: list[Message], tokenizer) -> tuple[str, str, str]:
    """The text a model continues to give the conversation's last answer, the user message before it, and the
    answer."""
    last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
    question = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
    prompt = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
    return prompt, question, messages[last]["content"]


def encode_conversations(conversations: list[list[Message]], tokenizer, seq_len: int) -> InstructSamples:
    """Tokenize conversations into right-padded samples of `seq_len` with response-only targets."""
    n = len(conversations)
    input_ids = torch.full((n, seq_len), int(tokenizer.pad_token_id), dtype=torch.int64)
    target_ids = torch.full((n, seq_len), IGNORE, dtype=torch.int64)
    attention = torch.zeros(n, seq_len, dtype=torch.uint8)
    cut = torch.zeros(n, dtype=torch.bool)
    kept, dropped = 0, 0
    exchanges: list[tuple[str, str, str]] = []
    for messages in conversations:
        text, spans = render(messages, tokenizer)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor(encoded["input_ids"], dtype=torch.int64)
        # a token is a response token when its characters overlap the answer's (a SentencePiece token may begin on
        # the template's space before the answer)
        response = torch.tensor([any(start < e and end > s for s, e in spans) for start, end in encoded["offset_mapping"]],
                                dtype=torch.bool)
        too_long = ids.numel() - 1 > seq_len
        if too_long:
            ids, response = ids[: seq_len + 1], response[: seq_len + 1]
        targets = torch.where(response[1:], ids[1:], torch.full_like(ids[1:], IGNORE))
        if not bool((targets != IGNORE).any()):
            dropped += 1
            continue
        length = ids.numel() - 1
        input_ids[kept, :length], target_ids[kept, :length], attention[kept, :length] = ids[:-1], targets, 1
        cut[kept] = too_long
        exchanges.append(last_exchange(messages, tokenizer))
        kept += 1
    prompts, questions, answers = (list(column) for column in zip(*exchanges)) if exchanges else ([], [], [])
    return InstructSamples(input_ids[:kept], target_ids[:kept], attention[:kept], cut[:kept], dropped, prompts,
                           questions, answers)
