"""The codec registry: the one table of codecs, by name and by the codec id that chunk headers carry.

Contract:
- `CODECS` lists every codec: name, codec id (the header byte), level range, default level, and where its class
  lives ("module:Class"). A class is imported only when a codec of that kind is made, so that numba (cachegen)
  loads only for processes that use it. Adding a codec is one entry here.
- `parse_codec("name")` / `parse_codec("name:level")` -> a `CodecChoice` with the level resolved (the default
  when none is given; for a codec whose default depends on the model (`per_layout_default`: cachegen, whose
  profile stores it) the level stays None and the codec resolves it per layout); an unknown name or a level
  outside the range raises `CodecSpecError` (a ValueError) that
  names the allowed values. `CodecChoice.make()` builds the codec.
- `codec_for_id(codec_id)` builds a decoder for a header's codec id (decoders read the level from the header);
  an unknown id raises ChunkFormatError: the chunk is a miss.
- `handles_latent(codec_id)`: the codec codes a latent (MLA) layout's chunks too (raw, int8); cachegen's and video's
  models are K and V's, so they refuse latent layouts (`codec.base.check_codec`).
- Codec ids are forever: a stored chunk names its codec by id. A codec whose package is missing here (video
  without PyAV) makes reading its chunks a miss (ChunkFormatError), and choosing it in config a clear error.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfabric.codec.format import ChunkFormatError

if TYPE_CHECKING:
    from kvfabric.codec.base import Codec


class CodecSpecError(ValueError):
    """A codec name or level that the registry does not have."""


@dataclass(frozen=True, slots=True)
class CodecEntry:
    name: str
    codec_id: int
    min_level: int
    max_level: int
    default_level: int
    factory: str  # "module:Class"; Class(level) makes the codec (a codec with one level takes no argument)
    per_layout_default: bool = False  # Class() picks its default level per KV layout; default_level is its fallback
    handles_latent: bool = False  # codes an MLA latent layout's [L, 1, 1, T, D] too, not only K and V

    @property
    def levels(self) -> range:
        return range(self.min_level, self.max_level + 1)

    def bad_level(self, got: object) -> CodecSpecError:
        return CodecSpecError(f"level of {self.name} must be an integer in {self.min_level}..{self.max_level}, "
                              f"got {got!r}")

    def make(self, level: int | None = None) -> Codec:
        if level is None and not self.per_layout_default:
            level = self.default_level
        if level is not None and level not in self.levels:
            raise self.bad_level(level)
        module, _, attr = self.factory.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        return cls() if len(self.levels) == 1 or level is None else cls(level)


CODECS: tuple[CodecEntry, ...] = (
    CodecEntry("raw", 0, 0, 0, 0, "kvfabric.codec.raw:RawCodec", handles_latent=True),
    CodecEntry("int8", 1, 0, 1, 0, "kvfabric.codec.int8:Int8Codec", handles_latent=True),
    CodecEntry("cachegen", 2, 0, 9, 6, "kvfabric.codec.cachegen:CacheGenCodec", per_layout_default=True),
    CodecEntry("video", 3, 0, 9, 6, "kvfabric.codec.video:VideoCodec"),  # needs PyAV (av)
)
_BY_NAME = {entry.name: entry for entry in CODECS}
_BY_ID = {entry.codec_id: entry for entry in CODECS}


@dataclass(frozen=True, slots=True)
class CodecChoice:
    """A codec name and a level in its range, or None: the codec's default for each layout (hashable: equal
    choices make equal codecs)."""
    name: str
    level: int | None

    def make(self) -> Codec:
        return _BY_NAME[self.name].make(self.level)


def entry(name: str) -> CodecEntry:
    found = _BY_NAME.get(name)
    if found is None:
        raise CodecSpecError(f"unknown codec {name!r}; allowed: {', '.join(_BY_NAME)} (with an optional :level)")
    return found


def parse_codec(spec: str) -> CodecChoice:
    """"name" or "name:level" -> CodecChoice (the codec's default level when none is given)."""
    name, _, level_text = str(spec).strip().partition(":")
    found = entry(name)
    if not level_text:
        return CodecChoice(name, None if found.per_layout_default else found.default_level)
    if not level_text.isdigit() or int(level_text) not in found.levels:
        raise found.bad_level(level_text)
    return CodecChoice(name, int(level_text))


def handles_latent(codec_id: int) -> bool:
    """Whether the codec of this id codes MLA latents (False for an unknown id)."""
    found = _BY_ID.get(codec_id)
    return found is not None and found.handles_latent


def codec_for_id(codec_id: int) -> Codec:
    """A new decoder for a chunk header's codec id (the level is read from the header by `decode`)."""
    found = _BY_ID.get(codec_id)
    if found is None:
        raise ChunkFormatError(f"unknown codec id {codec_id}")
    try:
        return found.make()
    except ImportError as exc:  # e.g. a video chunk where PyAV is missing: a miss here, not a crash
        raise ChunkFormatError(f"codec {found.name} (id {codec_id}) is unavailable here: {exc}") from exc
