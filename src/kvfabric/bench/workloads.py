"""Serving workloads for `kvfabric bench serve`: token-id prompts, grouped per user (a user's requests run in order).

- `doc_qa(model, docs, doc_tokens, questions, users)`: long-document QA in the shape of LMCache's benchmark:
  `docs` shared documents of `doc_tokens` tokens, `questions` short questions about each; request q of doc d is
  document d + question (d, q); the requests go round-robin over the documents (every document is asked about
  once, then again...), dealt out to `users` concurrent users. Every document after its first question is a
  prefix hit, if a cache still holds it.
- `chat_sessions(model, trace, sessions, users, max_prompt, min_requests=0)`: multi-round chat replayed from the
  first requests of the Mooncake conversation trace. A request continues the earlier request with which it shares
  the longest prefix of hash ids (at least 2 blocks); chains of such requests are sessions. The first `sessions`
  sessions with at least two rounds are replayed, or more, in trace order, until they hold `min_requests` rounds;
  a user interleaves its sessions round by round. Each hash id (512 tokens in the trace) becomes a deterministic
  block of `BLOCK_TOKENS` token ids, so equal ids are equal prefixes here too; prompts are cut at `max_prompt`
  tokens (this keeps them a prefix of the next round's).
Text: Python's own module sources (`kvfabric.bench.vllm.source_text`), tokenized by the model's tokenizer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvfabric.data import find_shared_data

BLOCK_TOKENS = 64  # tokens per trace hash id (the trace's blocks are 512 tokens: 1/8 scale for a 2-core CPU)
MAX_OUTPUT = 16
TRACE_NAME = "mooncake_conversation_trace.jsonl"


def default_trace() -> Path:
    """The conversation trace in ../shared/data (kvfabric.data.find_shared_data); else pass --trace."""
    return find_shared_data(TRACE_NAME)


@dataclass(frozen=True, slots=True)
class Request:
    name: str
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    users: list[list[Request]]  # per user, in order
    working_set: int  # distinct prompt tokens (what a cache must hold for every repeat to hit)

    @property
    def num_requests(self) -> int:
        return sum(len(u) for u in self.users)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for u in self.users for r in u)


def _token_ids(model: str) -> list[int]:
    from transformers import AutoTokenizer

    from kvfabric.bench.vllm import source_text

    return AutoTokenizer.from_pretrained(model)(source_text()).input_ids


def doc_qa(model: str, docs: int, doc_tokens: int, questions: int, users: int, question_tokens: int = 24) -> Workload:
    ids = _token_ids(model)
    need = docs * doc_tokens + docs * questions * question_tokens
    if len(ids) < need:
        raise ValueError(f"not enough text for {need} tokens")
    documents = [ids[d * doc_tokens:(d + 1) * doc_tokens] for d in range(docs)]
    at = docs * doc_tokens
    order = []
    for q in range(questions):
        for d in range(docs):
            question = ids[at:at + question_tokens]
            at += question_tokens
            order.append(Request(f"doc{d}-q{q}", documents[d] + question, MAX_OUTPUT))
    return Workload("docqa", [order[u::users] for u in range(users)], docs * doc_tokens)


def _sessions(rows: list[dict], min_shared: int = 2) -> list[list[int]]:
    """Chains of requests (indices into rows): each request joins the session of the earlier request with which
    it shares the longest prefix of at least `min_shared` hash ids."""
    first_with: dict[tuple[int, ...], int] = {}
    session_of: list[int] = []
    sessions: list[list[int]] = []
    for i, row in enumerate(rows):
        hashes = row["hash_ids"]
        parent = next((first_with[tuple(hashes[:k])] for k in range(len(hashes), min_shared - 1, -1)
                       if tuple(hashes[:k]) in first_with), None)
        if parent is None:
            session_of.append(len(sessions))
            sessions.append([i])
        else:
            session_of.append(session_of[parent])
            sessions[session_of[parent]].append(i)
        for k in range(1, len(hashes) + 1):
            first_with.setdefault(tuple(hashes[:k]), i)
    return sessions


def chat_sessions(model: str, trace: str | None, sessions: int, users: int, max_prompt: int,
                  scan: int = 2000, min_requests: int = 0) -> Workload:
    path = Path(trace) if trace else default_trace()
    with open(path) as f:
        rows = [json.loads(line) for _, line in zip(range(scan), f)]
    picked: list[list[int]] = []
    num_rounds = 0
    for session in (s for s in _sessions(rows) if len(s) >= 2):
        if len(picked) >= sessions and num_rounds >= min_requests:
            break
        picked.append(session)
        num_rounds += len(session)
    if len(picked) < sessions or num_rounds < min_requests:
        raise ValueError(f"only {len(picked)} multi-round sessions ({num_rounds} requests) in the first {scan} "
                         f"requests of {path}")
    ids = _token_ids(model)
    span = len(ids) - BLOCK_TOKENS

    def block(hash_id: int) -> list[int]:  # deterministic, and distinct ids give distinct text
        at = (hash_id * 7919 * BLOCK_TOKENS) % span
        return ids[at:at + BLOCK_TOKENS]

    distinct: set[int] = set()
    per_session: list[list[Request]] = []
    for number, session in enumerate(picked):
        rounds = []
        for r, index in enumerate(session):
            row = rows[index]
            length = min(max_prompt, -(-row["input_length"] * BLOCK_TOKENS // 512))
            prompt = [t for h in row["hash_ids"] for t in block(h)][:length]
            distinct.update(row["hash_ids"][:-(-length // BLOCK_TOKENS)])
            rounds.append(Request(f"s{number}-r{r}", prompt, MAX_OUTPUT))
        per_session.append(rounds)
    out: list[list[Request]] = []
    for u in range(users):
        mine = per_session[u::users]
        out.append([rounds[r] for r in range(max(map(len, mine), default=0)) for rounds in mine if r < len(rounds)])
    return Workload("chat", out, len(distinct) * BLOCK_TOKENS)
