"""A sender/receiver pair of sibling models and their prompts (the profiler, `profile_pair`, is
kvfabric.research.droidspeak_profile).

Contract
--------
* :func:`load_sibling` loads a model by name (builtin, fine-tuned sibling or folder) for the layer runner and
  declares it: :class:`Sibling` = name, runner, tokenizer, :class:`~kvfabric.droidspeak.family.FamilyMember`.
* :func:`check_pair` raises ``ValueError`` unless the receiver may read the sender's chunks (same family,
  tokenizer fingerprint and KV layout).
* :func:`musique_prompt` turns one MuSiQue example into ``(context, question)`` token lists with the model's chat
  template: the context (system text + passages) is what the sender caches, the question is always computed.
* :func:`load_examples` reads ``count`` MuSiQue examples from ``first``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.blend.runner import LlamaRunner
from kvfabric.data import find_musique
from kvfabric.droidspeak.family import FamilyMember, tokenizer_fingerprint

SYSTEM = "You are a helpful assistant. Answer the question using the passages."
MARK = "\x00KVFABRIC\x00"


@dataclass(frozen=True, slots=True)
class Sibling:
    name: str
    runner: LlamaRunner
    tokenizer: Any
    member: FamilyMember


def load_sibling(name: str, kv_dtype: str = "float16") -> Sibling:
    from kvfabric.engines.model import ensure_model, model_family
    from kvfabric.engines.runtime import layout_for, load_for_inference

    path = ensure_model(name)
    model, tokenizer = load_for_inference(name)
    family = model_family(name) or model_family(path)
    member = FamilyMember(name, family, tokenizer_fingerprint(tokenizer), layout_for(model.config, kv_dtype))
    return Sibling(name, LlamaRunner(model), tokenizer, member)


def check_pair(sender: Sibling, receiver: Sibling) -> None:
    a, b = sender.member, receiver.member
    if not b.shares_with(a):
        raise ValueError(f"{b.model_id} cannot reuse {a.model_id}'s KV: family {a.family!r}/{b.family!r}, "
                         f"tokenizer {a.tokenizer}/{b.tokenizer}, layout {a.layout}/{b.layout}")


def musique_prompt(tokenizer: Any, example: dict, passages: int) -> tuple[list[int], list[int]]:
    """(context tokens, question tokens) of one MuSiQue example."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": MARK}],
                                         add_generation_prompt=True, tokenize=False)
    head, tail = text.split(MARK)
    docs = "".join(f"{c['title']}\n{c['text']}\n\n" for c in example["ctxs"][:passages])
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    return enc(head + docs), enc(f"Question: {example['question']}\nAnswer in a few words.{tail}")


def load_examples(data: str | Path | None, first: int, count: int) -> list[dict]:
    path = find_musique(data)
    return json.loads(path.read_text())[first:first + count]
