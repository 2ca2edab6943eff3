"""Per-model head classification: which (layer, KV head) pairs are temporally stable, shipped as a small table.

Contract:
- `HeadTable` holds, per (layer, KV head), `stability`: the mean overlap of the head's top-K pages (by attention
  mass) between decode step t and t + lag, measured offline on long prompts (kvfabric/research/head_stability.py),
  and the same per prompt kind; `threshold`: heads below it are unstable; `miss`: the mean share of the head's
  attention outside the pages a radar-ranked resident set would hold (head_stability.head_steps).
- `unstable()`: the [L, H] mask at the threshold. `full_order(by)`: every head as a flat index (layer * H + head),
  the first to keep whole first: by "stability" (least stable first, FlexiCache as published) or by "retention"
  (lowest (1 - miss) * stability first: the share of its attention a top-K set holds and keeps over `lag` steps).
- Tables ship as `tables/heads_<model id>.npz` (plain arrays, loaded with allow_pickle=False) and are rebuilt by
  `kvfabric profile flexicache`. `load_table(model_id, num_layers, num_kv_heads, path="")` returns the shipped one
  (or the file at `path`) and raises HeadTableError when it is missing or its shape does not fit the model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TABLES = Path(__file__).with_name("tables")
TABLE_VERSION = 1


class HeadTableError(ValueError):
    pass


@dataclass(frozen=True, eq=False)
class HeadTable:
    model_id: str
    stability: np.ndarray  # float32 [L, H]: mean top-K page overlap between step t and t + lag, all prompts
    threshold: float  # heads with stability < threshold are unstable
    kinds: dict[str, np.ndarray] = field(default_factory=dict)  # prompt kind -> float32 [L, H]
    miss: np.ndarray | None = None  # float32 [L, H]: attention outside a radar-ranked resident set (None: unknown)
    meta: dict = field(default_factory=dict)  # how it was measured (top_k, lag, page size, prompts, steps)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.stability.shape)  # type: ignore[return-value]

    def unstable(self, stability: np.ndarray | None = None) -> np.ndarray:
        """bool [L, H]: heads whose stability (default: over all prompts) is below the threshold."""
        return (self.stability if stability is None else stability) < self.threshold

    def retention(self) -> np.ndarray:
        """float [L, H]: (1 - miss) * stability."""
        return (1.0 - (self.miss if self.miss is not None else 0.0)) * self.stability

    def full_order(self, by: str = "retention") -> np.ndarray:
        """int [L*H]: flat head indices, the first to keep whole first (ties: lower index first)."""
        if by not in ("retention", "stability"):
            raise ValueError(f"head order {by!r}: expected retention or stability")
        key = self.retention() if by == "retention" else self.stability
        return np.argsort(key.reshape(-1), kind="stable")


def save_table(table: HeadTable, path: Path) -> None:
    kinds = sorted(table.kinds)
    np.savez_compressed(
        path, version=np.array([TABLE_VERSION]), stability=table.stability.astype(np.float32),
        threshold=np.array([table.threshold], dtype=np.float64),
        kinds=np.stack([table.kinds[k] for k in kinds]).astype(np.float32) if kinds
        else np.zeros((0, *table.shape), np.float32),
        miss=(table.miss if table.miss is not None else np.full(table.shape, np.nan)).astype(np.float32),
        meta=np.frombuffer(json.dumps({**table.meta, "model_id": table.model_id, "kinds": kinds}).encode(),
                           dtype=np.uint8))


def read_table(path: Path) -> HeadTable:
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["version"][0]) != TABLE_VERSION:
                raise HeadTableError(f"{path}: head table version {int(z['version'][0])} unsupported")
            meta = json.loads(z["meta"].tobytes().decode() or "{}")
            stability = z["stability"].astype(np.float32)
            kinds_arr = z["kinds"].astype(np.float32)
            miss = z["miss"].astype(np.float32)
            threshold = float(z["threshold"][0])
    except (OSError, KeyError, ValueError) as exc:
        if isinstance(exc, HeadTableError):
            raise
        raise HeadTableError(f"{path}: not a head table ({exc})") from None
    names = meta.pop("kinds", [])
    if (stability.ndim != 2 or kinds_arr.shape[1:] != stability.shape or len(names) != kinds_arr.shape[0]
            or miss.shape != stability.shape):
        raise HeadTableError(f"{path}: malformed head table arrays")
    return HeadTable(model_id=str(meta.pop("model_id", "")), stability=stability, threshold=threshold,
                     kinds=dict(zip(names, kinds_arr)), miss=None if np.isnan(miss).any() else miss, meta=meta)


def table_path(model_id: str) -> Path:
    return TABLES / f"heads_{model_id}.npz"


def load_table(model_id: str, num_layers: int, num_kv_heads: int, path: str | Path = "") -> HeadTable:
    """The head table of `model_id` (shipped), or the one at `path`; checked against the model's shape."""
    file = Path(path).expanduser() if path else table_path(model_id)
    if not file.is_file():
        raise HeadTableError(f"no head table for model {model_id!r} at {file}; build one with "
                             f"`kvfabric profile flexicache --model {model_id}`")
    table = read_table(file)
    if table.shape != (num_layers, num_kv_heads):
        raise HeadTableError(f"{file}: table is for {table.shape} (layers, KV heads), the model has "
                             f"{(num_layers, num_kv_heads)}")
    return table
