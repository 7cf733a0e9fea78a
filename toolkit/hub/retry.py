"""Hub calls that may fail: what went wrong in words, and retries with backoff for transient failures."""

from __future__ import annotations

import sys
import time


def http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def is_transient(exc: BaseException | None) -> bool:
    """A 5xx/408/429 answer, or a dropped/failed connection anywhere in the exception's cause chain (a malformed
    URL is a TransportError to httpx, but retrying it cannot help)."""
    if exc is not None and failure_kind(exc) in ("malformed URL", "offline mode (HF_HUB_OFFLINE is set)"):
        return False
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        status = http_status(exc)
        if status is not None:
            return status >= 500 or status in (408, 429)
        names = {c.__name__ for c in type(exc).__mro__}
        if isinstance(exc, (ConnectionError, TimeoutError)) or names & {"TransportError", "ProtocolError"}:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def chain(exc: BaseException | None) -> list[BaseException]:
    """The exception and its causes, outermost first."""
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def failure_kind(exc: BaseException) -> str:
    """What went wrong, in words: an HTTP status, a refused connection, an unknown host, a bad URL, a timeout."""
    status = http_status(exc)
    if status is not None:
        return f"HTTP {status}"
    for e in chain(exc):
        names = {c.__name__ for c in type(e).__mro__}
        if "OfflineModeIsEnabled" in names:
            return "offline mode (HF_HUB_OFFLINE is set)"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if "gaierror" in names:
            return "host not found"
        if names & {"UnsupportedProtocol", "InvalidURL", "LocalProtocolError"}:
            return "malformed URL"
        if isinstance(e, TimeoutError) or names & {"TimeoutException", "ReadTimeout", "ConnectTimeout"}:
            return "timed out"
    e = chain(exc)[-1]
    return f"{type(e).__name__}: {e}"


def describe(exc: BaseException, token: str | None) -> str:
    text = " ".join(failure_kind(exc).split())[:200]
    return text.replace(token, "***") if token else text


def with_retries(fn, what: str, retries: int, retry_delay: float, token: str | None):
    """Run fn(); on a transient failure wait retry_delay * 2**k and try again, at most `retries` more times."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below, re-raised as one line
            if not is_transient(e) or attempt == retries:
                raise Failed(what, attempt + 1, e, describe(e, token)) from None
            wait = retry_delay * 2**attempt
            print(f"{what}: {describe(e, token)}; retrying in {wait:.1f}s ({attempt + 1}/{retries})", file=sys.stderr)
            time.sleep(wait)


class Failed(Exception):
    def __init__(self, what: str, attempts: int, exc: BaseException, reason: str):
        super().__init__(reason)
        self.what, self.attempts, self.status, self.reason = what, attempts, http_status(exc), reason
