"""Fine-tuned siblings of a builtin model (DroidSpeak's study pair): deterministic, documented recipes built once on
the CPU.

Contract
--------
* ``ensure_finetuned(name)`` builds the sibling once (``engines.model.ensure_derived``; ``kvfabric setup-model
  NAME`` calls it); from then on ``ensure_model(name)`` and ``model_family(name)`` find it by name in any process
  (``droidspeak.pair.load_sibling``). ``DERIVED`` holds each sibling as the runtime's ``DerivedModel``.
* ``FINETUNED_MODELS`` maps a sibling's name to its :class:`FineTuneRecipe`. ``smollm2-135m-musique`` is a full
  fine-tune of SmolLM2-135M-Instruct on the passages of the first 100 MuSiQue questions of the shared data set
  (``musique_s.json``; the benchmarks use questions 100 and later, so they see held-out text): ``steps`` AdamW steps
  of ``batch`` x ``seq_len`` tokens (the tied embedding frozen, every decoder layer trained), seed 0, torch threads
  ``threads``, lr with a linear warm-up and decay. 200 steps at a peak rate of 5e-4 (51k of the 525k training
  tokens): 24 minutes on the shared 2-core machine beside a vLLM benchmark (2-25 s a step, depending on that load),
  max RSS 3.1 GiB with the AdamW state. Held-out KL(sibling || base) 0.85 per token (the first recipe, 24 steps at
  the same rate: 0.71). ``make test`` never builds it: the tests train a tiny random model for 3 steps.
* ``train(model, windows, recipe, log)``: the recipe's AdamW loop over token windows (seeded batches, the input
  embedding frozen); returns every step's loss. ``build_finetuned(name, base_dir, out, recipe=None)`` tokenises the
  training text, trains, and saves a plain fp32 HF folder into ``out`` (the caller renames it into place: see
  ``engines.model``) with ``finetune.json``: the losses, the training time and ``heldout_kl``, KL(sibling || base)
  per token on ``HELDOUT_WINDOWS`` windows of passages of questions 110-119 that are not in the training text. The
  same recipe, data, torch version and thread count give the same weights: seeded sampling, no dropout.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from rich.console import Console

from kvfabric.data import find_shared_data
from kvfabric.engines.model import DerivedModel, ensure_derived

HELDOUT_WINDOWS = 8  # x seq_len tokens of held-out passages for the KL to the base


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
        num_questions=100, steps=200, batch=1, seq_len=256, lr=5e-4, warmup=10),
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


def lr_at(recipe: FineTuneRecipe, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then linear decay towards 10 % of ``lr``."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    return recipe.lr * (1 - 0.9 * (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup))


def train(model: torch.nn.Module, windows: torch.Tensor, recipe: FineTuneRecipe,
          log: Callable[[str], None] | None = None) -> list[float]:
    """``recipe.steps`` AdamW steps on ``batch`` windows drawn (seeded) from ``windows`` [num_windows, seq_len];
    the input embedding (tied to the head in SmolLM2) stays frozen. Returns the loss of every step."""
    torch.manual_seed(recipe.seed)
    model.train()
    # The (tied) embedding stays frozen: 28M of the 135M parameters, and their AdamW state, are what made the
    # full fine-tune run out of memory on a shared 23 GB machine; every decoder layer and norm is trained.
    model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(recipe.steps):
        batch = windows[torch.randint(windows.shape[0], (recipe.batch,), generator=gen)]
        for group in opt.param_groups:
            group["lr"] = lr_at(recipe, step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if log is not None and (step % 10 == 0 or step == recipe.steps - 1):
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
            log(f"step {step}/{recipe.steps} loss {losses[-1]:.3f} lr {lr_at(recipe, step):.2e} "
                f"({time.perf_counter() - t0:.0f}s, max RSS {rss:.0f} MiB)")
    model.eval()
    del opt  # its state (2 x the trained parameters) is not needed once the weights are final
    return losses


def heldout_texts(recipe: FineTuneRecipe, first: int = 110, count: int = 10) -> list[str]:
    """Passages of questions ``[first, first + count)`` that are not in the training text (one string each)."""
    examples = json.loads(find_shared_data(recipe.data).read_text())
    trained = set(training_text(recipe).split("\n\n"))
    out: list[str] = []
    for example in examples[first:first + count]:
        for ctx in example["ctxs"]:
            text = f"{ctx['title']}\n{ctx['text']}"
            if text not in trained and text not in out:
                out.append(text)
    return out


@torch.inference_mode()
def model_kl(base: torch.nn.Module, sibling: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean over every position of KL(sibling || base) of the next-token distributions on ``windows`` [w, s]."""
    total, count = 0.0, 0
    for w in windows:
        p = torch.log_softmax(sibling(input_ids=w[None]).logits[0].float(), -1)
        q = torch.log_softmax(base(input_ids=w[None]).logits[0].float(), -1)
        total += float((p.exp() * (p - q)).sum(-1).sum())
        count += w.numel()
    return total / count


def token_windows(tok: Any, text: str, seq_len: int) -> torch.Tensor:
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    num_windows = (ids.numel() - 1) // seq_len
    return ids[:num_windows * seq_len].view(num_windows, seq_len)


def build_finetuned(name: str, base_dir: Path, out: Path, recipe: FineTuneRecipe | None = None) -> None:
    """Run the recipe of ``name`` (or ``recipe``) from the base model folder ``base_dir``; save the result into
    ``out``, with ``finetune.json``: the losses and the KL to the base on held-out passages."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = recipe or FINETUNED_MODELS[name]
    console = Console(stderr=True)
    torch.set_num_threads(recipe.threads)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    windows = token_windows(tok, training_text(recipe), recipe.seq_len)
    console.log(f"fine-tuning {recipe.base} -> {name}: {windows.numel()} tokens, {windows.shape[0]} windows, "
                f"{recipe.steps} steps x {recipe.batch} x {recipe.seq_len}")
    started = time.perf_counter()
    losses = train(model, windows, recipe, console.log)
    train_s = time.perf_counter() - started
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    heldout = token_windows(tok, "\n\n".join(heldout_texts(recipe)), recipe.seq_len)[:HELDOUT_WINDOWS]
    kl = model_kl(base, model, heldout)
    del base
    console.log(f"KL(sibling || base) on {heldout.numel()} held-out tokens: {kl:.4f} (trained in {train_s:.0f}s)")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    stats = {"train_s": round(train_s, 1), "threads": torch.get_num_threads(), "losses": [round(x, 4) for x in losses],
             "heldout_tokens": heldout.numel(), "heldout_kl": round(kl, 5)}
    (out / "finetune.json").write_text(json.dumps(stats, indent=2))
    for f in out.iterdir():
        f.chmod(0o644)


def _build(name: str, base_dir: Path, out: Path) -> None:
    build_finetuned(name, base_dir, out)  # looked up at call time (the tests stand in for it)


DERIVED: Mapping[str, DerivedModel] = MappingProxyType({
    name: DerivedModel(recipe.base, recipe.family,
                       MappingProxyType({f: getattr(recipe, f) for f in recipe.__dataclass_fields__}),
                       partial(_build, name))
    for name, recipe in FINETUNED_MODELS.items()})


def ensure_finetuned(name: str) -> Path:
    """The sibling's folder, built first when it is not (or was built by another recipe)."""
    return ensure_derived(name, DERIVED[name.lower()])
