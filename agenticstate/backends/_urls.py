"""Store URLs, read strictly: nothing in a URL is dropped without a word.

`urllib.parse` drops what a store URL should never hold: a fragment (`sqlite://data/run#1.db`
opens `data/run`) and a query item without `=` (`?feed`). Two URLs that differ only there would
open the same store. `check_url` refuses both, a parameter with no name or no value (dropped
too), and a parameter given twice; `url_query` also refuses parameters a backend does not know.
A `#` or `?` that belongs to a path or a password is written percent-encoded (`%23`, `%3F`), as
in any URL.

Errors never echo the URL: it may hold a password.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from agenticstate.exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Collection

__all__ = ["check_url", "url_query"]


def check_url(url: str) -> None:
    """Refuse a store URL with a fragment, a query item without `=`, or a repeated parameter.

    Raises:
        ConfigurationError: Naming the part, and how to write a `#` or `?` it meant.
    """
    scheme = url.partition("://")[0]
    if "#" in url:
        raise ConfigurationError(
            f"a {scheme}:// URL cannot have a fragment ('#...'), which would be ignored: write a "
            "'#' that belongs to a path or a password as %23"
        )
    _, question_mark, query = url.partition("?")
    names: set[str] = set()
    for item in query.split("&") if question_mark else ():
        if "=" not in item:  # an empty one too: `path?`, `?a=1&&b=2`
            raise ConfigurationError(
                f"a {scheme}:// URL has a query item without '=', which would be ignored: give "
                "parameters as name=value, and write a '?' that belongs to a path or a password "
                "as %3F"
            )
        name, _, value = item.partition("=")
        if not name or not value:
            raise ConfigurationError(
                f"a {scheme}:// URL has a query parameter with no "
                f"{'name' if not name else 'value'}, which would be ignored: give parameters "
                "as name=value, and write a '?' that belongs to a path or a password as %3F"
            )
        name = parse_qsl(item, keep_blank_values=True)[0][0]
        if name in names:
            raise ConfigurationError(f"the {scheme}:// URL gives the parameter {name!r} twice")
        names.add(name)


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
