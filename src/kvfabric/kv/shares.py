"""Rank shares: what one rank of a tensor- and pipeline-parallel engine holds of a model's KV, by vLLM's rules.

Contract:
- A `Share` is layers [first, last) and KV heads [first, last) of the model's layout. `rank_share(model, pp_rank,
  pp_size, tp_rank, tp_size)` is a rank's: its pipeline stage's layers (vLLM's default partition,
  `stage_layers`) and its tensor rank's heads (`rank_heads`). With more tensor ranks than KV heads vLLM replicates
  each head over `tp_size / num_kv_heads` ranks: they share one Share, and only the first of them writes it
  (`is_writer`). A latent (MLA) layout has one head slot: every tensor rank holds it, rank 0 writes.
- `grid(model, pp_size, tp_size)` is every distinct share of one parallel shape, in (stage, head) order: what a
  deployment of that shape stores of a chunk. `grids(model)` is the shapes a reader looks for (pipeline sizes
  1, 2, 4; head splits that divide the KV heads), the whole model first.
- A share is stored under a key derived from the chunk's (`Share.tag`: its ranges, so any shape names a share
  alike) in the share's own layout (`KVLayout.share`, whose fingerprint names the parent, the layers and the
  heads): the chunk format names the share it holds.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvfabric.kv.layout import KVLayout
from kvfabric.kv.shapes import ChunkPart, ChunkShape, WindowSplit

PP_SIZES = (1, 2, 4)  # the pipeline shapes a reader looks for


@dataclass(frozen=True, slots=True)
class Share:
    layers: tuple[int, int]  # [first, last) of the model's layers
    heads: tuple[int, int]  # [first, last) of the model's KV heads
    is_writer: bool = True  # False: a replica (another rank holds the same heads and writes them)

    def is_whole(self, model: KVLayout) -> bool:
        return self.layers == (0, model.num_layers) and self.heads == (0, model.num_kv_heads)

    @property
    def layer_indices(self) -> tuple[int, ...]:
        return tuple(range(*self.layers))

    def layout(self, model: KVLayout) -> KVLayout:
        """The share's own layout (the whole model's for a whole share)."""
        return model if self.is_whole(model) else model.share(self.layer_indices, self.heads)

    @property
    def tag(self) -> bytes:
        """What derives the share's key from the chunk's: its ranges."""
        return f"kvfabric/share\0L{self.layers[0]}-{self.layers[1]}/H{self.heads[0]}-{self.heads[1]}".encode()

    def overlap(self, other: Share) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """(layers, heads) both shares hold, or None."""
        layers = (max(self.layers[0], other.layers[0]), min(self.layers[1], other.layers[1]))
        heads = (max(self.heads[0], other.heads[0]), min(self.heads[1], other.heads[1]))
        return (layers, heads) if layers[0] < layers[1] and heads[0] < heads[1] else None

    def describe(self) -> str:
        return f"layers {self.layers[0]}-{self.layers[1] - 1}, KV heads {self.heads[0]}-{self.heads[1] - 1}"


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [first, last) of pipeline stage pp_rank: vLLM's default partition (`get_pp_indices` without
    VLLM_PP_LAYER_PARTITION): even, the remainder spread over the stages before the last, from the second-last
    down."""
    if not 0 <= pp_rank < pp_size or pp_size > num_layers:
        raise ValueError(f"pipeline stage {pp_rank} of {pp_size} for {num_layers} layers")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    first = sum(sizes[:pp_rank])
    return first, first + sizes[pp_rank]


def rank_heads(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[tuple[int, int], bool]:
    """(KV heads [first, last) of tensor rank tp_rank, whether it writes them): an even split, or with more ranks
    than heads (vLLM replicates) one head per tp_size / num_kv_heads ranks, written by the first of them."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor rank {tp_rank} of {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} tensor ranks")
        per = num_kv_heads // tp_size
        return (tp_rank * per, (tp_rank + 1) * per), True
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} tensor ranks do not replicate {num_kv_heads} KV heads evenly")
    replicas = tp_size // num_kv_heads
    head = tp_rank // replicas
    return (head, head + 1), tp_rank % replicas == 0


def rank_share(model: KVLayout, pp_rank: int, pp_size: int, tp_rank: int, tp_size: int) -> Share:
    heads, is_writer = rank_heads(model.num_kv_heads, tp_rank, tp_size)
    return Share(stage_layers(model.num_layers, pp_rank, pp_size), heads, is_writer)


def grid(model: KVLayout, pp_size: int, tp_size: int) -> tuple[Share, ...]:
    """Every distinct share of one parallel shape (replicas once), stage by stage, heads in order."""
    tp = min(tp_size, model.num_kv_heads)
    return tuple(rank_share(model, stage, pp_size, rank, tp) for stage in range(pp_size) for rank in range(tp))


def num_writers(model: KVLayout, pp_size: int, tp_size: int) -> int:
    """How many ranks of a deployment of this shape write a share of each chunk (one for a model with window
    layers: stored whole, by one rank)."""
    return 1 if model.window_layers else len(grid(model, pp_size, tp_size))


def grids(model: KVLayout, first: tuple[int, int] = (1, 1)) -> list[tuple[Share, ...]]:
    """The parallel shapes a reader looks for a chunk in, as their grids: the whole model, then `first` (the
    reader's own (pp_size, tp_size)), then pipeline sizes 1, 2, 4 by head splits that divide the KV heads."""
    heads = [t for t in range(1, model.num_kv_heads + 1) if model.num_kv_heads % t == 0]
    shapes = [(1, 1), (first[0], min(first[1], model.num_kv_heads))]
    shapes += [(p, t) for p in PP_SIZES if p <= model.num_layers for t in heads]
    return [grid(model, p, t) for p, t in dict.fromkeys(shapes)]


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored part a share is read from: layers [src_layers) and heads [src_heads) of the stored part's tensor
    go to layers [dst_layers) and heads [dst_heads) of the reader's (ranges, first and last)."""
    part: ChunkPart
    src_layers: tuple[int, int]
    src_heads: tuple[int, int]
    dst_layers: tuple[int, int]
    dst_heads: tuple[int, int]

    @property
    def is_partial(self) -> bool:
        """Whether the piece is less than the whole stored part (a ranged read pays)."""
        layout = self.part.layout
        return self.src_layers != (0, layout.num_layers) or self.src_heads != (0, layout.num_kv_heads)

    def take(self, kv: torch.Tensor) -> torch.Tensor:
        """The piece of a stored part's KV [L', S, H', T, D] (a view)."""
        return kv[slice(*self.src_layers), :, slice(*self.src_heads)]

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """Where the piece goes in the reader's KV [L, S, H, T, D] (a view)."""
        return out[slice(*self.dst_layers), :, slice(*self.dst_heads)]


Way = tuple[Piece, ...]  # the pieces of one way a chunk can be stored, that together hold a reader's share


class ShareShape(ChunkShape):
    """A rank's share of a chunk (tensor / pipeline parallelism: kvfabric.kv.shares). Written as one part, the
    share, under a key derived from the chunk's (`Share.tag`). Read from the share's own part, or, where that is
    missing, from the first other way that holds every piece of it (`alternatives`): the whole chunk (a
    single-rank engine's, the reference engine's) or the shares of another parallel shape, each piece cut to the
    rows this share holds. A replica (`is_writer` False) never writes."""

    def __init__(self, model: KVLayout, share: Share, shapes: Sequence[Sequence[Share]]) -> None:
        if model.window_groups:
            raise ValueError("a model with sliding-window layers is stored whole or window-split, not by rank shares")
        self.parent = model
        self.share = share
        own = ChunkPart("whole", model, share.layer_indices) if share.is_whole(model) else \
            ChunkPart("share", share.layout(model), share.layer_indices, share.tag)
        self.parts = (own,)
        self.is_writer = share.is_writer
        self._layout = own.layout
        ways = [tuple(self._piece(stored, model) for stored in grid if stored.overlap(share) is not None)
                for grid in shapes]
        # the own part is read first anyway; a way is listed once (grids of several shapes can coincide)
        self.alternatives: tuple[Way, ...] = tuple(dict.fromkeys(
            way for way in ways if way and all(piece.part.tag != own.tag for piece in way)))

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def _piece(self, stored: Share, model: KVLayout) -> Piece:
        overlap = stored.overlap(self.share)
        assert overlap is not None
        layers, heads = overlap
        is_whole = stored.is_whole(model)
        part = ChunkPart("whole" if is_whole else "share", stored.layout(model), stored.layer_indices,
                         b"" if is_whole else stored.tag)
        return Piece(part, _minus(layers, stored.layers[0]), _minus(heads, stored.heads[0]),
                     _minus(layers, self.share.layers[0]), _minus(heads, self.share.heads[0]))

    def _holding(self, keys: Sequence[bytes], has: Callable[[list[bytes]], list[bool]]) -> list[list[Way]]:
        """For each chunk, the alternatives that hold every piece of it: one question for all their pieces."""
        asked = [piece.part.key(key) for key in keys for way in self.alternatives for piece in way]
        found = dict(zip(asked, has(asked))) if asked else {}
        return [[way for way in self.alternatives if all(found[piece.part.key(key)] for piece in way)]
                for key in keys]

    def present(self, keys: Sequence[bytes], has: Callable[[list[bytes]], list[bool]]) -> list[bool]:
        """Whether each chunk's share can be read: its own part, or every piece of one alternative (two questions
        at most)."""
        found = has([self.parts[0].key(k) for k in keys])
        missing = [i for i, hit in enumerate(found) if not hit]
        for i, ways in zip(missing, self._holding([keys[i] for i in missing], has)):
            found[i] = bool(ways)
        return found

    def held(self, keys: Sequence[bytes], has: Callable[[list[bytes]], list[bool]]) -> list[bool]:
        """For a writer: whether each chunk's share is stored already, its own part or another way, in a few
        questions whatever the number of chunks, like `prefix`. Why not `present`: it derives and asks every way's
        pieces of every chunk missing its own part (dozens of keys a chunk), on the thread that saves. Here another
        way is asked about the first such chunk only, and, where one holds it, about the others for that way. Keys
        are prefix-chained, so a way that lacks that chunk lacks the later ones too but for evictions: at worst a
        chunk another way holds is written once more, never one skipped that no way holds."""
        found = has([self.parts[0].key(k) for k in keys])
        missing = [i for i, hit in enumerate(found) if not hit]
        if not missing or not self.alternatives:
            return found
        (holding,) = self._holding([keys[missing[0]]], has)
        if holding:
            way, rest = holding[0], missing[1:]
            found[missing[0]] = True
            for i, is_held in zip(rest, _way_holds(way, [keys[i] for i in rest], has)):
                found[i] = is_held
        return found

    def prefix(self, keys: Sequence[bytes], num_tokens: int, chunk_size: int,
               has: Callable[[list[bytes]], list[bool]]) -> int:
        """The leading chunks whose share can be read: the own parts in one question; from the first chunk they
        lack, one question about every way's pieces of that chunk, and one about the chunks after it for the way
        that holds it. A prompt no shape stored costs two questions (a remote tier answers each in a round trip)."""
        own = has([self.parts[0].key(k) for k in keys])
        num = own.index(False) if False in own else len(keys)
        while num < len(keys) and self.alternatives:
            (holding,) = self._holding([keys[num]], has)
            if not holding:
                break
            way, rest = holding[0], range(num + 1, len(keys))
            held = _way_holds(way, [keys[i] for i in rest], has)
            num += 1
            for j, i in enumerate(rest):
                if not (held[j] or own[i]):
                    break
                num = i + 1
        return num


def _way_holds(way: Way, keys: Sequence[bytes], has: Callable[[list[bytes]], list[bool]]) -> list[bool]:
    """Whether `way` holds every piece of each chunk: one question a piece."""
    return [all(hits) for hits in zip(*(has([piece.part.key(k) for k in keys]) for piece in way))]


def _minus(span: tuple[int, int], offset: int) -> tuple[int, int]:
    return span[0] - offset, span[1] - offset


def shape_of(layout: KVLayout, share: Share | None = None, parallel: tuple[int, int] = (1, 1)) -> ChunkShape:
    """How an engine of `layout` stores and reads chunks: `share` is a parallel engine rank's (None: the whole
    model), `parallel` its (pp_size, tp_size), the first other shape it looks for chunks in. A layout with window
    layers is window-split (its ranks share all heads: rank 0 writes); one whose layers all have a window is
    stored whole; any other is a ShareShape that also reads what other parallel shapes stored."""
    share = share or Share((0, layout.num_layers), (0, layout.num_kv_heads))
    window = layout.window_layers
    if window:
        if not share.is_whole(layout):
            raise ValueError("a model with sliding-window layers is stored by whole chunks: a rank that holds part "
                             f"of it ({share.describe()}) cannot share its cache")
        return WindowSplit(layout, share.is_writer) if len(window) != layout.num_layers else \
            ChunkShape(layout, share.is_writer)
    return ShareShape(layout, share, grids(layout, parallel))
