"""Mooncake-style request traces: one JSON object per line with `timestamp` (ms), `input_length`,
`output_length` and `hash_ids` (one id per block of `BLOCK_TOKENS` prompt tokens; equal ids = equal prefix
blocks, so a request's ids name its prompt's prefix chain).

`load_trace` validates every line (a bad line is an error naming the file and line, never a silent skip) and
returns frozen values. The shared traces live in ../shared/data (see its README); `find_trace` resolves a
short name ("conversation", "synthetic") or a path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvfabric.data import find_shared_data

BLOCK_TOKENS = 512
TRACE_FILES = {"conversation": "mooncake_conversation_trace.jsonl", "synthetic": "mooncake_synthetic_trace.jsonl"}


class TraceError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, position: int, block_tokens: int = BLOCK_TOKENS) -> int:
        """Tokens of block `position` (the last block of a prompt may be partial)."""
        return max(0, min(block_tokens, self.input_length - position * block_tokens))


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[Request, ...]
    num_distinct_blocks: int
    num_accesses: int
    block_tokens: int = BLOCK_TOKENS


def find_trace(name_or_path: str) -> Path:
    """A trace file: an existing path, or a short name looked up in $KVFABRIC_BENCH_TRACE_DIR and in
    ../shared/data next to the working directory or the repository."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    return find_shared_data(TRACE_FILES.get(name_or_path, name_or_path), env="KVFABRIC_BENCH_TRACE_DIR")


def load_trace(name_or_path: str, limit: int | None = None, block_tokens: int = BLOCK_TOKENS) -> Trace:
    path = find_trace(name_or_path)
    requests: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            requests.append(_parse(line, f"{path}:{line_no}", block_tokens))
    if not requests:
        raise TraceError(f"{path}: no requests")
    distinct = {block for request in requests for block in request.hash_ids}
    name = next((short for short, file in TRACE_FILES.items() if file == path.name), path.stem)
    return Trace(name, tuple(requests), len(distinct), sum(len(r.hash_ids) for r in requests), block_tokens)


def _parse(line: str, where: str, block_tokens: int) -> Request:
    try:
        obj = json.loads(line)
        ids = obj["hash_ids"]
        request = Request(int(obj["timestamp"]), int(obj["input_length"]), int(obj.get("output_length", 0)),
                          tuple(int(i) for i in ids))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{where}: not a trace record ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(ids, list) or not request.hash_ids:
        raise TraceError(f"{where}: hash_ids must be a non-empty list")
    expected = -(-request.input_length // block_tokens)
    if expected != len(request.hash_ids):
        raise TraceError(f"{where}: input_length {request.input_length} needs {expected} blocks of {block_tokens}, "
                         f"got {len(request.hash_ids)} hash_ids")
    return request
