"""The bearer-key check both gateways apply (HTTP ``Authorization`` header, gRPC ``authorization`` metadata)."""

from __future__ import annotations

import hmac

from services.gateway.errors import UnauthorizedError


def check_bearer(authorization: str, api_key: str | None) -> None:
    """Raise ``UnauthorizedError`` unless ``authorization`` is ``Bearer <api_key>`` (any key when unset)."""
    if api_key is None:
        return
    scheme, _, key = authorization.partition(" ")
    # compare_digest: the time taken must not tell how much of a guessed key was right
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), api_key.encode()):
        raise UnauthorizedError("missing or invalid API key")
