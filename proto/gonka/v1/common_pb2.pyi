from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_REASON_UNSPECIFIED: _ClassVar[RejectReason]
    REJECT_MALFORMED: _ClassVar[RejectReason]
    REJECT_WRONG_CHAIN: _ClassVar[RejectReason]
    REJECT_BAD_SIGNATURE: _ClassVar[RejectReason]
    REJECT_UNKNOWN_HOST: _ClassVar[RejectReason]
    REJECT_WRONG_ROUND: _ClassVar[RejectReason]
    REJECT_STALE_BASE: _ClassVar[RejectReason]
    REJECT_LATE: _ClassVar[RejectReason]
    REJECT_DUPLICATE: _ClassVar[RejectReason]
    REJECT_OVERSIZE: _ClassVar[RejectReason]
    REJECT_TRUNCATED: _ClassVar[RejectReason]
    REJECT_DIGEST_MISMATCH: _ClassVar[RejectReason]
    REJECT_WRONG_CODEC: _ClassVar[RejectReason]
    REJECT_UNDECODABLE: _ClassVar[RejectReason]
    REJECT_WRONG_SHAPE: _ClassVar[RejectReason]
    REJECT_NON_FINITE: _ClassVar[RejectReason]
    REJECT_NORM_TOO_LARGE: _ClassVar[RejectReason]
    REJECT_COPY: _ClassVar[RejectReason]
    REJECT_CLOCK_SKEW: _ClassVar[RejectReason]
    REJECT_UNAVAILABLE: _ClassVar[RejectReason]
    REJECT_STREAM_TIMEOUT: _ClassVar[RejectReason]
    REJECT_OBJECT_MISMATCH: _ClassVar[RejectReason]
    REJECT_NOT_CHALLENGED: _ClassVar[RejectReason]
    REJECT_ROOT_MISMATCH: _ClassVar[RejectReason]
REJECT_REASON_UNSPECIFIED: RejectReason
REJECT_MALFORMED: RejectReason
REJECT_WRONG_CHAIN: RejectReason
REJECT_BAD_SIGNATURE: RejectReason
REJECT_UNKNOWN_HOST: RejectReason
REJECT_WRONG_ROUND: RejectReason
REJECT_STALE_BASE: RejectReason
REJECT_LATE: RejectReason
REJECT_DUPLICATE: RejectReason
REJECT_OVERSIZE: RejectReason
REJECT_TRUNCATED: RejectReason
REJECT_DIGEST_MISMATCH: RejectReason
REJECT_WRONG_CODEC: RejectReason
REJECT_UNDECODABLE: RejectReason
REJECT_WRONG_SHAPE: RejectReason
REJECT_NON_FINITE: RejectReason
REJECT_NORM_TOO_LARGE: RejectReason
REJECT_COPY: RejectReason
REJECT_CLOCK_SKEW: RejectReason
REJECT_UNAVAILABLE: RejectReason
REJECT_STREAM_TIMEOUT: RejectReason
REJECT_OBJECT_MISMATCH: RejectReason
REJECT_NOT_CHALLENGED: RejectReason
REJECT_ROOT_MISMATCH: RejectReason

class FileMeta(_message.Message):
    __slots__ = ("length", "file_sha256", "content_sha256", "epoch", "round", "format")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    length: int
    file_sha256: bytes
    content_sha256: bytes
    epoch: int
    round: int
    format: str
    def __init__(self, length: _Optional[int] = ..., file_sha256: _Optional[bytes] = ..., content_sha256: _Optional[bytes] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., format: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("meta", "data")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta: FileMeta
    data: bytes
    def __init__(self, meta: _Optional[_Union[FileMeta, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
