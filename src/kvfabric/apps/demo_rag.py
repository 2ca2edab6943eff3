"""`kvfabric demo --rag`: the main job's RAG variant (CacheBlend) on the shipped document, no data set needed.

The demo document is split into passages (one per section). Each passage's KV is computed once, alone, and cached
(memory tier). Then each question "retrieves" the passages that share the most words with it (a stand-in for a
retriever), so every prompt holds the passages in its own order: a prefix cache would reuse nothing past the
system prompt. Each question is answered twice, with a full prefill and with CacheBlend (cached passages reused at
their new offsets, the tokens that matter recomputed), and a table shows the TTFT and the two answers side by side.
"""
from __future__ import annotations

import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from kvfabric.config import Config, CpuTierConfig
from kvfabric.data import demo_document

QUESTIONS = (
    "Who founded Halvor's Point, and in what year?",
    "How many steps does the lighthouse tower have?",
    "Who was the last keeper of the lighthouse?",
)
SYSTEM = "You are a helpful assistant. Answer the question using only the passages, in one short sentence."
TOP_K = 8  # passages per prompt
STOP_WORDS = frozenset("a an and are at by did do does for from had has have how in is it its of on or the to was "
                       "were what when where which who why with".split())


@dataclass(frozen=True, slots=True)
class RagAnswer:
    question: str
    order: tuple[int, ...]  # passage indices, in prompt order
    prompt_tokens: int
    full_s: float
    blend_s: float
    recompute_frac: float
    full_answer: str
    blend_answer: str


def split_passages(text: str) -> list[str]:
    """One passage per section: a heading (a short line without a final period) and the paragraphs under it."""
    sections: list[list[str]] = []
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        heading = len(para) < 80 and "\n" not in para and not para.endswith((".", "?", "!", ")"))
        if heading or not sections:
            sections.append([para])
        else:
            sections[-1].append(para)
    return ["\n".join(s) + "\n\n" for s in sections if len(s) > 1]


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9']+", text.lower()) if w not in STOP_WORDS}


def retrieve(question: str, passages: Sequence[str], top_k: int) -> list[int]:
    """Indices of the ``top_k`` passages sharing the most words with the question, best first (ties: earlier)."""
    want = _words(question)
    ranked = sorted(range(len(passages)), key=lambda i: (-len(want & _words(passages[i])), i))
    return ranked[:top_k]


def answer_all(model, tokenizer, passages: Sequence[str], questions: Sequence[str], top_k: int = TOP_K,
               max_new_tokens: int = 32, console: Console | None = None) -> list[RagAnswer]:
    """Cache every passage once, then answer each question with a full prefill and with blend."""
    from kvfabric.blend import Blender
    from kvfabric.blend.prompt import rag_segments

    stop = [i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if i is not None]
    config = Config(chunk_size=1024, tiers=("cpu",), cpu=CpuTierConfig(capacity=2**30))

    def text_of(tokens: list[int]) -> str:
        out = tokenizer.decode([t for t in tokens if t not in stop], skip_special_tokens=True)
        return out.strip().split("\n\n")[0]  # a 135M model rambles on after its answer

    with Blender(model, model_id="demo-rag", config=config) as blender:
        blender.prefill([[1] * 32, [2] * 16], mode="full")  # warm-up (kernels, allocator) outside the timings
        started = time.perf_counter()
        for tokens in rag_segments(tokenizer, SYSTEM, passages, "")[:-1]:  # the system prompt, then each passage
            blender.cache_passage(tokens)
        if console:
            console.print(f"cached {len(passages)} passages once, each alone ({time.perf_counter() - started:.1f} s)")
        answers = []
        for question in questions:
            order = retrieve(question, passages, top_k)
            segments = rag_segments(tokenizer, SYSTEM, [passages[i] for i in order], f"Question: {question}")
            full = blender.prefill(segments, mode="full", capacity=sum(map(len, segments)) + max_new_tokens)
            full_text = text_of(blender.generate(full, max_new_tokens, stop))
            blend = blender.prefill(segments, mode="blend", capacity=sum(map(len, segments)) + max_new_tokens)
            blend_text = text_of(blender.generate(blend, max_new_tokens, stop))
            answers.append(RagAnswer(question, tuple(order), blend.length, full.ttft_s, blend.ttft_s,
                                     blend.recompute_frac, full_text, blend_text))
            if console:
                console.print(f"asked: {question} ({blend.length} tokens, passages {list(order)})")
    return answers


def show(console: Console, answers: Sequence[RagAnswer]) -> None:
    table = Table(title="full prefill vs CacheBlend (passages reused in a new order)", show_lines=True)
    for col, justify in (("question", "left"), ("passages (prompt order)", "left"), ("tokens", "right"),
                         ("TTFT full s", "right"), ("TTFT blend s", "right"), ("speed-up", "right"),
                         ("recomputed", "right"), ("answer (full prefill)", "left"), ("answer (blend)", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for a in answers:
        table.add_row(a.question, " ".join(map(str, a.order)), str(a.prompt_tokens), f"{a.full_s:.2f}",
                      f"{a.blend_s:.2f}", f"{a.full_s / a.blend_s:.1f}x", f"{a.recompute_frac:.0%}",
                      a.full_answer, a.blend_answer)
    console.print(table)
    same = sum(a.full_answer == a.blend_answer for a in answers)
    console.print(f"median speed-up {statistics.median(a.full_s / a.blend_s for a in answers):.1f}x; "
                  f"{same}/{len(answers)} answers identical to the full prefill's")


def run(document: str | None = None, questions: Sequence[str] = QUESTIONS, top_k: int = TOP_K) -> list[RagAnswer]:
    from kvfabric.engines.model import ensure_model
    from kvfabric.engines.runtime import load_for_inference

    console = Console()
    console.rule("kvfabric demo --rag: CacheBlend on SmolLM2-135M-Instruct (CPU)")
    passages = split_passages(document if document is not None else demo_document())
    if len(passages) < 2:
        raise SystemExit("the document has fewer than two sections to use as passages")
    ensure_model()
    with console.status("loading the model"):
        model, tokenizer = load_for_inference()
    console.print(f"{len(passages)} passages from the demo document; each prompt holds the {min(top_k, len(passages))}"
                  " that share the most words with its question, best first")
    answers = answer_all(model, tokenizer, passages, questions, top_k, console=console)
    show(console, answers)
    return answers
