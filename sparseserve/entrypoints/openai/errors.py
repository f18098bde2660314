"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every failure the
server answers, and the mapping of the engine's typed errors to status codes."""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...chat import ChatFormatError
from ...engine.async_engine import EngineDeadError, QueueFullError
from ...engine.kv_cache import RequestTooLargeError
from ...engine.llm_engine import InvalidRequestError
from ...sampling_params import SamplingParamsError

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestTooLarge", 429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """The status a failure of one request answers with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (InvalidRequestError, SamplingParamsError, RequestTooLargeError, ChatFormatError)):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    return APIError(500, f"internal error: {exc.__class__.__name__}: {exc}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    parts, params = [], []
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        if not loc and err.get("type") != "json_invalid":
            parts.append("the request body must be a JSON object (send Content-Type: application/json)")
        elif err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"{field}: this field is not supported")
        elif err.get("type") == "missing":
            parts.append(f"{field}: this field is required")
        else:
            parts.append(f"{field}: {err.get('msg')} (got {err.get('input')!r})" if field else str(err.get("msg")))
        if field:
            params.append(field)
    return "; ".join(parts), (params[0] if params else None)


def install_handlers(app) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    async def _typed(_: Request, exc: Exception):
        err = to_api_error(exc)
        return error_response(err.status, err.message, err.param, err.headers)

    for cls in (InvalidRequestError, SamplingParamsError, RequestTooLargeError, ChatFormatError, QueueFullError,
                EngineDeadError):
        app.add_exception_handler(cls, _typed)
