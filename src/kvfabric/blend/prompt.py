"""RAG prompts as segments: the chat template's head, one segment per passage, the question with the template's
tail. Each part is tokenized on its own, so a passage has the same tokens in every prompt, wherever it sits (what
`Blender.cache_passage` stores and `Blender.prefill` reuses)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PLACEHOLDER = "\x00KVFABRIC\x00"


def chat_parts(tokenizer: Any, system: str) -> tuple[str, str]:
    """(text before the user content, text after it) of the chat template, generation prompt included."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": PLACEHOLDER}],
            add_generation_prompt=True, tokenize=False)
        head, tail = text.split(PLACEHOLDER)
        return head, tail
    return system + "\n\n", "\nAnswer:"


def rag_segments(tokenizer: Any, system: str, passages: Sequence[str], question: str) -> list[list[int]]:
    """[head, *passages, question + tail] as token lists; the last segment is what a prefill always computes."""
    head, tail = chat_parts(tokenizer, system)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return [encode(head), *map(encode, passages), encode(question + tail)]
