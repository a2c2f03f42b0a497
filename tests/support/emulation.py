"""linux/arm64 (the DGX Spark's platform) for the tests that need it: natively on an aarch64 host;
on x86_64, made runnable once per session by ``scripts/emulation`` (QEMU from the distribution,
registered with binfmt_misc's F flag). Where that is refused (not root, binfmt_misc read-only, no
QEMU in the archive), every such test skips with the script's own reason: never a failure, never
a silent pass."""

from __future__ import annotations

import pytest

from sparkbuild.util import host
from tests.support import setup_script, workers

ARM64 = "linux/arm64"


def _ready() -> tuple[bool, str]:
    """Run ``scripts/emulation``, then ask the same question ``doctor`` asks."""
    if host.host_platform() != ARM64:
        ran, said = setup_script("emulation")
        if not ran:
            return False, f"linux/arm64 cannot run on this host: {said}"
    return host.can_run(ARM64)


@pytest.fixture(scope="session")
def arm64() -> str:
    """The platform ``linux/arm64``, runnable here (natively or emulated), or the test skips saying why.
    Session-scoped: the script runs once, and pytest keeps a skip for every later test that asks."""
    # Once a session: the other worker must not register the handler again under a build of its own.
    runs, how = workers.once("arm64", lambda: list(_ready()))
    if not runs:
        pytest.skip(how)
    return ARM64
