"""The making of a check model in a process of its own, with its arithmetic pinned (arithmetic.py).

``run`` starts ``python -m sparkbuild.models CACHE NAME RESULT`` with the pins in its environment (torch
reads ATEN_CPU_CAPABILITY, MKL reads MKL_CBWR once, when they load: a process that already imported torch
cannot take them) and turns the failure it reports back into the same typed error. ``require_pinned``
keeps a model made without the pins out of the cache; ``record`` writes what the folder holds into its
``sparkbuild-model.json``: its key, the arithmetic, and the digest of its files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from sparkbuild import errors
from sparkbuild.errors import BuildError, FatalError
from sparkbuild.models import arithmetic, training
from sparkbuild.models.arithmetic import Arithmetic
from sparkbuild.util import cmd

META = "sparkbuild-model.json"


def run(cache: Path, name: str, arith: Arithmetic) -> None:
    """Make ``name`` into ``cache`` in a child process with ``arith``'s pins; its failure raised here."""
    with tempfile.TemporaryDirectory(prefix="sparkbuild-making-") as tmp:
        result = Path(tmp) / "result.json"
        args = [sys.executable, "-m", "sparkbuild.models", str(cache), name, str(result)]
        done = cmd.run(args, env=dict(arith.pins), check=False)
        if done.returncode == 0:
            return
        reported = json.loads(result.read_text()) if result.is_file() else None
    if reported is None:
        raise BuildError(f"making model {name} ended with exit code {done.returncode} and no report; its output is above")
    raise _typed(reported["type"])(reported["message"])


def _typed(name: str) -> type[FatalError]:
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, FatalError) else BuildError


def report(result: Path, exc: FatalError) -> None:
    """The child's failure, for ``run`` to raise again as the same type."""
    result.write_text(json.dumps({"type": type(exc).__name__, "message": str(exc)}))


def pin_torch() -> None:
    """What the environment cannot pin: oneDNN off in this process (arithmetic.MKLDNN)."""
    torch, _ = training.libs()
    torch.backends.mkldnn.enabled = arithmetic.MKLDNN


def require_pinned(arith: Arithmetic, name: str) -> None:
    """Raise unless this process computed with ``arith``'s pins: its environment holds them and torch runs
    the pinned kernels. A model made otherwise would enter the cache under a key that says something else."""
    torch, _ = training.libs()
    unset = sorted(k for k, v in arith.pins.items() if os.environ.get(k) != v)
    if torch.backends.mkldnn.enabled != arithmetic.MKLDNN:
        unset.append("torch.backends.mkldnn.enabled")
    capability = torch.backends.cpu.get_cpu_capability()
    wanted = arithmetic.CAPABILITY[arith.machine]
    if unset or capability != wanted:
        raise BuildError(
            f"model {name} was made without its pinned arithmetic (not as pinned: {', '.join(unset) or 'none'}; "
            f"torch's kernels {capability}, pinned {wanted}), so it is not cached: make it with `sparkbuild model {name}`"
        )


def digest(folder: Path) -> str:
    """sha256 over the folder's files (name and content) but the model's own record: what the model is."""
    outer = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != META):
        outer.update(f"{path.name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return f"sha256:{outer.hexdigest()}"


def record(folder: Path, key: str, arith: Arithmetic) -> None:
    """Add the key, the arithmetic and the files' digest to the folder's record (written last by the maker)."""
    meta: dict[str, Any] = json.loads((folder / META).read_text())
    meta.update(key=key, arithmetic=arith.record(), digest=digest(folder))
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n")
    (folder / META).chmod(0o644)
