from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Options(_message.Message):
    __slots__ = ("truncate", "normalize", "prompt_name", "prompt", "dimensions")
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    truncate: bool
    normalize: bool
    prompt_name: str
    prompt: str
    dimensions: int
    def __init__(self, truncate: _Optional[bool] = ..., normalize: _Optional[bool] = ..., prompt_name: _Optional[str] = ..., prompt: _Optional[str] = ..., dimensions: _Optional[int] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model", "texts", "options", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    options: Options
    request_id: int
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., options: _Optional[_Union[Options, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("tokenize_us", "queue_us", "inference_us", "total_us")
    TOKENIZE_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    tokenize_us: int
    queue_us: int
    inference_us: int
    total_us: int
    def __init__(self, tokenize_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., inference_us: _Optional[int] = ..., total_us: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("model", "embeddings", "degraded", "timings", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    degraded: bool
    timings: Timings
    request_id: int
    def __init__(self, model: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., degraded: _Optional[bool] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("model", "texts", "options", "top_k", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    options: Options
    top_k: int
    request_id: int
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., options: _Optional[_Union[Options, _Mapping]] = ..., top_k: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class LabelScore(_message.Message):
    __slots__ = ("label", "score")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("labels", "tokens")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedCompositeFieldContainer[LabelScore]
    tokens: int
    def __init__(self, labels: _Optional[_Iterable[_Union[LabelScore, _Mapping]]] = ..., tokens: _Optional[int] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("model", "results", "degraded", "timings", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    degraded: bool
    timings: Timings
    request_id: int
    def __init__(self, model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., degraded: _Optional[bool] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "texts")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizedText(_message.Message):
    __slots__ = ("ids", "tokens")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("model", "results")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    results: _containers.RepeatedCompositeFieldContainer[TokenizedText]
    def __init__(self, model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[TokenizedText, _Mapping]]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelDescription(_message.Message):
    __slots__ = ("name", "task", "dimension", "labels", "max_tokens", "buckets", "backend", "default_normalize", "prompt_names", "default_prompt_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAMES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    task: str
    dimension: int
    labels: _containers.RepeatedScalarFieldContainer[str]
    max_tokens: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    backend: str
    default_normalize: bool
    prompt_names: _containers.RepeatedScalarFieldContainer[str]
    default_prompt_name: str
    def __init__(self, name: _Optional[str] = ..., task: _Optional[str] = ..., dimension: _Optional[int] = ..., labels: _Optional[_Iterable[str]] = ..., max_tokens: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ..., backend: _Optional[str] = ..., default_normalize: _Optional[bool] = ..., prompt_names: _Optional[_Iterable[str]] = ..., default_prompt_name: _Optional[str] = ...) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelDescription]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelDescription, _Mapping]]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("embed", "classify")
    EMBED_FIELD_NUMBER: _ClassVar[int]
    CLASSIFY_FIELD_NUMBER: _ClassVar[int]
    embed: EmbedRequest
    classify: ClassifyRequest
    def __init__(self, embed: _Optional[_Union[EmbedRequest, _Mapping]] = ..., classify: _Optional[_Union[ClassifyRequest, _Mapping]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("embed", "classify", "error")
    EMBED_FIELD_NUMBER: _ClassVar[int]
    CLASSIFY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    embed: EmbedResponse
    classify: ClassifyResponse
    error: StreamError
    def __init__(self, embed: _Optional[_Union[EmbedResponse, _Mapping]] = ..., classify: _Optional[_Union[ClassifyResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    code: str
    message: str
    def __init__(self, request_id: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
