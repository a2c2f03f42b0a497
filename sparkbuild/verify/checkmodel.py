"""The model folder a check serves: a recipe sparkbuild makes (``sparkbuild.models.model``), a folder given
in the matrix, or a real model from the Hugging Face Hub downloaded on the runner.

A hub model goes to ``<cache>/hub/<id>/<revision>`` as real files (huggingface_hub's ``local_dir``
download, so a runner's cache volume keeps it between nightlies, and offline it is used as it is) and
is mounted read-only into the server like any check model. Not its cache layout: there each file of a
snapshot is a link to a blob two folders up, which a container mounting the snapshot cannot follow
(vLLM would find no config.json). A folder given in the matrix is refused with such links for that reason. The
token is ``HF_TOKEN`` from the environment, read by huggingface_hub itself: sparkbuild never passes
it on, prints it, or puts it in a layer, a label, a log or a summary.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from sparkbuild.config import options
from sparkbuild.errors import ConfigError, ToolMissingError, VerifyError
from sparkbuild.models import model
from sparkbuild.plan.matrix import Check, HubModel
from sparkbuild.util import fsutil, log


def provide(cache: Path, check: Check) -> Path:
    """The folder to serve for ``check``: made, found or downloaded."""
    if check.path is not None:
        if not (check.path / "config.json").is_file():
            raise ConfigError(f"check {check.name}: model path {check.path} has no config.json: give a model folder")
        if (link := link_out(check.path)) is not None:
            raise ConfigError(
                f"check {check.name}: {link} is a link to {link.resolve()}, outside the model folder: the server's container "
                "mounts the folder alone and cannot follow it (a snapshot in Hugging Face's cache is such a folder); "
                "give a folder of real files (huggingface-cli download ID --local-dir DIR), "
                "or the check as model: {hub: ID, revision: REV}"
            )
        return check.path
    if check.hub is not None:
        return download(cache, check.hub)
    return model.ensure(cache, check.model)


def link_out(folder: Path) -> Path | None:
    """The first file under ``folder`` that is a link to a place outside it, if any."""
    root = folder.resolve()
    for path in sorted(folder.rglob("*")):
        if fsutil.points_out(path, root):
            return path
    return None


def download(cache: Path, hub: HubModel) -> Path:
    """``hub`` at its revision, from the Hub (or the cache, where it is already whole)."""
    try:
        hf: Any = importlib.import_module("huggingface_hub")
    except ImportError:
        raise ToolMissingError("a check with a hub model needs huggingface_hub: pip install huggingface_hub") from None
    token = "with HF_TOKEN" if options.env("HF_TOKEN") else "without a token (set HF_TOKEN for a gated model)"
    local = cache / "hub" / hub.id / hub.revision
    with log.step(f"Fetching {hub.id} at {hub.revision} from the Hugging Face Hub into {local} ({token})"):
        try:
            # HF_ENDPOINT (a team's mirror of the Hub) as it is now, not as it was when the library loaded.
            endpoint = options.env("HF_ENDPOINT") or None
            # local_dir: real files, which a container mounting the folder reads (module docstring).
            folder = hf.snapshot_download(repo_id=hub.id, revision=hub.revision, local_dir=local, endpoint=endpoint)
        except (hf.errors.GatedRepoError, hf.errors.RepositoryNotFoundError, hf.errors.RevisionNotFoundError) as exc:
            what = f"{hub.id}@{hub.revision}: {_first_line(exc)}"
            raise VerifyError(f"{what}; check the id and revision, and HF_TOKEN for a gated model") from None
        except (hf.errors.LocalEntryNotFoundError, OSError) as exc:
            raise VerifyError(
                f"cannot reach the Hugging Face Hub for {hub.id}@{hub.revision} ({_first_line(exc)}), and the cache "
                f"{local} does not hold it: run where huggingface.co is reachable, or put the model in a folder "
                "and name it in the check as model: {path: DIR}"
            ) from None
    return Path(folder)


def _first_line(exc: BaseException) -> str:
    """The error's first line: huggingface_hub's messages run on with advice and URLs."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
