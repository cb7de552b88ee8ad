"""Bearer API keys for the HTTP front (`--api-key`, `DUET_API_KEY`), as `vllm serve --api-key`.

Keys are compared in constant time (each presented key against every configured key, so the
time taken tells neither which key nor how much of one matched) and never logged: the object's
repr hides them, and a refused request is logged without what it presented.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

ENV_VAR = "DUET_API_KEY"
_BEARER = "bearer "


def configured_keys(flags: Iterable[str], environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The `--api-key` values plus `DUET_API_KEY` when it is set."""
    env = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return tuple(k for k in (*flags, env) if k)


class ApiKeys:
    """The keys a request may present; none configured = every request is let in."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = tuple(k.encode() for k in keys if k)

    @classmethod
    def from_flags(cls, flags: Iterable[str], environ: dict[str, str] | None = None) -> ApiKeys:
        return cls(configured_keys(flags, environ))

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def admits(self, authorization: str | None, api_key: str | None = None) -> bool:
        """Whether an `Authorization` header value carries one of the keys as a Bearer token, or
        an `x-api-key` header value (Anthropic's clients) is one."""
        if not self._keys:
            return True
        presented = [api_key.strip().encode()] if api_key is not None else []
        if authorization is not None and authorization[:len(_BEARER)].lower() == _BEARER:
            presented.append(authorization[len(_BEARER):].strip().encode())
        matched = False
        for key in self._keys:  # no early exit: every key is compared every time
            for value in presented:
                matched |= hmac.compare_digest(value, key)
        return matched

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._keys)} keys)"
