"""StateConfig validation and secrecy."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from agenticstate import ConfigurationError, StateConfig, StateManager, open_backend
from agenticstate.config import redact_url


def test_seed_forms_are_accepted() -> None:
    """The seed page's three configurations validate."""
    assert StateConfig(backend="memory", auto_save=True, save_interval=30).save_interval == 30
    assert StateConfig(backend="file", file_path="./state/app_state.json", auto_save=True)
    config = StateConfig(
        backend="redis", redis_url="redis://localhost:6379", key_prefix="agenticai:", ttl=3600
    )
    assert config.ttl == timedelta(hours=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backend": "mongodb"},
        {"ttl": 0},
        {"ttl": -5},
        {"ttl": "soon"},
        {"save_interval": 0},
        {"max_value_size": 0},
        {"subscriber_buffer": 0},
        {"unknown_option": 1},
        {"format": "yaml"},
    ],
)
def test_invalid_config_raises_configuration_error(kwargs: dict[str, Any]) -> None:
    """Invalid options raise ConfigurationError (a ValueError) naming the field."""
    with pytest.raises(ConfigurationError) as caught:
        StateConfig(**kwargs)
    assert isinstance(caught.value, ValueError)
    assert next(iter(kwargs)) in str(caught.value)


def test_password_never_appears_in_repr_or_errors() -> None:
    """The Redis password is redacted in reprs, and absent from validation errors."""
    config = StateConfig(backend="redis", redis_url="redis://user:hunter2@db:6379/0")
    assert "hunter2" not in repr(config)
    assert "hunter2" not in str(config)
    assert "user:***@db:6379" in repr(config)
    with pytest.raises(ConfigurationError) as caught:
        StateConfig(backend="redis", redis_url="redis://user:hunter2@db:6379/0", ttl="x")
    assert "hunter2" not in str(caught.value)


def test_redact_url() -> None:
    """redact_url hides passwords and leaves other URLs alone."""
    assert redact_url("redis://:pw@h:1/2") == "redis://:***@h:1/2"
    assert redact_url("redis://h:1") == "redis://h:1"


@pytest.mark.parametrize("url", ["nope", "ftp://x", "", "mongodb://db"])
def test_open_backend_rejects_unknown_urls(url: str) -> None:
    """Unknown schemes and malformed URLs raise ConfigurationError."""
    with pytest.raises(ConfigurationError):
        open_backend(url)


def test_state_manager_rejects_non_config() -> None:
    """Passing something other than a StateConfig is a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        StateManager(config={"backend": "memory"})  # type: ignore[arg-type]


async def test_closed_manager_refuses_calls() -> None:
    """A closed manager raises a BackendError instead of reopening silently."""
    from agenticstate import BackendError

    state = StateManager()
    await state.save("k", 1)
    await state.aclose()
    await state.aclose()
    with pytest.raises(BackendError):
        await state.get("k")


def test_redis_urls_keep_their_form() -> None:
    """from_url keeps unix:///path intact and takes key_prefix from the query string."""
    from agenticstate import RedisBackend

    plain = RedisBackend.from_url("unix:///tmp/redis.sock")
    assert (plain.url, plain.key_prefix) == ("unix:///tmp/redis.sock", "")
    prefixed = RedisBackend.from_url("unix:///tmp/redis.sock?key_prefix=app:&db=2")
    assert (prefixed.url, prefixed.key_prefix) == ("unix:///tmp/redis.sock?db=2", "app:")
    tcp = open_backend("redis://:pw@127.0.0.1:6380/1", key_prefix="t:")
    assert isinstance(tcp, RedisBackend)
    assert tcp.key_prefix == "t:"
    assert "pw" not in repr(tcp)
