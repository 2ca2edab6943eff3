"""The controller's HTTP API schema: request / response models, field types and size limits.

Every request model forbids unknown fields and bounds every list, string and number, so a malformed or hostile
request is refused with 422 before any handler runs: integers are JSON integers (never strings or booleans),
worker hosts are IP literals (the controller never resolves names for a client), chunk keys are 64 hex digits.
A `Selection` names chunks either by token ids (keyed with each instance's namespace, or a tenant's namespace in it)
or by explicit keys.
`MAX_BODY_BYTES` bounds a request body (enforced by `controller_app.Guard`, 413).
"""
from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    WithJsonSchema,
    model_validator,
)

from kvfabric.kv.hashing import HASH_NAMES

MAX_BODY_BYTES = 4 << 20
MAX_TOKENS = 262_144
MAX_KEYS = 16_384


def _json_int(value: Any) -> Any:
    """JSON Schema integers: numbers with no fraction (1 and 1.0), never strings or booleans."""
    if isinstance(value, (str, bytes, bool)):
        raise ValueError("expected an integer")
    return value


def _ip_literal(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError("must be an IPv4 or IPv6 address literal") from None
    return value


InstanceId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
TierName = Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,32}$")]
KeyHex = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
TokenId = Annotated[int, Field(ge=0, lt=2**32), BeforeValidator(_json_int)]
Host = Annotated[str, Field(min_length=2, max_length=45), AfterValidator(_ip_literal),
                 WithJsonSchema({"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "string", "format": "ipv6"}],
                                 "description": "an IPv4 or IPv6 address literal (no host names)"})]
Port = Annotated[int, Field(ge=1, le=65535), BeforeValidator(_json_int)]
Count = Annotated[int, Field(ge=0, le=2**53), BeforeValidator(_json_int)]  # exact in a JSON double
Flag = StrictBool


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TierModel(Strict):
    name: TierName
    capacity_bytes: Count = 0
    num_chunks: Count = 0
    num_bytes: Count = 0


class NamespaceModel(Strict):
    model_id: Annotated[str, Field(min_length=1, max_length=256)]
    root: KeyHex
    chunk_size: Annotated[int, Field(ge=1, le=1 << 20), BeforeValidator(_json_int)]
    hash: Literal[HASH_NAMES] = "sha256"  # type: ignore[valid-type]
    partial: Flag = False


class RegisterRequest(Strict):
    instance_id: InstanceId
    host: Host
    port: Port
    tiers: Annotated[list[TierModel], Field(max_length=16)] = []
    namespaces: Annotated[list[NamespaceModel], Field(max_length=64)] = []
    reset: Flag = True


class RegisterResponse(BaseModel):
    ok: bool
    instance_ttl_s: float


StatName = Annotated[str, Field(pattern=r"^[a-z0-9_]{1,40}$")]
Stats = Annotated[dict[StatName, Count], Field(max_length=32, json_schema_extra={"additionalProperties": False})]


class HeartbeatRequest(Strict):
    tiers: Annotated[list[TierModel], Field(max_length=16)] | None = None
    stats: Stats | None = None  # cumulative counts of the instance (lookup_tokens, hit_tokens, evictions, ...)


class KnownResponse(BaseModel):
    ok: bool
    known: bool


TierKeys = Annotated[dict[TierName, Annotated[list[KeyHex], Field(max_length=MAX_KEYS)]],
                     Field(max_length=16, json_schema_extra={"additionalProperties": False})]


class EventsRequest(Strict):
    admit: TierKeys = {}
    evict: TierKeys = {}


class Selection(Strict):
    """A prompt (token ids, keyed with each instance's namespace) or explicit chunk keys: exactly one."""
    model_config = ConfigDict(extra="forbid",
                              json_schema_extra={"oneOf": [{"required": ["tokens"]}, {"required": ["keys"]}]})
    tokens: Annotated[list[TokenId], Field(max_length=MAX_TOKENS)] = None  # type: ignore[assignment]
    keys: Annotated[list[KeyHex], Field(max_length=MAX_KEYS)] = None  # type: ignore[assignment]
    model_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # a tenant's namespace (a vLLM cache_salt) instead of the instance's own; a tenant token: one of its tenants
    # (default: all of them)
    tenant: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Selection:
        if (self.tokens is None) == (self.keys is None):
            raise ValueError("give exactly one of tokens or keys")
        return self


class LookupRequest(Selection):
    detail: Flag = False  # per-chunk tiers, for every instance holding at least one of the chunks
    exclude: Annotated[list[InstanceId], Field(max_length=64)] = []


class InstanceHit(BaseModel):
    instance_id: str
    host: str
    port: int
    num_chunks: int  # chunks of the prompt in this instance's namespace
    prefix_chunks: int
    prefix_tokens: int | None = None
    tier: str | None = None  # the slowest tier the prefix is read from (each chunk from its fastest tier)
    tiers: dict[str, int] = {}  # prefix chunks per tier they are read from
    chunk_tiers: list[list[str]] | None = None  # detail: every tier holding each chunk


class LookupResponse(BaseModel):
    instances: list[InstanceHit]


class PinRequest(Selection):
    instance: InstanceId | None = None  # None: every instance holding the chunks
    tier: TierName | None = None


class ClearRequest(Strict):
    instance: InstanceId | None = None  # None: every instance
    tier: TierName | None = None  # None: every served tier


class MoveRequest(Selection):
    src: InstanceId
    src_tier: TierName | None = None
    dst: InstanceId
    dst_tier: TierName
    mode: Literal["copy", "migrate"] = "copy"


class MoveResponse(BaseModel):
    chunks: int
    bytes: int
    missing: int
    seconds: float


class InstanceResult(BaseModel):
    ok: bool
    chunks: int = 0
    error: str | None = None


class CommandResponse(BaseModel):
    instances: dict[str, InstanceResult]


class InstanceView(BaseModel):
    instance_id: str
    host: str
    port: int
    tiers: list[TierModel]
    namespaces: list[NamespaceModel]
    indexed_chunks: dict[str, int]
    registered_at: float
    last_seen: float
    age_s: float
    stats: dict[str, int] = {}  # the counts of its last heartbeat


class HistoryPoint(BaseModel):
    t: float  # unix time of the heartbeat
    stats: dict[str, int]


class HistoryEvent(BaseModel):
    t: float
    instance_id: str
    kind: str  # a count that went up between two heartbeats: evictions, errors
    count: int


class HistoryResponse(BaseModel):
    instances: dict[str, list[HistoryPoint]]  # oldest first, one point per heartbeat that carried counts
    events: list[HistoryEvent]  # newest last


class InstancesResponse(BaseModel):
    instances: list[InstanceView]


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded"]
    index: str
    index_ok: bool
    instances: int


class ErrorResponse(BaseModel):
    detail: Any
