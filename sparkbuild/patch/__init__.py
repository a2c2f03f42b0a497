"""The patch stage: what each folder of ``patches/`` does to a source tree, and applying the set.

A patch is ``patches/<name>/patch.yaml`` (what it fixes, why, for which component and versions, how
to tell it is already upstream) plus its change: ``change.diff`` (applied with ``git apply``, 3-way
when the tree is a git checkout) or a rule, one module of ``sparkbuild.patch.rules`` per rule, with
the upstream code it splices in kept as fragments in the patch's folder.

Every patch gets one status per tree: ``applies``, ``applied`` (sparkbuild's own change is already
there), ``upstream`` (vLLM has the fix), ``not-applicable`` (outside its versions, another component,
or nothing to change in this layout) or ``conflict`` (with the file and what failed).

The package is the patch engine a container's source stage runs (``python3 -m sparkbuild.patch``):
it and what it imports need only the standard library, PyYAML, packaging and git (``bundle``
derives that set). ``cli`` and ``releases`` are for people and CI, and import more.
"""

from sparkbuild.patch.engine import RECORD, Report, Result, apply, check, table
from sparkbuild.patch.meta import Detect, Patch, default_dirs, digest, folders, load, load_one, unique
from sparkbuild.patch.overlay import STATUSES, Edit, Outcome, Overlay, Status

__all__ = [
    "RECORD",
    "STATUSES",
    "Detect",
    "Edit",
    "Outcome",
    "Overlay",
    "Patch",
    "Report",
    "Result",
    "Status",
    "apply",
    "check",
    "default_dirs",
    "digest",
    "folders",
    "load",
    "load_one",
    "table",
    "unique",
]
