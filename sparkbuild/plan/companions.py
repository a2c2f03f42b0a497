"""A Spark target's FlashInfer and CUTLASS against the ones its vLLM names (issue 44, item 4).

vLLM pins FlashInfer in ``requirements/cuda.txt`` (``flashinfer-python==X``) and CUTLASS in its
``CMakeLists.txt`` (``CUTLASS_REVISION``). A target that builds other ones drifts from its vLLM: a
FlashInfer drift fails at ``pip check``, hours into the compile; a CUTLASS drift is never seen. So the
refs the matrix names are checked against what the vLLM commit names, before anything is planned
(resolve for release targets, the rc lane for its candidate); a mismatch is one error naming both.

Only a release tag is compared (``v0.7.2.post1``, ``v4.7.1``): a branch or a commit is the matrix's
deliberate choice of another tree, which its own ``resolve`` pins.

Pure: the caller reads the two files (``sparkbuild.upstream.externals``: ``flashinfer_requirement``,
``cutlass_revision``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sparkbuild.errors import ConfigError
from sparkbuild.plan.matrix import Target


@dataclass(frozen=True, kw_only=True)
class Named:
    """What a vLLM commit names: FlashInfer's version (``0.7.2.post1``) and CUTLASS's tag (``v4.7.1``);
    None where it names none."""

    vllm: str
    flashinfer: str | None
    cutlass: str | None


# A release tag: v4.7.1, v0.7.2.post1, 0.7.2 (not a branch, not a commit).
RELEASE_TAG = re.compile(r"^v?\d+\.\d+")


def mismatches(target: Target, named: Named) -> list[str]:
    """One line per component whose release tag differs from what vLLM names."""
    lines = []
    fi = target.flashinfer
    if fi is not None and named.flashinfer is not None and RELEASE_TAG.match(fi.ref) and fi.version != named.flashinfer:
        lines.append(
            f"flashinfer: the target builds {fi.ref}, vLLM {named.vllm} requires flashinfer-python=={named.flashinfer} "
            f"(requirements/cuda.txt): set flashinfer: {{ref: v{named.flashinfer}}}"
        )
    cutlass = target.cutlass
    if cutlass is not None and named.cutlass is not None and RELEASE_TAG.match(cutlass.ref) and cutlass.ref != named.cutlass:
        lines.append(
            f"cutlass: the target builds {cutlass.ref}, vLLM {named.vllm} asks for {named.cutlass} "
            f"(CMakeLists.txt's CUTLASS_REVISION): set cutlass: {{ref: {named.cutlass}}}"
        )
    return lines


def require(target: Target, named: Named) -> None:
    """Raise a ConfigError naming the target's matrix line and both sides of every mismatch."""
    if lines := mismatches(target, named):
        raise ConfigError("\n".join([f"{target.where}: {target.id}: not what its vLLM names:", *(f"  {x}" for x in lines)]))
