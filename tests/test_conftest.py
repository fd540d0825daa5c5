"""The suite's own harness (tests/conftest.py) where a mistake would hide or invent failures."""

from __future__ import annotations

import asyncio
import importlib

import pytest

from tests.conftest import GRPC_COMPLETION, LoopOfATest

# grpc.aio's extension module (no stubs)
cygrpc = importlib.import_module("grpc._cython.cygrpc")


async def test_coroutine_tests_and_asyncio_run_get_a_test_loop() -> None:
    assert isinstance(asyncio.get_running_loop(), LoopOfATest)

    async def which() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # Only where no loop runs (a test's own asyncio.run()): on a thread of its own here.
    assert isinstance(await asyncio.to_thread(asyncio.run, which()), LoopOfATest)


def test_a_closed_loop_drops_only_grpcs_late_completions() -> None:
    loop = LoopOfATest()
    loop.close()
    # The callback grpc.aio's completion queue hands to another loop is the one named.
    assert cygrpc._handle_callback_wrapper.__qualname__ == GRPC_COMPLETION
    assert loop.call_soon_threadsafe(cygrpc._handle_callback_wrapper, None, 1).cancelled()
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        loop.call_soon_threadsafe(print, "anything else still fails")
    running = LoopOfATest()
    try:
        got: list[int] = []
        running.call_soon_threadsafe(got.append, 1)
        running.run_until_complete(asyncio.sleep(0))
        assert got == [1]
    finally:
        running.close()
