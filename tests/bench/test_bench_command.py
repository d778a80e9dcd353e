"""The CLI's checks: a load generator refuses to load someone else's server by default."""

from __future__ import annotations

import pytest

from triollm.bench.command import check_url, int_list, rate_list
from triollm.errors import UserError


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000"]
)
def test_a_loopback_url_needs_no_flag(url: str) -> None:
    assert check_url(url, allow_remote=False) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.7:8000", "https://api.example.com"])
def test_a_remote_url_is_refused_without_allow_remote_and_accepted_with_it(url: str) -> None:
    with pytest.raises(UserError, match="--allow-remote"):
        check_url(url, allow_remote=False)
    assert check_url(url, allow_remote=True) == url


def test_a_url_that_is_not_http_names_the_flag() -> None:
    with pytest.raises(UserError, match="--url: expected http://HOST:PORT"):
        check_url("127.0.0.1:8000", allow_remote=False)


@pytest.mark.parametrize(
    ("flag", "text", "message"),
    [
        ("--concurrency", "1,x", "expected a list"),
        ("--concurrency", "0,4", "every value must be >= 1"),
        ("--rate", "-1", "every rate must be > 0"),
    ],
)
def test_bad_level_lists_name_the_flag(flag: str, text: str, message: str) -> None:
    with pytest.raises(UserError, match=f"{flag}: {message}"):
        (int_list if flag == "--concurrency" else rate_list)(text, flag)
