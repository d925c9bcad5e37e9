from proto.gonka.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetOpenRoundRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_payload_bytes", "max_chunk_bytes", "max_update_norm", "max_clock_skew_ms")
    MAX_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_UPDATE_NORM_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_SKEW_MS_FIELD_NUMBER: _ClassVar[int]
    max_payload_bytes: int
    max_chunk_bytes: int
    max_update_norm: float
    max_clock_skew_ms: int
    def __init__(self, max_payload_bytes: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., max_update_norm: _Optional[float] = ..., max_clock_skew_ms: _Optional[int] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("chain_id", "registry", "epoch", "round", "base_checkpoint_sha256", "deadline_unix_ms", "codec", "limits", "aggregator_key", "submissions", "expected_hosts", "direct_upload")
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_KEY_FIELD_NUMBER: _ClassVar[int]
    SUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_HOSTS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    chain_id: int
    registry: bytes
    epoch: int
    round: int
    base_checkpoint_sha256: bytes
    deadline_unix_ms: int
    codec: str
    limits: Limits
    aggregator_key: bytes
    submissions: int
    expected_hosts: int
    direct_upload: bool
    def __init__(self, chain_id: _Optional[int] = ..., registry: _Optional[bytes] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., base_checkpoint_sha256: _Optional[bytes] = ..., deadline_unix_ms: _Optional[int] = ..., codec: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., aggregator_key: _Optional[bytes] = ..., submissions: _Optional[int] = ..., expected_hosts: _Optional[int] = ..., direct_upload: bool = ...) -> None: ...

class SubmitHeader(_message.Message):
    __slots__ = ("chain_id", "registry", "epoch", "round", "host", "base_checkpoint_sha256", "codec", "payload_sha256", "payload_length", "tokens_trained", "timestamp_unix_ms", "signature", "residual_root")
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_ROOT_FIELD_NUMBER: _ClassVar[int]
    chain_id: int
    registry: bytes
    epoch: int
    round: int
    host: bytes
    base_checkpoint_sha256: bytes
    codec: str
    payload_sha256: bytes
    payload_length: int
    tokens_trained: int
    timestamp_unix_ms: int
    signature: bytes
    residual_root: bytes
    def __init__(self, chain_id: _Optional[int] = ..., registry: _Optional[bytes] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., host: _Optional[bytes] = ..., base_checkpoint_sha256: _Optional[bytes] = ..., codec: _Optional[str] = ..., payload_sha256: _Optional[bytes] = ..., payload_length: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., timestamp_unix_ms: _Optional[int] = ..., signature: _Optional[bytes] = ..., residual_root: _Optional[bytes] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("header", "chunk", "stored")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    header: SubmitHeader
    chunk: bytes
    stored: StoredPayload
    def __init__(self, header: _Optional[_Union[SubmitHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., stored: _Optional[_Union[StoredPayload, _Mapping]] = ...) -> None: ...

class StoredPayload(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class UploadSlot(_message.Message):
    __slots__ = ("url", "key", "expires_unix_ms")
    URL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    url: str
    key: str
    expires_unix_ms: int
    def __init__(self, url: _Optional[str] = ..., key: _Optional[str] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("accepted", "reason", "message", "chain_id", "registry", "epoch", "round", "host", "payload_sha256", "payload_length", "received_unix_ms", "aggregator_key", "signature")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: _common_pb2.RejectReason
    message: str
    chain_id: int
    registry: bytes
    epoch: int
    round: int
    host: bytes
    payload_sha256: bytes
    payload_length: int
    received_unix_ms: int
    aggregator_key: bytes
    signature: bytes
    def __init__(self, accepted: bool = ..., reason: _Optional[_Union[_common_pb2.RejectReason, str]] = ..., message: _Optional[str] = ..., chain_id: _Optional[int] = ..., registry: _Optional[bytes] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., host: _Optional[bytes] = ..., payload_sha256: _Optional[bytes] = ..., payload_length: _Optional[int] = ..., received_unix_ms: _Optional[int] = ..., aggregator_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RoundRef(_message.Message):
    __slots__ = ("epoch", "round")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class SubmissionRef(_message.Message):
    __slots__ = ("epoch", "round", "host")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    host: bytes
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., host: _Optional[bytes] = ...) -> None: ...

class SubmissionStatus(_message.Message):
    __slots__ = ("state", "reason", "message", "payload_sha256", "received_unix_ms", "round_seed", "challenged_chunks", "opening_deadline_unix_ms")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[SubmissionStatus.State]
        PENDING: _ClassVar[SubmissionStatus.State]
        CHECKED: _ClassVar[SubmissionStatus.State]
        FAILED: _ClassVar[SubmissionStatus.State]
        CHALLENGED: _ClassVar[SubmissionStatus.State]
        OPENED: _ClassVar[SubmissionStatus.State]
    STATE_UNSPECIFIED: SubmissionStatus.State
    PENDING: SubmissionStatus.State
    CHECKED: SubmissionStatus.State
    FAILED: SubmissionStatus.State
    CHALLENGED: SubmissionStatus.State
    OPENED: SubmissionStatus.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SEED_FIELD_NUMBER: _ClassVar[int]
    CHALLENGED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    OPENING_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    state: SubmissionStatus.State
    reason: _common_pb2.RejectReason
    message: str
    payload_sha256: bytes
    received_unix_ms: int
    round_seed: bytes
    challenged_chunks: _containers.RepeatedScalarFieldContainer[int]
    opening_deadline_unix_ms: int
    def __init__(self, state: _Optional[_Union[SubmissionStatus.State, str]] = ..., reason: _Optional[_Union[_common_pb2.RejectReason, str]] = ..., message: _Optional[str] = ..., payload_sha256: _Optional[bytes] = ..., received_unix_ms: _Optional[int] = ..., round_seed: _Optional[bytes] = ..., challenged_chunks: _Optional[_Iterable[int]] = ..., opening_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class OpeningHeader(_message.Message):
    __slots__ = ("chain_id", "registry", "epoch", "round", "host", "previous_root", "residual_root", "body_sha256", "body_length", "timestamp_unix_ms", "signature")
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ROOT_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_ROOT_FIELD_NUMBER: _ClassVar[int]
    BODY_SHA256_FIELD_NUMBER: _ClassVar[int]
    BODY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    chain_id: int
    registry: bytes
    epoch: int
    round: int
    host: bytes
    previous_root: bytes
    residual_root: bytes
    body_sha256: bytes
    body_length: int
    timestamp_unix_ms: int
    signature: bytes
    def __init__(self, chain_id: _Optional[int] = ..., registry: _Optional[bytes] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., host: _Optional[bytes] = ..., previous_root: _Optional[bytes] = ..., residual_root: _Optional[bytes] = ..., body_sha256: _Optional[bytes] = ..., body_length: _Optional[int] = ..., timestamp_unix_ms: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class OpeningRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: OpeningHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[OpeningHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class OpenedChunk(_message.Message):
    __slots__ = ("index", "previous", "previous_path", "current", "current_path")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_PATH_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    CURRENT_PATH_FIELD_NUMBER: _ClassVar[int]
    index: int
    previous: bytes
    previous_path: _containers.RepeatedScalarFieldContainer[bytes]
    current: bytes
    current_path: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, index: _Optional[int] = ..., previous: _Optional[bytes] = ..., previous_path: _Optional[_Iterable[bytes]] = ..., current: _Optional[bytes] = ..., current_path: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ResidualOpening(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[OpenedChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[OpenedChunk, _Mapping]]] = ...) -> None: ...

class OpeningReceipt(_message.Message):
    __slots__ = ("accepted", "reason", "message", "body_sha256", "received_unix_ms")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BODY_SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: _common_pb2.RejectReason
    message: str
    body_sha256: bytes
    received_unix_ms: int
    def __init__(self, accepted: bool = ..., reason: _Optional[_Union[_common_pb2.RejectReason, str]] = ..., message: _Optional[str] = ..., body_sha256: _Optional[bytes] = ..., received_unix_ms: _Optional[int] = ...) -> None: ...

class Contribution(_message.Message):
    __slots__ = ("host", "score", "reward", "aggregated", "reasons", "payload_length")
    HOST_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENGTH_FIELD_NUMBER: _ClassVar[int]
    host: bytes
    score: float
    reward: int
    aggregated: bool
    reasons: _containers.RepeatedScalarFieldContainer[str]
    payload_length: int
    def __init__(self, host: _Optional[bytes] = ..., score: _Optional[float] = ..., reward: _Optional[int] = ..., aggregated: bool = ..., reasons: _Optional[_Iterable[str]] = ..., payload_length: _Optional[int] = ...) -> None: ...

class RoundResult(_message.Message):
    __slots__ = ("epoch", "round", "state", "base_checkpoint_sha256", "checkpoint_sha256", "rewards_root", "total_reward", "aggregation", "contributions", "finalize_tx", "heldout_loss_base", "heldout_loss")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    REWARDS_ROOT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REWARD_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    FINALIZE_TX_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_LOSS_BASE_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_LOSS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    state: str
    base_checkpoint_sha256: bytes
    checkpoint_sha256: bytes
    rewards_root: bytes
    total_reward: int
    aggregation: str
    contributions: _containers.RepeatedCompositeFieldContainer[Contribution]
    finalize_tx: bytes
    heldout_loss_base: float
    heldout_loss: float
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., state: _Optional[str] = ..., base_checkpoint_sha256: _Optional[bytes] = ..., checkpoint_sha256: _Optional[bytes] = ..., rewards_root: _Optional[bytes] = ..., total_reward: _Optional[int] = ..., aggregation: _Optional[str] = ..., contributions: _Optional[_Iterable[_Union[Contribution, _Mapping]]] = ..., finalize_tx: _Optional[bytes] = ..., heldout_loss_base: _Optional[float] = ..., heldout_loss: _Optional[float] = ...) -> None: ...

class GetRewardProofRequest(_message.Message):
    __slots__ = ("epoch", "round", "host")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    host: bytes
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., host: _Optional[bytes] = ...) -> None: ...

class RewardProof(_message.Message):
    __slots__ = ("epoch", "round", "host", "amount", "proof", "rewards_root")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    REWARDS_ROOT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    host: bytes
    amount: int
    proof: _containers.RepeatedScalarFieldContainer[bytes]
    rewards_root: bytes
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., host: _Optional[bytes] = ..., amount: _Optional[int] = ..., proof: _Optional[_Iterable[bytes]] = ..., rewards_root: _Optional[bytes] = ...) -> None: ...

class StoredObject(_message.Message):
    __slots__ = ("url", "key", "length", "file_sha256", "expires_unix_ms")
    URL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    url: str
    key: str
    length: int
    file_sha256: bytes
    expires_unix_ms: int
    def __init__(self, url: _Optional[str] = ..., key: _Optional[str] = ..., length: _Optional[int] = ..., file_sha256: _Optional[bytes] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class RoundLocation(_message.Message):
    __slots__ = ("epoch", "round", "checkpoint", "update", "fragment")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    checkpoint: StoredObject
    update: StoredObject
    fragment: FragmentProof
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., checkpoint: _Optional[_Union[StoredObject, _Mapping]] = ..., update: _Optional[_Union[StoredObject, _Mapping]] = ..., fragment: _Optional[_Union[FragmentProof, _Mapping]] = ...) -> None: ...

class FragmentProof(_message.Message):
    __slots__ = ("index", "count", "fragment_sha256", "siblings")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    fragment_sha256: bytes
    siblings: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., fragment_sha256: _Optional[bytes] = ..., siblings: _Optional[_Iterable[bytes]] = ...) -> None: ...
