"""What every HTTP request passes before a route: the server's own limits, checked before anything is read or parsed.

- A body over `max_body_bytes` (default 1 MB) is refused with 413: at once by its Content-Length, else as soon as
  the bytes read pass it (a 20 MB prompt once held the event loop for minutes and took the server to 3.5 GB).
- A POST to the API must say `Content-Type: application/json` (415 otherwise): a web page can send text/plain to any
  address without asking, but JSON only after a CORS preflight, which this server never grants.
- With no API key, the server answers only requests addressed to its loopback names (`Host: 127.0.0.1:PORT`,
  `localhost`, `[::1]`): a page that rebinds its own DNS name to 127.0.0.1 reaches the socket but names its own host,
  and gets 403 (DNS rebinding). With a key, the key is the check.
- Every response says it may not be framed and where its scripts may come from (CSP, X-Frame-Options, nosniff).

A pure ASGI middleware: it wraps `receive` to count the body and `send` to add the headers, nothing else.
"""

from __future__ import annotations

from starlette.datastructures import Headers

from halo.arguments import is_loopback
from halo.serve.protocol import Forbidden, PayloadTooLarge, ServeError, UnsupportedMediaType

MAX_BODY_BYTES = 1_000_000
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                 b"img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                                 b"form-action 'self'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port ('[::1]:8000' -> '::1', 'localhost:8000' -> 'localhost')."""
    host_header = host_header.lower()  # host names are case-insensitive
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class Guard:
    """The checks above around an ASGI app. loopback_only: refuse requests addressed to other host names (set when
    the server has no API key); respond(error) -> the response a refusal gets (app.error_response)."""

    def __init__(self, app, respond, loopback_only: bool, max_body_bytes: int = MAX_BODY_BYTES, refused=None):
        """refused(path, error): told of each request refused here (the metrics count them as the routes' own)."""
        self.app, self.respond, self.refused = app, respond, refused
        self.loopback_only, self.max_body_bytes = loopback_only, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        try:
            self.check(scope, Headers(scope=scope))
        except ServeError as e:
            if self.refused is not None:
                self.refused(scope["path"], e)
            return await self.respond(e)(scope, receive, send_with_headers)
        await self.app(scope, self.limited(receive) if scope["method"] == "POST" else receive, send_with_headers)

    def check(self, scope, headers: Headers) -> None:
        """Refuse what can be refused from the request line and headers alone."""
        if self.loopback_only and not is_loopback(host_name(headers.get("host", ""))):
            raise Forbidden(f"this server has no API key, so it answers only requests addressed to 127.0.0.1, "
                            f"localhost or [::1], not {headers.get('host', '')!r} (give it --api-key-file to serve "
                            "other names)", "host_not_allowed")
        if scope["method"] != "POST":
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise PayloadTooLarge(f"the request body is {length} bytes; this server takes {self.max_body_bytes} at "
                                  "most (--max-request-bytes)", "request_too_large")
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if scope["path"].startswith("/v1/") and media != "application/json":
            raise UnsupportedMediaType(f"send the request as JSON with 'Content-Type: application/json', not "
                                       f"{media or 'no content type'!r}", "unsupported_media_type")

    def limited(self, receive):
        """receive, refusing a body (of unstated or false length) once it passes the limit."""
        read = 0

        async def receive_limited():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body_bytes:
                    raise PayloadTooLarge(f"the request body passed {self.max_body_bytes} bytes, the most this server "
                                          "takes (--max-request-bytes)", "request_too_large")
            return message

        return receive_limited
