"""The one error hierarchy of loraplex, shared by every layer.

`UserError` is bad input: the API answers it as a failed future with category "user" or as a
400/404/422 with a body, never 409/429/5xx (the Tinker SDK retries those for minutes).
Anything else raised inside the service is a server error (5xx or category "server", logged).
To add an error, subclass the category it belongs to and the stdlib type it stands in for.
"""


class LoraplexError(Exception):
    """Base of every error loraplex raises on purpose."""


class UserError(LoraplexError, ValueError):
    """The request was wrong; retrying it unchanged fails the same way (HTTP 400 / category user)."""

    status_code = 400


class NotFoundError(UserError, LookupError):
    """The named run, future, sampler or checkpoint does not exist or is not the caller's (404)."""

    status_code = 404


class PermissionDeniedError(UserError, PermissionError):
    """The object exists but belongs to another tenant (403)."""

    status_code = 403


class AuthenticationError(UserError):
    """The API key is missing or unknown (401)."""

    status_code = 401


class CapacityError(LoraplexError):
    """The service is temporarily full (e.g. no free slot); the same request may succeed later."""


class UnavailableError(CapacityError):
    """What the request needed went away while it ran (a vLLM sampler server died or stalled); sending it
    again may succeed (HTTP 503 with Retry-After). A future failed with it is answered 410 by
    retrieve_future, on which the Tinker SDK sends a sample again (future category "retryable")."""

    status_code = 503
    retry_after_s = 1


class ServerError(LoraplexError, RuntimeError):
    """Something broke inside the service; the request itself may have been fine."""


class FieldError(UserError):
    """Bad input in one named field of the request (400). `problem` reads after the field's name, so an API
    whose fields have other names (the OpenAI-compatible one) words the same refusal in its own names."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem
