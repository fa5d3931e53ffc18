"""Who may drive an engine server: the weight routes behind a token, the OpenAI routes behind an API key, and
weights read only from inside the publish root.

An engine server's control plane swaps the policy: `POST /v1/weights` (load from a path) and the collective
transfer's `/v1/weights/group` and `/v1/weights/receive`. On a pool that binds beyond loopback, anyone who
can reach the port could otherwise load any weights they like. So:

- `weights_token` (`SAO_WEIGHTS_TOKEN`): every route under `/v1/weights` requires `Authorization: Bearer
  <token>`; a request without it, or with another, is refused with 401 and changes nothing.
- `api_key` (`SAO_API_KEY`, as vLLM's `--api-key` guards its routes): every other route under `/v1`
  (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, and any added later) requires it when one is set.
  `/health` and `/metrics` stay open (probes and Prometheus).
- `publish_root` (`sao engine serve --publish-root`): a path posted to `/v1/weights` must resolve inside
  it (symlinks and `..` followed), else 403, whether or not the path exists.

`check_bind` refuses to serve on a non-loopback address without both a token and a publish root. Secrets live
in the environment only, never in a config file or a flag (a flag shows in `ps`): the trainer reads the same
variables (`Access.from_environment`) and sends the headers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

WEIGHTS_TOKEN_ENV = "SAO_WEIGHTS_TOKEN"
API_KEY_ENV = "SAO_API_KEY"
WEIGHT_ROUTES = "/v1/weights"
"""The routes under it change the served weights (the transfer group's set-up included)."""
API_ROUTES = "/v1"
"""The OpenAI routes: everything else under it, so a route added later is guarded too."""


@dataclass(frozen=True)
class Access:
    weights_token: str | None = None
    api_key: str | None = None
    publish_root: Path | None = None

    def __post_init__(self) -> None:
        # An empty secret is no secret: it would otherwise let in `Authorization: Bearer ` with nothing after it.
        object.__setattr__(self, "weights_token", self.weights_token or None)
        object.__setattr__(self, "api_key", self.api_key or None)
        if self.publish_root is not None:
            object.__setattr__(self, "publish_root", Path(self.publish_root).resolve())

    @classmethod
    def from_environment(cls, publish_root: str | Path | None = None, environ=os.environ) -> Access:
        """The token and key from `SAO_WEIGHTS_TOKEN` / `SAO_API_KEY` (unset, empty or blank: none). Surrounding
        whitespace is dropped: a secret file's trailing newline would make every header invalid."""
        return cls(
            (environ.get(WEIGHTS_TOKEN_ENV) or "").strip() or None,
            (environ.get(API_KEY_ENV) or "").strip() or None,
            Path(publish_root) if publish_root else None,
        )

    def required(self, route: str) -> str | None:
        """The credential `route` needs here (None: open)."""
        if _under(route, WEIGHT_ROUTES):
            return self.weights_token
        if _under(route, API_ROUTES):
            return self.api_key
        return None

    @staticmethod
    def credential_name(route: str) -> str:
        """What a refusal of `route` tells the caller to send."""
        return f"weights token (${WEIGHTS_TOKEN_ENV})" if _under(route, WEIGHT_ROUTES) else f"API key (${API_KEY_ENV})"

    def allows_path(self, path: str | Path) -> bool:
        """Whether weights may be read from `path`: anywhere without a publish root, else inside it."""
        if self.publish_root is None:
            return True
        return Path(path).resolve().is_relative_to(self.publish_root)


OPEN = Access()
"""No credential and no root: the default for loopback servers (tests, `make run`)."""


def _under(route: str, prefix: str) -> bool:
    """Whether `route` is `prefix` or below it (on a path-segment boundary)."""
    return route == prefix or route.startswith(prefix + "/")


def bearer(secret: str | None) -> dict[str, str]:
    """The headers that present `secret` (none when there is none)."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def bearer_matches(header: str | None, secret: str) -> bool:
    """Whether an `Authorization` header presents `secret` ("Bearer" in any case). The digests are compared, in
    constant time, so neither the secret's bytes nor its length leak through timing."""
    scheme, _, value = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not secret:
        return False
    return hmac.compare_digest(_digest(value.strip()), _digest(secret))


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def check_bind(host: str, access: Access) -> None:
    """Refuse (ValueError naming what is missing) a non-loopback bind whose weight routes anyone could drive."""
    if _loopback(host):
        return
    missing = [
        what
        for what, ok in (
            (f"a weights token (${WEIGHTS_TOKEN_ENV})", access.weights_token),
            ("a publish root (--publish-root)", access.publish_root),
        )
        if not ok
    ]
    if missing:
        raise ValueError(
            f"--host: serving on {host or 'every interface'} (beyond loopback) needs {' and '.join(missing)}: "
            "otherwise anyone who reaches the port can load weights of their own"
        )


def _loopback(host: str) -> bool:
    """Only an address that is loopback for sure; a host name other than localhost may resolve to anything."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
