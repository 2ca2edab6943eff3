"""Fine-tuned siblings of a builtin model: deterministic, documented recipes built once on the CPU.

Contract
--------
* ``FINETUNED_MODELS`` maps a sibling's name to its :class:`FineTuneRecipe`. ``smollm2-135m-musique`` is a full
  fine-tune of SmolLM2-135M-Instruct on the passages of the first 100 MuSiQue questions of the shared data set
  (``musique_s.json``; the benchmarks use questions 100 and later, so they see held-out text): ``steps`` AdamW steps
  of ``batch`` x ``seq_len`` tokens (the tied embedding frozen, every decoder layer trained), seed 0, torch threads
  ``threads``, lr with a linear warm-up and decay. Few steps at a high rate: on the shared 2-core machine a step
  costs 20-40 s (a 200-step recipe did not fit the session, and a full AdamW state was killed for memory).
* ``build_finetuned(name, dest_dir) -> None`` runs the recipe and saves a plain fp32 HF folder into ``dest_dir``
  (the caller renames it into place: see ``engines.model``). The same recipe, data and torch version give the same
  weights: one thread, seeded sampling, no dropout.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch
from rich.console import Console

from kvfabric.data import find_shared_data


@dataclass(frozen=True, slots=True)
class FineTuneRecipe:
    base: str  # builtin model the sibling starts from
    family: str  # model family both declare (key namespace, see kvfabric.droidspeak.family)
    data: str  # file under the shared data folder
    first_question: int
    num_questions: int
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    seed: int = 0
    threads: int = 2


FINETUNED_MODELS: Mapping[str, FineTuneRecipe] = MappingProxyType({
    "smollm2-135m-musique": FineTuneRecipe(
        base="smollm2-135m-instruct", family="smollm2-135m", data="musique_s.json", first_question=0,
        num_questions=100, steps=24, batch=1, seq_len=256, lr=5e-4, warmup=2),
})


def training_text(recipe: FineTuneRecipe) -> str:
    """The passages (title + text) of the recipe's questions, in file order, each once."""
    examples = json.loads(find_shared_data(recipe.data).read_text())
    seen: set[str] = set()
    parts = []
    for example in examples[recipe.first_question:recipe.first_question + recipe.num_questions]:
        for ctx in example["ctxs"]:
            text = f"{ctx['title']}\n{ctx['text']}\n\n"
            if text not in seen:
                seen.add(text)
                parts.append(text)
    return "".join(parts)


def build_finetuned(name: str, base_dir: Path, out: Path) -> None:
    """Run the recipe of ``name`` from the base model folder ``base_dir``; save the result into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = FINETUNED_MODELS[name]
    console = Console(stderr=True)
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    # The (tied) embedding stays frozen: 28M of the 135M parameters, and their AdamW state, are what made the
    # full fine-tune run out of memory on a shared 23 GB machine; every decoder layer and norm is trained.
    model.get_input_embeddings().weight.requires_grad_(False)
    ids = torch.tensor(tok(training_text(recipe), add_special_tokens=False)["input_ids"])
    num_windows = (ids.numel() - 1) // recipe.seq_len
    windows = ids[:num_windows * recipe.seq_len].view(num_windows, recipe.seq_len)
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:  # linear warm-up, then linear decay to 10 %
        if step < recipe.warmup:
            return recipe.lr * (step + 1) / recipe.warmup
        return recipe.lr * (1 - 0.9 * (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup))

    console.log(f"fine-tuning {recipe.base} -> {name}: {ids.numel()} tokens, {num_windows} windows, "
                f"{recipe.steps} steps x {recipe.batch} x {recipe.seq_len}")
    t0 = time.perf_counter()
    for step in range(recipe.steps):
        batch = windows[torch.randint(num_windows, (recipe.batch,), generator=gen)]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 2 == 0 or step == recipe.steps - 1:
            console.log(f"step {step}/{recipe.steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)
