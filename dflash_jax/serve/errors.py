"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` for every refusal.

:class:`APIError` is raised by the server's own checks; :func:`install_handlers` turns it, the
framework's validation errors (malformed JSON, wrong types: 400 naming the field) and its HTTP
errors (unknown paths, wrong methods) into that object.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from dflash_jax.errors import DFlashError

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """A refusal the client sees as an OpenAI error object.

    Args:
      status: the HTTP status.
      message: what is wrong and what was expected.
      param: the request field at fault, or ``None``.
      code: a machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
      headers: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.kind = kind or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_dflash(e: DFlashError, param: str) -> APIError:
    """A library input error as a 400 naming the request field ``param``."""
    return APIError(400, f"{param}: {e.what}" + (f" (expected {e.expected})" if e.expected else ""), param, "invalid_value")


def _field(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation error as a 400 naming its field (``messages.0.role``)."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    field = _field(first.get("loc", ()))
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')} (expected a JSON object)", None, "invalid_json")
    if field is None and kind == "missing":
        return APIError(400, "request body: missing (expected a JSON object with the endpoint's fields)", None, "missing_body")
    if field is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        got = first.get("input")
        return APIError(400, f"request body: a JSON {_json_type(got)} (expected a JSON object with the endpoint's fields)", None, "invalid_body")
    if kind == "missing":
        return APIError(400, f"{field}: missing (expected a value)", field, "missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"{field}: not a parameter of this endpoint (expected OpenAI's fields or this server's "
                        "extensions, README \"Serving\"; unknown ones are refused, not ignored)", field, "unknown_parameter")
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") or kind == "model_attributes_type" else "invalid_value"
    where = field or "body"
    return APIError(400, f"{where}: {first.get('msg')} (got {shown})", field, code)


def _json_type(x) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}.get(type(x), type(x).__name__)


def install_handlers(app: FastAPI) -> None:
    """Every error the app answers becomes an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api(_request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, message, None, codes.get(exc.status_code), headers=getattr(exc, "headers", None)).response()
