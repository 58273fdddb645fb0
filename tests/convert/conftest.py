"""The converter modules' commands: a module that declares ``COMMANDS = None`` gets, for its run, a client of one
server that imported the converters' stack once (``testing.preloaded``), in its own ``ENV``; its ``_run`` sends
``convert`` commands through it."""

from __future__ import annotations

import pytest

from nemo_factuality.testing.preloaded import CONVERTERS, PreloadedCommands


@pytest.fixture(scope="module", autouse=True)
def _preloaded_converter_commands(request):
    module = request.module
    if not hasattr(module, "COMMANDS"):
        yield
        return
    with PreloadedCommands(CONVERTERS, module.ENV) as module.COMMANDS:
        yield
    module.COMMANDS = None
