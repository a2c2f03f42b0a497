"""Typed failures, each with its own exit code; caught once in ``cli.main``.

A message says what went wrong and what to do next; no traceback reaches the user.
"""

from __future__ import annotations


class FatalError(Exception):
    """Base of every failure sparkbuild reports to the user."""

    exit_code = 1


class ConfigError(FatalError):
    """The matrix or an option is invalid (file, line and key in the message)."""

    exit_code = 2


class ToolMissingError(FatalError):
    """A program or Python package sparkbuild needs is not installed."""

    exit_code = 3


class EngineError(FatalError):
    """The container engine is unreachable or refused an operation."""

    exit_code = 4


class BuildError(FatalError):
    """An image or one of its inputs (base image, model) could not be built."""

    exit_code = 5


class VerifyError(FatalError):
    """The image's server did not start or gave a wrong answer."""

    exit_code = 6


class PublishError(FatalError):
    """The registry did not accept the image or returned another digest."""

    exit_code = 7


class PatchError(FatalError):
    """A patch conflicts with the source tree, or a patch folder is broken; the tree is left untouched."""

    exit_code = 9


class SourceError(FatalError):
    """An upstream source could not be fetched, or its checksum did not match."""

    exit_code = 10


class BinaryCheckError(FatalError):
    """A CUDA object or library has no GPU code that can run on the asked arch."""

    exit_code = 11
