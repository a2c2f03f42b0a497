"""Pushing an image from the engine to a registry: the daemon's push, made again whole when the
daemon gives up, within the registry's push limits (``defaults.yaml`` ``registry:``).

Stage images (build), cache images (build) and published images (publish) all go this way. The
engine keeps no name in the registry after a push or a pull (``push_as``, ``pull_as``): such a name
would hold an image's layers on the engine's disk after its own tag moved on, a run at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import tenacity

from sparkbuild.errors import PublishError
from sparkbuild.oci.engine import Engine, PushFailed, PushStalled
from sparkbuild.oci.registry import Registry
from sparkbuild.util import log


def push_image(engine: Engine, registry: Registry, repository: str, tag: str) -> str:
    """``engine.push`` of ``repository:tag`` (a name in ``registry``), pushed again whole when the
    daemon gives up (it retries each layer itself first), within the push deadline."""
    limits = registry.limits
    deadline = time.monotonic() + limits.push_deadline_s
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(limits.push_attempts),
        wait=tenacity.wait_random_exponential(multiplier=limits.backoff_initial_s, max=limits.backoff_max_s),
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, PushFailed) and not isinstance(e, PushStalled)),
        before_sleep=lambda state: log.warning(
            f"{state.outcome.exception() if state.outcome else ''}; pushing again "
            f"(try {state.attempt_number + 1} of {limits.push_attempts})"
        ),
        reraise=True,
    )
    try:
        for attempt in retrying:
            with attempt:
                return engine.push(repository, tag, stall_s=limits.push_stall_s, deadline=deadline)
    except PushStalled as exc:
        raise PublishError(
            f"{exc} (push_stall_s {limits.push_stall_s:g}, push_deadline_s {limits.push_deadline_s:g}); nothing was "
            f"tagged. The engine may keep the stalled upload open until {registry.host} drops it; check that registry "
            "(its disk, a proxy in front of it), then rerun"
        ) from None
    except PushFailed as exc:
        raise PublishError(
            f"{exc} ({limits.push_attempts} tries); nothing was tagged; rerun when {registry.host} is healthy"
        ) from None
    raise AssertionError("tenacity ends with a result or an exception")


@contextmanager
def named(engine: Engine, local: str, repository: str, tag: str) -> Iterator[str]:
    """The engine's ``local`` image also named ``repository:tag`` (a name in a registry) while the
    block runs: removed after it, with the digest name a push gives the image in that repository."""
    remote = f"{repository}:{tag}"
    if remote == local:
        yield remote
        return
    engine.tag(local, repository, tag)
    try:
        yield remote
    finally:
        engine.remove_image(remote)


def push_as(engine: Engine, registry: Registry, local: str, repository: str, tag: str) -> str:
    """Push the engine's ``local`` image as ``repository:tag`` (a name in ``registry``); returns the
    digest pushed. The name is made for the push and removed after it: ``local`` holds the image."""
    with named(engine, local, repository, tag):
        return push_image(engine, registry, repository, tag)


def pull_as(engine: Engine, registry: Registry, repository: str, tag: str, platform: str) -> None:
    """Pull ``repository:tag`` from ``registry`` into the engine under that name alone, without the registry's."""
    remote = f"{registry.host}/{repository}"
    engine.pull(remote, tag, platform)
    engine.tag(f"{remote}:{tag}", repository, tag)
    engine.remove_image(f"{remote}:{tag}")
