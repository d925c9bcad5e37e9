from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_KIND_UNSPECIFIED: _ClassVar[ShardKind]
    SHARD_REPORT: _ClassVar[ShardKind]
    SHARD_VERDICT: _ClassVar[ShardKind]
    SHARD_HASH: _ClassVar[ShardKind]
    SHARD_BLOB: _ClassVar[ShardKind]

class ShardRefusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_REFUSAL_UNSPECIFIED: _ClassVar[ShardRefusal]
    SHARD_MALFORMED: _ClassVar[ShardRefusal]
    SHARD_WRONG_CHAIN: _ClassVar[ShardRefusal]
    SHARD_WRONG_EPOCH: _ClassVar[ShardRefusal]
    SHARD_UNKNOWN_SHARD: _ClassVar[ShardRefusal]
    SHARD_BAD_SIGNATURE: _ClassVar[ShardRefusal]
    SHARD_STALE_ROUND: _ClassVar[ShardRefusal]
    SHARD_FUTURE_ROUND: _ClassVar[ShardRefusal]
    SHARD_REPLAYED: _ClassVar[ShardRefusal]
    SHARD_CONFLICT: _ClassVar[ShardRefusal]
    SHARD_NOT_PERMITTED: _ClassVar[ShardRefusal]
    SHARD_OVERSIZE: _ClassVar[ShardRefusal]
    SHARD_DIGEST_MISMATCH: _ClassVar[ShardRefusal]
    SHARD_QUOTA: _ClassVar[ShardRefusal]
    SHARD_UNHELD_HOST: _ClassVar[ShardRefusal]
    SHARD_SEED_PENDING: _ClassVar[ShardRefusal]
    SHARD_NOT_SAMPLED: _ClassVar[ShardRefusal]
SHARD_KIND_UNSPECIFIED: ShardKind
SHARD_REPORT: ShardKind
SHARD_VERDICT: ShardKind
SHARD_HASH: ShardKind
SHARD_BLOB: ShardKind
SHARD_REFUSAL_UNSPECIFIED: ShardRefusal
SHARD_MALFORMED: ShardRefusal
SHARD_WRONG_CHAIN: ShardRefusal
SHARD_WRONG_EPOCH: ShardRefusal
SHARD_UNKNOWN_SHARD: ShardRefusal
SHARD_BAD_SIGNATURE: ShardRefusal
SHARD_STALE_ROUND: ShardRefusal
SHARD_FUTURE_ROUND: ShardRefusal
SHARD_REPLAYED: ShardRefusal
SHARD_CONFLICT: ShardRefusal
SHARD_NOT_PERMITTED: ShardRefusal
SHARD_OVERSIZE: ShardRefusal
SHARD_DIGEST_MISMATCH: ShardRefusal
SHARD_QUOTA: ShardRefusal
SHARD_UNHELD_HOST: ShardRefusal
SHARD_SEED_PENDING: ShardRefusal
SHARD_NOT_SAMPLED: ShardRefusal

class ShardHelloRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class ShardHello(_message.Message):
    __slots__ = ("epoch", "index", "count", "node_key")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NODE_KEY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    index: int
    count: int
    node_key: bytes
    def __init__(self, epoch: _Optional[int] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., node_key: _Optional[bytes] = ...) -> None: ...

class ShardEnvelope(_message.Message):
    __slots__ = ("chain_id", "registry", "epoch", "round", "kind", "sender", "count", "key", "body_sha256", "body_length", "sequence", "signature")
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BODY_SHA256_FIELD_NUMBER: _ClassVar[int]
    BODY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    chain_id: int
    registry: bytes
    epoch: int
    round: int
    kind: ShardKind
    sender: int
    count: int
    key: str
    body_sha256: bytes
    body_length: int
    sequence: int
    signature: bytes
    def __init__(self, chain_id: _Optional[int] = ..., registry: _Optional[bytes] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., kind: _Optional[_Union[ShardKind, str]] = ..., sender: _Optional[int] = ..., count: _Optional[int] = ..., key: _Optional[str] = ..., body_sha256: _Optional[bytes] = ..., body_length: _Optional[int] = ..., sequence: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ShardPut(_message.Message):
    __slots__ = ("envelope", "data")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    envelope: ShardEnvelope
    data: bytes
    def __init__(self, envelope: _Optional[_Union[ShardEnvelope, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ShardAck(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    def __init__(self, stored: bool = ...) -> None: ...
