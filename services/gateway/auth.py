"""API keys: `Authorization: Bearer KEY` on HTTP, metadata `authorization: Bearer KEY` on gRPC.

Keys come from `--api-key` (better: the DDTREE_API_KEY environment variable, which `ps` does not
show) and from `--api-key-file`, one key per line, optionally with a per-key cap on the tree budget a
request may ask for:

    # comment
    sk-team-a
    sk-batch max_budget=256

Without any key the gateway is open and every request gets `--max-budget` as its cap.
"""

from __future__ import annotations

import dataclasses
import hmac
import pathlib


class Unauthorized(ValueError):
    """The message to refuse a request with (401 / UNAUTHENTICATED)."""


@dataclasses.dataclass(frozen=True)
class KeyPolicy:
    """What one key may do. `label` names the key in logs (never the key itself)."""

    label: str
    max_budget: int


def parse_key_file(text: str, where: str, default_max_budget: int) -> dict[str, KeyPolicy]:
    """Keys of an api_key_file; ValueError names the file and line of a bad entry."""
    keys: dict[str, KeyPolicy] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, *options = line.split()
        max_budget = default_max_budget
        for option in options:
            name, _, value = option.partition("=")
            if name != "max_budget" or not value.isdigit() or int(value) < 1:
                raise ValueError(f"{where}:{lineno}: expected 'KEY' or 'KEY max_budget=N' (N >= 1), got {option!r}")
            max_budget = int(value)
        if key in keys:
            raise ValueError(f"{where}:{lineno}: this key is listed twice")
        keys[key] = KeyPolicy(label=f"{pathlib.Path(where).name}:{lineno}", max_budget=max_budget)
    if not keys:
        raise ValueError(f"{where}: no keys in the file")
    return keys


class ApiKeys:
    """The gateway's keys and their policies; immutable, shared by the gRPC and HTTP servers."""

    def __init__(self, keys: dict[str, KeyPolicy], default_max_budget: int):
        self._keys = dict(keys)
        self.open_policy = KeyPolicy(label="open", max_budget=default_max_budget)

    @classmethod
    def from_config(cls, config) -> ApiKeys:
        keys: dict[str, KeyPolicy] = {}
        if config.api_key_file:
            path = pathlib.Path(config.api_key_file)
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as e:
                raise ValueError(f"api_key_file: cannot read {path}: {e.strerror}") from None
            keys.update(parse_key_file(text, str(path), config.max_budget))
        if config.api_key:
            keys.setdefault(config.api_key, KeyPolicy(label="api_key", max_budget=config.max_budget))
        return cls(keys, config.max_budget)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def authorize(self, value: str | None, header: str = "the header 'Authorization") -> KeyPolicy:
        """The policy of the key in an `Authorization` value, or Unauthorized. Open gateways pass all."""
        if not self._keys:
            return self.open_policy
        if not value:
            raise Unauthorized(f"missing API key: send {header}: Bearer <key>'")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        found = None
        for key, policy in self._keys.items():  # compare with every key: the time taken tells nothing
            if hmac.compare_digest(token.encode(), key.encode()):
                found = policy
        if found is None:
            raise Unauthorized("invalid API key")
        return found
