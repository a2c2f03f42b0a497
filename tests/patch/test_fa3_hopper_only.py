"""fa3-hopper-only on every release: vLLM's setup.py lists the FA3 extension only for a 9.x arch list.

The proof runs the release's own statements, not a text match: the ``if`` chain of setup.py that
holds ``ext_modules.append(CMakeExtension(name="vllm.vllm_flash_attn._vllm_fa3_C"))`` is executed
as the release has it (its outer conditions taken as true: CUDA, nvcc 12.3 or newer), with the
arch list the build sets. Unpatched, a 12.1a list still gets FA3 (the failure: ~190 units compiled
for no GPU of the list); patched, 12.1a gets none and a list with 9.0a, or none at all (torch then
picks the visible GPU), still gets it. The rehearsal shows the compile's side (ninja's closure of
setup.py's targets: tests/lanes/test_rehearsal.py) and an image without FA3 starting on a GB10.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from sparkbuild import patch
from sparkbuild.patch import need
from sparkbuild.patch.overlay import Overlay, RuleConflict
from sparkbuild.patch.rules import fa3_hopper_only as rule
from tests.support.trees import PATCHES, RELEASES, TreeFactory


class Extension:
    def __init__(self, name: str, optional: bool = False) -> None:
        self.name = name


def listed(text: str, arch_list: str | None) -> list[str]:
    """The extensions the FA3 statement's ``if`` chain appends, run as the release wrote it with its
    outer tests replaced by True and ``arch_list`` as TORCH_CUDA_ARCH_LIST (unset for None)."""
    module = ast.parse(text)
    found = rule.fa3_statement(module)
    assert found is not None
    statement, guards = found
    body: list[ast.stmt] = [statement]
    for g in reversed(guards):
        inner = ast.If(test=g.test, body=body, orelse=[])
        if rule.ARCH_VARIABLE not in ast.unparse(g.test):
            inner.test = ast.Constant(True)  # CUDA, nvcc >= 12.3: the outer conditions the build meets
        body = [inner]
    code = compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), "<setup.py>", "exec")
    env = {} if arch_list is None else {rule.ARCH_VARIABLE: arch_list}
    fake_os = type("os", (), {"environ": env})
    scope: dict[str, Any] = {"ext_modules": [], "CMakeExtension": Extension, "os": fake_os}
    exec(code, scope)  # the release's own statement, from its sdist
    return [e.name for e in scope["ext_modules"]]


@pytest.mark.parametrize("version", RELEASES)
def test_setup_py_lists_fa3_only_for_a_hopper_arch_list_once_patched(version: str, pristine: TreeFactory, tmp_path: Path) -> None:
    text = (pristine(version) / rule.SETUP).read_text(encoding="utf-8")
    assert listed(text, "12.1a") == [rule.EXTENSION], "unpatched, a 12.1a build lists FA3"
    outcome = rule.run(Overlay(pristine(version)), tmp_path)
    assert outcome.status == "applies", outcome.detail
    (edit,) = outcome.edits
    patched = edit.after
    assert listed(patched, "12.1a") == [] and listed(patched, "12.0f;12.1a") == []
    assert listed(patched, "9.0a;12.1a") == [rule.EXTENSION] and listed(patched, "9.0 10.0") == [rule.EXTENSION]
    assert listed(patched, None) == [rule.EXTENSION]
    # Only that statement moved: the rest of setup.py is the release's, line for line.
    removed = [line for line in text.splitlines() if line not in patched.splitlines()]
    assert all("_vllm_fa3_C" in line or line.strip().startswith(("ext_modules.append(", "CMakeExtension(")) for line in removed)
    assert rule._judge(patched).status == "applied"


def test_status_by_content() -> None:
    text = "import os\nif x:\n    ext_modules.append(CMakeExtension(name='vllm.vllm_flash_attn._vllm_fa3_C'))\n"
    assert rule._judge(text).status == "applies"
    upstream = text.replace("if x:", 'if "9.0" in os.environ.get("TORCH_CUDA_ARCH_LIST", ""):')
    assert rule._judge(upstream).status == "upstream"
    assert rule._judge(text + f"# {rule.MARKER}\n").status == "conflict"
    assert rule._judge("import os\next_modules = []\n").status == "not-applicable"
    with pytest.raises(RuleConflict, match="does not `import os`"):
        rule._judge(text.replace("import os\n", ""))


def test_needed_for_a_list_without_9x_from_nvcc_12_3(pristine: TreeFactory) -> None:
    (p,) = patch.load(PATCHES, ("fa3-hopper-only",))
    tree = pristine("0.33.0")
    for cuda, arch_list, needed in (
        ("13.0", "12.1a", True),
        ("12.9", "12.1a", True),
        ("13.0", "9.0a;12.1a", False),
        ("12.2", "12.1a", False),
    ):
        assert need.judge(p, "applies", "", tree, need.Build(cuda, arch_list)).needed is needed, (cuda, arch_list)
