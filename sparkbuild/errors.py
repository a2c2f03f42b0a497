"""Typed failures, each with its own exit code; caught once in ``cli.main``.

A message says what went wrong and what to do next; no traceback reaches the user. ``EXIT_CODES``
is the one table of exit codes: the documentation's table (docs/commands.md) is held to it by a test.
"""

from __future__ import annotations

from typing import Any, ClassVar

OK = 0
# A bug in sparkbuild, not in its input: the only case that prints a traceback.
INTERNAL = 70
# Ctrl-C or SIGTERM (128 + SIGINT, as shells report it).
INTERRUPTED = 130


class FatalError(Exception):
    """Base of every failure sparkbuild reports to the user. Never raised itself: each subclass
    has its own exit code and a line in ``EXIT_CODES``."""

    exit_code: ClassVar[int]
    meaning: ClassVar[str]


class ConfigError(FatalError):
    """The matrix or an option is invalid (file, line and key in the message)."""

    exit_code = 2
    meaning = "invalid input: matrix, lock file, patch folder, option or environment variable (file, line and key named)"


class ToolMissingError(FatalError):
    """A program or Python package sparkbuild needs is not installed."""

    exit_code = 3
    meaning = "a program or Python package sparkbuild needs is not installed"


class EngineError(FatalError):
    """The container engine, or a node of a cluster, is unreachable, refused an operation or lacks what serving needs."""

    exit_code = 4
    meaning = (
        "the container engine, or a node of a cluster (run --node, doctor --node), is unreachable, refused an "
        "operation or lacks what serving needs"
    )


class BuildError(FatalError):
    """An image or one of its inputs (base image, model) could not be built."""

    exit_code = 5
    meaning = "an image or one of its inputs (base image, check model) could not be built"


class VerifyError(FatalError):
    """The image's server did not start or gave a wrong answer. ``request``: the request that failed
    and what came back, where one did (verify keeps it as evidence)."""

    exit_code = 6
    meaning = (
        "the image's server did not start or answered wrong, or publish found no passing verify result "
        "tied to the image (its ID, its server's vLLM version and log)"
    )

    def __init__(self, message: str, *, request: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.request = request


class PublishError(FatalError):
    """The registry did not accept the image or returned another digest."""

    exit_code = 7
    meaning = (
        "the registry refused a call, kept failing past the retry limits, a push stalled past its deadline, "
        "or a signature could not be made or checked"
    )

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        # The registry kept failing past the retries (HTTP 5xx, 429, a broken connection): unlike a
        # refusal or a 404 for one object, nothing it holds can be told apart from what it failed to send.
        self.unreachable = unreachable


class LaneFailed(FatalError):
    """A lane (nightly, rc) ended with failed targets, or ``sparkbuild summary`` merged a failed or missing
    one; the summary says which and why."""

    exit_code = 8
    meaning = "a lane (nightly, rc), or a fanned-out lane's merged summary, has failed targets; the summary says which and why"


class PatchError(FatalError):
    """A patch conflicts with the source tree; the tree is left untouched."""

    exit_code = 9
    meaning = "a patch conflicts with the source tree (the tree is left untouched)"


class SourceError(FatalError):
    """An upstream source could not be fetched, or its checksum did not match."""

    exit_code = 10
    meaning = "an upstream source could not be fetched, or its checksum did not match"


class BinaryCheckError(FatalError):
    """A CUDA object or library has no GPU code that can run on the asked arch."""

    exit_code = 11
    meaning = "a CUDA object or library has no code that runs on the asked arch, or could not be read"


class RegistryUnavailableError(FatalError):
    """The configured registry does not answer its ping (``GET /v2/``)."""

    exit_code = 12
    meaning = "the registry named by --registry or SPARKBUILD_REGISTRY does not answer"


class RunLockBusy(FatalError):
    """Another run holds this cache's run lock and ``--no-wait`` was given."""

    exit_code = 13
    meaning = "another run holds this cache's run lock and --no-wait was given (the holder is named)"


class DiskSpaceError(FatalError):
    """Too little free disk for what the run will write, found before any work."""

    exit_code = 14
    meaning = "too little free disk for the run (Docker's data root, the cache or the registry storage), found before any work"


class NotReproducible(FatalError):
    """Two builds of a target without cache differ (``sparkbuild reproduce``)."""

    exit_code = 15
    meaning = "two builds of a target without cache differ (reproduce.json names every difference and its cause)"


ERRORS: tuple[type[FatalError], ...] = (
    ConfigError,
    ToolMissingError,
    EngineError,
    BuildError,
    VerifyError,
    PublishError,
    LaneFailed,
    PatchError,
    SourceError,
    BinaryCheckError,
    RegistryUnavailableError,
    RunLockBusy,
    DiskSpaceError,
    NotReproducible,
)

EXIT_CODES: dict[int, str] = {
    OK: "success",
    **{error.exit_code: error.meaning for error in ERRORS},
    INTERNAL: "a bug in sparkbuild: the traceback is printed; please report it",
    INTERRUPTED: "interrupted (Ctrl-C or SIGTERM); containers and the embedded registry are stopped first",
}
