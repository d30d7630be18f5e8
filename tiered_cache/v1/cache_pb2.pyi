from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_NONE: _ClassVar[Tier]
    TIER_RAM: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REDIS: _ClassVar[Tier]

class RefusalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[RefusalReason]
    BAD_KEY: _ClassVar[RefusalReason]
    CORRUPT_BLOB: _ClassVar[RefusalReason]
    KEY_MISMATCH: _ClassVar[RefusalReason]
    FINGERPRINT_MISMATCH: _ClassVar[RefusalReason]
    UNKNOWN_CODEC: _ClassVar[RefusalReason]
    TOO_LARGE: _ClassVar[RefusalReason]
    NO_SPACE: _ClassVar[RefusalReason]
    SHM_LOST: _ClassVar[RefusalReason]
TIER_NONE: Tier
TIER_RAM: Tier
TIER_DISK: Tier
TIER_REDIS: Tier
REFUSAL_UNSPECIFIED: RefusalReason
BAD_KEY: RefusalReason
CORRUPT_BLOB: RefusalReason
KEY_MISMATCH: RefusalReason
FINGERPRINT_MISMATCH: RefusalReason
UNKNOWN_CODEC: RefusalReason
TOO_LARGE: RefusalReason
NO_SPACE: RefusalReason
SHM_LOST: RefusalReason

class LookupRequest(_message.Message):
    __slots__ = ("keys", "shm_segment")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    shm_segment: bytes
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., shm_segment: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("leading", "tiers", "shm_positions", "shm_lengths")
    LEADING_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SHM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SHM_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    leading: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    shm_positions: _containers.RepeatedScalarFieldContainer[int]
    shm_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, leading: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., shm_positions: _Optional[_Iterable[int]] = ..., shm_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys", "fingerprint", "shm_segment")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    fingerprint: bytes
    shm_segment: bytes
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., fingerprint: _Optional[bytes] = ..., shm_segment: _Optional[bytes] = ...) -> None: ...

class PageBlob(_message.Message):
    __slots__ = ("key", "blob", "fingerprint", "shm_position", "shm_length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHM_POSITION_FIELD_NUMBER: _ClassVar[int]
    SHM_LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    blob: bytes
    fingerprint: bytes
    shm_position: int
    shm_length: int
    def __init__(self, key: _Optional[bytes] = ..., blob: _Optional[bytes] = ..., fingerprint: _Optional[bytes] = ..., shm_position: _Optional[int] = ..., shm_length: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("path", "size", "segment", "host", "bulk_port")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    segment: bytes
    host: str
    bulk_port: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., segment: _Optional[bytes] = ..., host: _Optional[str] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class OfferRequest(_message.Message):
    __slots__ = ("path", "size", "segment", "host")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    segment: bytes
    host: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., segment: _Optional[bytes] = ..., host: _Optional[str] = ...) -> None: ...

class OfferResponse(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class OfferedPage(_message.Message):
    __slots__ = ("key", "position", "length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    position: int
    length: int
    def __init__(self, key: _Optional[bytes] = ..., position: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PutOfferedRequest(_message.Message):
    __slots__ = ("segment", "fingerprint", "pages")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    segment: bytes
    fingerprint: bytes
    pages: _containers.RepeatedCompositeFieldContainer[OfferedPage]
    def __init__(self, segment: _Optional[bytes] = ..., fingerprint: _Optional[bytes] = ..., pages: _Optional[_Iterable[_Union[OfferedPage, _Mapping]]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("key", "reason", "message")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    reason: RefusalReason
    message: str
    def __init__(self, key: _Optional[bytes] = ..., reason: _Optional[_Union[RefusalReason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "already_held", "refused")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_HELD_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_held: int
    refused: _containers.RepeatedCompositeFieldContainer[Refusal]
    def __init__(self, stored: _Optional[int] = ..., already_held: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[Refusal, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "pages", "hits", "misses", "evictions", "loads", "demotions", "bytes_in", "bytes_out", "errors", "corrupt", "breaker_trips", "open_breakers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    BREAKER_TRIPS_FIELD_NUMBER: _ClassVar[int]
    OPEN_BREAKERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    pages: int
    hits: int
    misses: int
    evictions: int
    loads: int
    demotions: int
    bytes_in: int
    bytes_out: int
    errors: int
    corrupt: int
    breaker_trips: int
    open_breakers: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., loads: _Optional[int] = ..., demotions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., errors: _Optional[int] = ..., corrupt: _Optional[int] = ..., breaker_trips: _Optional[int] = ..., open_breakers: _Optional[int] = ...) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("version", "uptime_s", "requests", "rejected_requests", "unauthenticated", "refused_blobs", "active_streams", "refused_streams", "stalled_streams", "shm_pages", "shm_pages_reused", "shm_put_pages", "shm_offers", "cancelled_streams", "shm_offered_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UNAUTHENTICATED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_BLOBS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STALLED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    SHM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHM_PAGES_REUSED_FIELD_NUMBER: _ClassVar[int]
    SHM_PUT_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFERS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    requests: int
    rejected_requests: int
    unauthenticated: int
    refused_blobs: int
    active_streams: int
    refused_streams: int
    stalled_streams: int
    shm_pages: int
    shm_pages_reused: int
    shm_put_pages: int
    shm_offers: int
    cancelled_streams: int
    shm_offered_bytes: int
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., requests: _Optional[int] = ..., rejected_requests: _Optional[int] = ..., unauthenticated: _Optional[int] = ..., refused_blobs: _Optional[int] = ..., active_streams: _Optional[int] = ..., refused_streams: _Optional[int] = ..., stalled_streams: _Optional[int] = ..., shm_pages: _Optional[int] = ..., shm_pages_reused: _Optional[int] = ..., shm_put_pages: _Optional[int] = ..., shm_offers: _Optional[int] = ..., cancelled_streams: _Optional[int] = ..., shm_offered_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "server")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    server: ServerStats
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., server: _Optional[_Union[ServerStats, _Mapping]] = ...) -> None: ...
