"""The DRA mode's socket names (dra/names.py): from its directories, driver and instance, hashed
where a path would be too long for a unix socket, the same for the same instance every time."""

from __future__ import annotations

import os

import pytest

from hyperlight_agent import contracts
from hyperlight_agent.dra import names

DRIVER = contracts.DRA_DRIVER


def test_long_paths_get_short_deterministic_names(tmp: str) -> None:
    long_instance = "x" * 90
    path = names.registration_socket(tmp, DRIVER, long_instance)
    assert len(os.fsencode(path)) <= contracts.UNIX_PATH_MAX
    assert path == names.registration_socket(tmp, DRIVER, long_instance)
    assert path != names.registration_socket(tmp, DRIVER, "y" * 90)
    service = names.service_socket(tmp, DRIVER, long_instance)
    assert len(os.fsencode(service)) <= contracts.UNIX_PATH_MAX and service.endswith(".sock")
    assert os.path.basename(names.service_socket(tmp, DRIVER, "a/b")) != "dra-a/b.sock"
    with pytest.raises(names.TooLong, match="too long"):
        names.registration_socket("/" + "d" * 120, DRIVER, "a")
