from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHeader(_message.Message):
    __slots__ = ("request_id", "model", "block_hashes", "num_layers", "dtype", "shape", "checksum", "total_bytes", "layerwise", "kv_format")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    total_bytes: int
    layerwise: bool
    kv_format: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., total_bytes: _Optional[int] = ..., layerwise: bool = ..., kv_format: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "offset", "data", "checksum")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    offset: int
    data: bytes
    checksum: int
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class KVAck(_message.Message):
    __slots__ = ("request_id", "received_bytes", "ok", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    received_bytes: int
    ok: bool
    error: str
    def __init__(self, request_id: _Optional[str] = ..., received_bytes: _Optional[int] = ..., ok: bool = ..., error: _Optional[str] = ...) -> None: ...
