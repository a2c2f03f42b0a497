"""What a patch may change, known without a tree, and whether a build from upstream's wheel can take it.

A build from upstream's published wheel applies the patch set to the wheel's files, which hold the
source tree's ``vllm/`` package as installed: its Python files are there as the tree has them, and
everything else (``csrc/``, the CMake files, ``setup.py``, the CUDA and C++ sources) went into the
compiled extensions or into no wheel at all. A patch that changes any of it needs the compile: it
touches **compiled sources**. What a patch may change is known from the patch alone:

- a diff: the files its diff names;
- an upstream PR: the files of its change (``pullrequest.files``: the fetched manifest, as the build
  context carries it);
- a rule: the globs its module declares in ``WRITES`` (the engine holds every edit of a rule to them).

``installed`` is the test, on a path or a glob: a ``.py`` file of the ``vllm/`` package and nothing
else. A build from the wheel checks the record of what it applied again (``require_installed``), so a
patch whose files were judged wrongly fails that build naming the file.
"""

from __future__ import annotations

import re

from sparkbuild.errors import PatchError
from sparkbuild.patch import diff, pullrequest, rules
from sparkbuild.patch.engine import Report
from sparkbuild.patch.meta import Patch

PACKAGE = "vllm/"
_WILD = re.compile(r"[*?\[]")


def changes(p: Patch) -> tuple[str, ...]:
    """The tree files (or, for a rule, the globs) ``p`` may change."""
    if p.rule is not None:
        return rules.load(p.rule).writes
    if p.pr is not None:
        return pullrequest.files(p.folder, p.pr)
    assert p.diff is not None, "meta.load_one gives every patch a diff, a rule or a PR"
    return diff.files_of(p.diff)


def installed(path: str) -> bool:
    """Whether ``path`` (a file or a glob) names only Python files of the ``vllm/`` package: files a
    wheel installs as they are in the tree. A glob qualifies when its last part ends in ``.py`` with
    no wildcard after the dot."""
    if not path.startswith(PACKAGE) or ".." in path.split("/"):
        return False
    name = path.rsplit("/", 1)[1]
    return name.endswith(".py") and not _WILD.search(name[name.rfind(".") :])


def compiled(p: Patch) -> tuple[str, ...]:
    """What ``p`` may change that is not an installed Python file: the reason it needs a source build."""
    return tuple(path for path in changes(p) if not installed(path))


def require_installed(report: Report) -> None:
    """Fail, naming the patch and the file, when a patch of ``report`` changes anything but the
    installed Python files of the ``vllm/`` package (a build from upstream's wheel, where the
    compiled extensions cannot take the change). Checked before anything is written."""
    wrong = [(r.patch, f) for r in report.results if r.status == "applies" for f in r.files if not installed(f)]
    if wrong:
        shown = "; ".join(f"{name} changes {path}" for name, path in wrong)
        raise PatchError(
            f"a build from upstream's wheel takes changes to the vllm/ package's Python files only, and {shown}: "
            "the wheel's compiled extensions cannot take it. Nothing was written; build this target from source "
            "(vllm_from: source or auto)"
        )
