"""Store URLs, read strictly: nothing in a URL is dropped without a word.

`urllib.parse` drops what a store URL should never hold: a fragment (`sqlite://data/run#1.db`
opens `data/run`) and a query item without `=` (`?feed`). Two URLs that differ only there would
open the same store. `check_url` refuses both, a parameter with no name or no value (dropped
too), and a parameter given twice; `url_query` also refuses parameters a backend does not know.
`check_url` lives in `agenticstate.config`, below the backends, so that `StateConfig` checks a
Redis URL with it too (`check_redis_url`).
A `#` or `?` that belongs to a path or a password is written percent-encoded (`%23`, `%3F`), as
in any URL.

Errors never echo the URL: it may hold a password.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from agenticstate.config import check_url
from agenticstate.exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Collection

__all__ = ["check_url", "url_query"]


def url_query(url: str, known: Collection[str]) -> list[tuple[str, str]]:
    """The parameters of a store URL (`check_url` first), each one of `known`.

    Raises:
        ConfigurationError: The URL is malformed (see `check_url`) or has an unknown parameter.
    """
    check_url(url)
    params = parse_qsl(urlsplit(url).query, keep_blank_values=True)
    for name, _ in params:
        if name not in known:
            scheme = url.partition("://")[0]
            listed = ", ".join(sorted(known)) or "none"
            raise ConfigurationError(
                f"unknown {scheme}:// URL parameter {name!r} (known: {listed})"
            )
    return params
