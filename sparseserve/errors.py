"""The exception types of the public API.

Every error raised for bad input is one of these; each is a `ValueError` (and, for a value of
the wrong type, also a `TypeError`), and its message names the field, the value and what to change.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """An engine option (`LLM(...)` / `EngineConfig`) is invalid."""


class ConfigTypeError(ConfigError, TypeError):
    """An engine option has the wrong type."""


class CheckpointError(ConfigError):
    """The checkpoint directory (config.json, weights, tokenizer) cannot be loaded as it is."""


class ModelTooLargeError(ConfigError):
    """The model's weights do not fit the memory there is (sizes and a parallel layout that fits in the message)."""


class InvalidRequestError(ValueError):
    """The request cannot run as given (prompt, request id, parameters)."""


class InvalidRequestTypeError(InvalidRequestError, TypeError):
    """A request argument has the wrong type."""


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""


class SamplingParamsTypeError(SamplingParamsError, TypeError):
    """A sampling parameter has the wrong type."""


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit in this engine's cache or context."""


class EngineClosedError(RuntimeError):
    """The engine was shut down (`LLM.shutdown()`, the end of a `with LLM(...)` block): its model and
    state are freed, so it runs no more requests. Not a bad-input error."""


# The error raised for a wrong type, for each family of value errors.
TYPE_ERRORS: dict[type[ValueError], type[ValueError]] = {
    ConfigError: ConfigTypeError,
    CheckpointError: CheckpointError,
    InvalidRequestError: InvalidRequestTypeError,
    SamplingParamsError: SamplingParamsTypeError,
}

# The finish reason of a request that failed inside a step; its `stop_reason` holds the message.
FINISH_ERROR = "error"


class DistributedError(RuntimeError):
    """A rank of a parallel layout (tensor/expert parallelism) failed; the engine cannot go on.

    Not a bad-input error: the executor has stopped its workers when this is raised."""


class WorkerDiedError(DistributedError):
    """A worker process exited (killed, crashed) while the engine needed it."""


class WorkerStepError(DistributedError):
    """A worker raised while running a step or a call; the message carries its traceback."""


class CollectiveTimeoutError(DistributedError):
    """No answer from the workers within the step timeout (a hung collective or rank)."""


class WorkerConfigError(DistributedError, ConfigError):
    """A worker rejected the options at start-up (e.g. the nodes were started with different ones)."""
