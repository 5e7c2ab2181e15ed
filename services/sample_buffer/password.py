"""The Redis password every Tandem client sends: TANDEM_REDIS_PASSWORD, from the environment.

Never from the URL: URLs are printed (start-up lines, errors, a run folder's redis.json), and a
password inside one would be printed with them. A URL that carries one anyway
(redis://:PASSWORD@host) keeps working: redis-py lets the URL's win. The password itself is
never printed: a refusal names the variable, not its value. Knows nothing of what the clients
do; each place that makes a client passes `password_option()`.
"""

from __future__ import annotations

import os

import redis

PASSWORD_ENV = "TANDEM_REDIS_PASSWORD"


def password_option() -> dict[str, str]:
    """redis-py's `password` argument from TANDEM_REDIS_PASSWORD ({} when it is unset or empty:
    the client sends none)."""
    password = os.environ.get(PASSWORD_ENV, "")
    return {"password": password} if password else {}


class RedisPasswordError(ValueError):
    """The Redis asks for a password that this process does not send, or refuses the one it
    sends (exit 2: a setting to fix, not worth waiting out)."""


def password_refusal(url: str, exc: BaseException) -> RedisPasswordError | None:
    """The error to raise, naming TANDEM_REDIS_PASSWORD, when `exc` is a Redis refusing this
    client's password (or asking for one); None for any other error."""
    if not isinstance(exc, redis.AuthenticationError):
        return None
    state = "is set to another password" if os.environ.get(PASSWORD_ENV) else "is not set"
    return RedisPasswordError(
        f"the Redis at {url} refuses this client ({exc}): it requires a password and "
        f"{PASSWORD_ENV} {state}; set {PASSWORD_ENV} to its password (its requirepass) in "
        "the environment"
    )
