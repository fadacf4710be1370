"""User-visible failures, one type each, each mapped once to an HTTP status and OpenAI error type."""

from __future__ import annotations

import pickle


class ServingError(Exception):
    """Base of every error a client can see. `status_code` and `error_type` drive the HTTP body."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code or type(self).__name__}}


# --- requests ---------------------------------------------------------------------------------


class InvalidRequest(ServingError):
    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class SchemaViolation(InvalidRequest):
    """A body that parses but breaks the schema (a wrong type, a value out of range): FastAPI's 422."""

    status_code = 422


class UnsupportedField(InvalidRequest):
    """A request field this server does not implement: refused, never ignored."""

    code = "unsupported_parameter"

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(ServingError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class CapacityExceeded(ServingError):
    """The engine's queue is full; the client should retry later."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "capacity_exceeded"


class EngineUnavailable(ServingError):
    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"


class Unauthorized(ServingError):
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(ServingError):
    status_code = 403
    error_type = "invalid_request_error"
    code = "adapter_registration_disabled"


class BodyTooLarge(ServingError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class InternalError(ServingError):
    """A bug, not the client's fault: reported without crashing anything."""

    code = "internal_error"


# --- adapters ---------------------------------------------------------------------------------


class AdapterError(ServingError):
    status_code = 400
    error_type = "invalid_request_error"


class AdapterNotFound(ModelNotFound):
    code = "adapter_not_found"


class AdapterAlreadyExists(AdapterError):
    status_code = 409
    code = "adapter_exists"


class AdapterInUse(AdapterError):
    status_code = 409
    code = "adapter_in_use"


class AdapterInvalid(AdapterError):
    """Registration refused. Subclasses name the exact reason."""

    code = "adapter_invalid"


class AdapterPathOutsideRoots(AdapterInvalid):
    code = "adapter_path_outside_roots"


class AdapterFormatError(AdapterInvalid):
    """Missing files, pickle weights, unreadable safetensors or config."""

    code = "adapter_format"


class AdapterTooLarge(AdapterInvalid):
    code = "adapter_too_large"


class AdapterRankTooHigh(AdapterInvalid):
    code = "adapter_rank_too_high"


class AdapterTargetUnsupported(AdapterInvalid):
    code = "adapter_target_unsupported"


class AdapterShapeMismatch(AdapterInvalid):
    code = "adapter_shape_mismatch"


class AdapterNonFinite(AdapterInvalid):
    code = "adapter_non_finite"


class AdapterConfigMismatch(AdapterInvalid):
    """adapter_config.json disagrees with the tensors (rank, target modules)."""

    code = "adapter_config_mismatch"


class AdapterLoadFailed(AdapterError):
    """A registered adapter could not be read at load time (files changed or vanished)."""

    status_code = 422
    code = "adapter_load_failed"


class AdapterSourceMissing(AdapterError):
    """A remote adapter's object does not exist (or its bucket, repository or host does not)."""

    status_code = 404
    code = "adapter_source_not_found"


class AdapterSourceDenied(AdapterInvalid):
    """The store refused this node's credentials for a remote adapter."""

    code = "adapter_source_denied"


class AdapterStoreUnavailable(AdapterLoadFailed):
    """A remote store is down, slow or gave inconsistent bytes; only adapters not cached on the node fail. The
    client is told to retry after RETRY_AFTER_S unless told otherwise."""

    status_code = 503
    error_type = "server_error"
    RETRY_AFTER_S = 5

    def __init__(self, message: str, *, retry_after_s: float | None = RETRY_AFTER_S):
        super().__init__(message, retry_after_s=retry_after_s)


class AdapterCacheFull(AdapterLoadFailed):
    """The node's adapter disk cache cannot make room (its budget or its disk is full of adapters in use)."""

    status_code = 503
    error_type = "server_error"


def picklable(error: BaseException) -> BaseException:
    """`error` where it survives a pickle round trip (to another process), else InternalError of its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle means the same: send its text instead
        return InternalError(f"{type(error).__name__}: {error}")
