"""check-binary's compatibility rule, code by code, and a kernel's verdict from all its code (the
rules and their sources are in sparkbuild/build/binaries.py). The same rules on real nvcc objects, libraries
and wheels: tests/build/test_check_binary.py."""

from __future__ import annotations

import pytest

from sparkbuild.build.binaries import Arch, Code, judge

GB10 = Arch.parse("12.1")  # the DGX Spark
RTX5090 = Arch.parse("12.0")
H100 = Arch.parse("9.0")


def code(label: str) -> Code:
    kind, _, number = label.partition("_")
    suffix = number[-1] if number[-1] in "af" else ""
    digits = number.removesuffix(suffix)
    return Code(kind="sass" if kind == "sm" else "ptx", arch=Arch(major=int(digits[:-1]), minor=int(digits[-1]), suffix=suffix))


@pytest.mark.parametrize(
    ("label", "on_gb10", "on_rtx5090", "on_h100"),
    [
        ("sm_121a", True, False, False),  # arch-specific: exactly 12.1
        ("sm_120a", False, True, False),  # arch-specific: exactly 12.0, not the rest of its family
        ("sm_120f", True, True, False),  # family: 12.0 and later 12.x
        ("sm_121f", True, False, False),
        ("sm_120", True, True, False),  # plain SASS: same major, minor not above
        ("sm_121", True, False, False),
        ("sm_90a", False, False, True),
        ("sm_90", False, False, True),  # SASS never crosses a major
        ("sm_100f", False, False, False),
        ("compute_80", True, True, True),  # plain PTX: JIT on any later GPU
        ("compute_120", True, True, False),
        ("compute_121", True, False, False),
        ("compute_120f", True, True, False),  # family PTX: within its family only
        ("compute_100f", False, False, False),
        ("compute_120a", False, True, False),  # arch-specific PTX: its own GPU only
        ("compute_121a", True, False, False),
    ],
)
def test_which_code_runs_on_which_gpu(label: str, on_gb10: bool, on_rtx5090: bool, on_h100: bool) -> None:
    c = code(label)
    assert c.label() == label
    assert (c.runs_on(GB10), c.runs_on(RTX5090), c.runs_on(H100)) == (on_gb10, on_rtx5090, on_h100)


@pytest.mark.parametrize(
    ("labels", "verdict"),
    [
        (["sm_121a", "sm_120a"], "sass"),
        (["sm_120f"], "sass"),
        (["sm_120a", "compute_80"], "ptx"),  # the cubin cannot run, the PTX is JIT-compiled
        (["sm_120a"], "fails"),  # code for the family, none that runs: the mixed-arch build
        (["compute_120a", "sm_90a"], "fails"),
        (["sm_90a", "sm_100f"], "other"),  # Hopper and Blackwell data-centre kernels
        (["sm_75"], "other"),
    ],
)
def test_a_kernel_is_judged_on_all_its_code(labels: list[str], verdict: str) -> None:
    assert judge([code(label) for label in labels], GB10) == verdict
