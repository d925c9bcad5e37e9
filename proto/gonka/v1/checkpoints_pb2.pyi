from proto.gonka.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListEpochsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EpochSummary(_message.Message):
    __slots__ = ("epoch", "model", "codec", "rounds_finalized", "initial_checkpoint_sha256", "latest_checkpoint_sha256")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FINALIZED_FIELD_NUMBER: _ClassVar[int]
    INITIAL_CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    LATEST_CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    model: str
    codec: str
    rounds_finalized: int
    initial_checkpoint_sha256: bytes
    latest_checkpoint_sha256: bytes
    def __init__(self, epoch: _Optional[int] = ..., model: _Optional[str] = ..., codec: _Optional[str] = ..., rounds_finalized: _Optional[int] = ..., initial_checkpoint_sha256: _Optional[bytes] = ..., latest_checkpoint_sha256: _Optional[bytes] = ...) -> None: ...

class ListEpochsResponse(_message.Message):
    __slots__ = ("epochs",)
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    epochs: _containers.RepeatedCompositeFieldContainer[EpochSummary]
    def __init__(self, epochs: _Optional[_Iterable[_Union[EpochSummary, _Mapping]]] = ...) -> None: ...

class ListRoundsRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("epoch", "round", "state", "checkpoint_sha256", "rewards_root", "contributors", "total_reward")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    REWARDS_ROOT_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REWARD_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    state: str
    checkpoint_sha256: bytes
    rewards_root: bytes
    contributors: int
    total_reward: int
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., state: _Optional[str] = ..., checkpoint_sha256: _Optional[bytes] = ..., rewards_root: _Optional[bytes] = ..., contributors: _Optional[int] = ..., total_reward: _Optional[int] = ...) -> None: ...

class ListRoundsResponse(_message.Message):
    __slots__ = ("rounds",)
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundSummary]
    def __init__(self, rounds: _Optional[_Iterable[_Union[RoundSummary, _Mapping]]] = ...) -> None: ...

class StreamCheckpointRequest(_message.Message):
    __slots__ = ("epoch", "round")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...
