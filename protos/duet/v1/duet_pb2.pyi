from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "prompt_logprobs", "guided", "num_speculative_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: int
    guided: GuidedDecoding
    num_speculative_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., guided: _Optional[_Union[GuidedDecoding, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class GuidedDecoding(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice")
    class Choices(_message.Message):
        __slots__ = ("choices",)
        CHOICES_FIELD_NUMBER: _ClassVar[int]
        choices: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: GuidedDecoding.Choices
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[GuidedDecoding.Choices, _Mapping]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token", "top")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerationChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "index", "logprobs", "prompt_logprobs", "stop_string")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    stop_string: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class FunctionTool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("kv_pages_total", "kv_pages_free", "kv_pages_reserved", "kv_pages_cached", "running_requests", "queued_prefill_tokens", "queued_requests", "kv_pages_quarantined", "incarnation")
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_RESERVED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_reserved: int
    kv_pages_cached: int
    running_requests: int
    queued_prefill_tokens: int
    queued_requests: int
    kv_pages_quarantined: int
    incarnation: int
    def __init__(self, kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., kv_pages_reserved: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., queued_requests: _Optional[int] = ..., kv_pages_quarantined: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ("incarnation", "after_sequence")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    after_sequence: int
    def __init__(self, incarnation: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("incarnation", "sequence", "snapshot", "stored_blocks", "removed_blocks", "block_size", "medium")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    sequence: int
    snapshot: bool
    stored_blocks: _containers.RepeatedScalarFieldContainer[int]
    removed_blocks: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    def __init__(self, incarnation: _Optional[str] = ..., sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored_blocks: _Optional[_Iterable[int]] = ..., removed_blocks: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class PrepareReceiveRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "kv_window_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_window_end: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., kv_window_end: _Optional[int] = ...) -> None: ...

class PrepareReceiveResponse(_message.Message):
    __slots__ = ("prompt_length", "prefix_matched_length", "kv_append_metadata", "kv_window_end", "lease_deadline_unix", "transfer_nonce", "kv_window_begin")
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MATCHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_APPEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_NONCE_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    prompt_length: int
    prefix_matched_length: int
    kv_append_metadata: _containers.RepeatedScalarFieldContainer[int]
    kv_window_end: int
    lease_deadline_unix: float
    transfer_nonce: int
    kv_window_begin: int
    def __init__(self, prompt_length: _Optional[int] = ..., prefix_matched_length: _Optional[int] = ..., kv_append_metadata: _Optional[_Iterable[int]] = ..., kv_window_end: _Optional[int] = ..., lease_deadline_unix: _Optional[float] = ..., transfer_nonce: _Optional[int] = ..., kv_window_begin: _Optional[int] = ...) -> None: ...

class StartGenerationRequest(_message.Message):
    __slots__ = ("request_id", "kv_window_begin", "sampling", "continuation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_window_begin: int
    sampling: SamplingParams
    continuation: Continuation
    def __init__(self, request_id: _Optional[str] = ..., kv_window_begin: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., continuation: _Optional[_Union[Continuation, _Mapping]] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("samples", "cached_tokens", "finished_completion_tokens")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampleContinuation]
    cached_tokens: int
    finished_completion_tokens: int
    def __init__(self, samples: _Optional[_Iterable[_Union[SampleContinuation, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., finished_completion_tokens: _Optional[int] = ...) -> None: ...

class SampleContinuation(_message.Message):
    __slots__ = ("index", "generated_token_ids", "seed", "random_state")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RANDOM_STATE_FIELD_NUMBER: _ClassVar[int]
    index: int
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    random_state: bytes
    def __init__(self, index: _Optional[int] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., random_state: _Optional[bytes] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "prompt", "messages", "sampling", "tools", "continuation", "prefix_holder")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOLDER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    tools: _containers.RepeatedCompositeFieldContainer[FunctionTool]
    continuation: Continuation
    prefix_holder: PrefixHolder
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[FunctionTool, _Mapping]]] = ..., continuation: _Optional[_Union[Continuation, _Mapping]] = ..., prefix_holder: _Optional[_Union[PrefixHolder, _Mapping]] = ...) -> None: ...

class PrefixHolder(_message.Message):
    __slots__ = ("address", "cached_tokens")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    address: str
    cached_tokens: int
    def __init__(self, address: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "target_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_address: str
    def __init__(self, request_id: _Optional[str] = ..., target_address: _Optional[str] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("tokens_moved", "prefix_matched_length", "pause_seconds")
    TOKENS_MOVED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MATCHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens_moved: int
    prefix_matched_length: int
    pause_seconds: float
    def __init__(self, tokens_moved: _Optional[int] = ..., prefix_matched_length: _Optional[int] = ..., pause_seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("requests_migrated",)
    REQUESTS_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    requests_migrated: int
    def __init__(self, requests_migrated: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BeginTransferRequest(_message.Message):
    __slots__ = ("request_id", "transfer_nonce", "kv_append_metadata", "writer_incarnation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_NONCE_FIELD_NUMBER: _ClassVar[int]
    KV_APPEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    WRITER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_nonce: int
    kv_append_metadata: _containers.RepeatedScalarFieldContainer[int]
    writer_incarnation: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_nonce: _Optional[int] = ..., kv_append_metadata: _Optional[_Iterable[int]] = ..., writer_incarnation: _Optional[int] = ...) -> None: ...

class BeginTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteTransferRequest(_message.Message):
    __slots__ = ("request_id", "transfer_nonce", "abandoned", "kv_checksums")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_NONCE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_nonce: int
    abandoned: bool
    kv_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., transfer_nonce: _Optional[int] = ..., abandoned: _Optional[bool] = ..., kv_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CompleteTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompatibilityFingerprint(_message.Message):
    __slots__ = ("model_hash", "dtype", "num_layers", "num_kv_heads", "head_dim", "page_size", "layout_version")
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    layout_version: int
    def __init__(self, model_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., page_size: _Optional[int] = ..., layout_version: _Optional[int] = ...) -> None: ...

class GetTraceRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TraceEvent(_message.Message):
    __slots__ = ("request_id", "name", "node", "start_unix", "duration_s", "args_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    name: str
    node: str
    start_unix: float
    duration_s: float
    args_json: str
    def __init__(self, request_id: _Optional[str] = ..., name: _Optional[str] = ..., node: _Optional[str] = ..., start_unix: _Optional[float] = ..., duration_s: _Optional[float] = ..., args_json: _Optional[str] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TraceEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[TraceEvent, _Mapping]]] = ...) -> None: ...

class GetTransportInfoRequest(_message.Message):
    __slots__ = ("fingerprint", "transport", "writer")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    fingerprint: CompatibilityFingerprint
    transport: str
    writer: WriterIdentity
    def __init__(self, fingerprint: _Optional[_Union[CompatibilityFingerprint, _Mapping]] = ..., transport: _Optional[str] = ..., writer: _Optional[_Union[WriterIdentity, _Mapping]] = ...) -> None: ...

class WriterIdentity(_message.Message):
    __slots__ = ("incarnation", "address", "boot_id", "pid", "process_start_ticks", "pid_namespace")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_START_TICKS_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    address: str
    boot_id: str
    pid: int
    process_start_ticks: int
    pid_namespace: str
    def __init__(self, incarnation: _Optional[int] = ..., address: _Optional[str] = ..., boot_id: _Optional[str] = ..., pid: _Optional[int] = ..., process_start_ticks: _Optional[int] = ..., pid_namespace: _Optional[str] = ...) -> None: ...

class TransportInfo(_message.Message):
    __slots__ = ("transport", "fingerprint", "num_slots", "tcp_address", "nixl_agent_name", "nixl_agent_metadata", "pool_base_address", "pool_size_bytes", "verify_kv", "sliding_slots")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    POOL_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_KV_FIELD_NUMBER: _ClassVar[int]
    SLIDING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    fingerprint: CompatibilityFingerprint
    num_slots: int
    tcp_address: str
    nixl_agent_name: str
    nixl_agent_metadata: bytes
    pool_base_address: int
    pool_size_bytes: int
    verify_kv: bool
    sliding_slots: int
    def __init__(self, transport: _Optional[str] = ..., fingerprint: _Optional[_Union[CompatibilityFingerprint, _Mapping]] = ..., num_slots: _Optional[int] = ..., tcp_address: _Optional[str] = ..., nixl_agent_name: _Optional[str] = ..., nixl_agent_metadata: _Optional[bytes] = ..., pool_base_address: _Optional[int] = ..., pool_size_bytes: _Optional[int] = ..., verify_kv: _Optional[bool] = ..., sliding_slots: _Optional[int] = ...) -> None: ...

class RemoteSendRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "kv_window_begin", "kv_window_end", "kv_append_metadata", "decode_address", "transfer_nonce")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    KV_APPEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_NONCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_window_begin: int
    kv_window_end: int
    kv_append_metadata: _containers.RepeatedScalarFieldContainer[int]
    decode_address: str
    transfer_nonce: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., kv_window_begin: _Optional[int] = ..., kv_window_end: _Optional[int] = ..., kv_append_metadata: _Optional[_Iterable[int]] = ..., decode_address: _Optional[str] = ..., transfer_nonce: _Optional[int] = ...) -> None: ...

class RemoteSendResponse(_message.Message):
    __slots__ = ("tokens_sent", "tokens_computed", "bytes_sent", "prefill_seconds", "transfer_seconds")
    TOKENS_SENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens_sent: int
    tokens_computed: int
    bytes_sent: int
    prefill_seconds: float
    transfer_seconds: float
    def __init__(self, tokens_sent: _Optional[int] = ..., tokens_computed: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...
