"""The image's build provenance: an in-toto Statement v1 with a SLSA v1 provenance predicate.

Written out as the documented JSON (https://slsa.dev/spec/v1.0/provenance): the schema is small,
and the Python bindings for it (``in-toto-attestation``) are protobuf classes that would add a
protobuf runtime for one dict. What runs where (the runner, sparkbuild's own commit) is read by
``builder_identity``; the statement itself is made by pure functions from the plan.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparkbuild import __version__
from sparkbuild.plan import base_recipe, plan
from sparkbuild.util import cmd, log

MEDIA_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
# A URN: sparkbuild has no site of its own to name the build type by.
BUILD_TYPE = "urn:sparkbuild:buildtype:target:v1"


@dataclass(frozen=True, kw_only=True)
class Builder:
    """Who built it: the CI run (or this host) and sparkbuild's version and commit."""

    id: str
    version: str
    commit: str | None
    invocation: str | None


@dataclass(frozen=True, kw_only=True)
class Files:
    """The matrix and lock file the plan was made from (the lock may be absent)."""

    matrix: Path
    lock: Path | None


def builder_identity(env: Mapping[str, str] | None = None) -> Builder:
    """The GitHub Actions run (``$GITHUB_SERVER_URL/$GITHUB_REPOSITORY/actions/runs/$GITHUB_RUN_ID``)
    where there is one, else this host; sparkbuild's commit from ``GITHUB_SHA`` or its own checkout."""
    env = os.environ if env is None else env
    run = [env.get(k) for k in ("GITHUB_SERVER_URL", "GITHUB_REPOSITORY", "GITHUB_RUN_ID")]
    runner = f"{run[0]}/{run[1]}/actions/runs/{run[2]}" if all(run) else f"sparkbuild://{socket.gethostname()}"
    attempt = env.get("GITHUB_RUN_ATTEMPT")
    invocation = f"{runner}/attempts/{attempt}" if all(run) and attempt else None
    return Builder(id=runner, version=__version__, commit=env.get("GITHUB_SHA") or _own_commit(), invocation=invocation)


def _own_commit() -> str | None:
    """sparkbuild's commit where it runs from a git checkout (an installed wheel has none)."""
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / ".git").exists():
        return None
    args = ["git", "-C", str(checkout), "rev-parse", "HEAD"]
    log.info(cmd.show(args))
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def statement(
    p: plan.TargetPlan,
    *,
    image: str,
    digest: str,
    files: Files,
    builder: Builder,
    started: datetime | None = None,
    finished: datetime | None = None,
) -> dict[str, Any]:
    """The in-toto statement for the image ``image`` (``host/repository``) at ``digest``."""
    algorithm, _, value = digest.partition(":")
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": image, "digest": {algorithm: value}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": external_parameters(p, files),
                "internalParameters": {
                    "buildArgs": p.build_args(),
                    "archList": p.target.arch_list,
                    "platform": p.target.platform,
                    "profile": p.target.profile,
                    "contentHash": p.content_hash,
                },
                "resolvedDependencies": resolved_dependencies(p, files),
            },
            "runDetails": run_details(builder, started, finished),
        },
    }


def external_parameters(p: plan.TargetPlan, files: Files) -> dict[str, Any]:
    lock = files.lock if files.lock is not None and files.lock.is_file() else None
    return {
        "target": p.id,
        "matrix": {"path": files.matrix.name, "sha256": file_digest(files.matrix)},
        "lock": None if lock is None else {"path": lock.name, "sha256": file_digest(lock)},
    }


def resolved_dependencies(p: plan.TargetPlan, files: Files) -> list[dict[str, Any]]:
    """Every material: each source at its commit, upstream's vLLM wheel by its URL and sha256 (a build
    from the wheel), each base image by digest (or by recipe for a base sparkbuild makes), each
    patch's hash, the matrix and the lock file."""
    found: list[dict[str, Any]] = [
        {"uri": f"git+{repo}", "name": name, "digest": {"gitCommit": commit}} for name, repo, commit in sources(p.inputs)
    ]
    wheel = p.choice.wheel if p.choice is not None and p.choice.mode == "wheel" else None
    if wheel is not None and wheel.url and wheel.sha256:
        found.append({"uri": wheel.url, "name": f"vllm-wheel:{wheel.filename}", "digest": {"sha256": wheel.sha256}})
    for role, base in plan.bases(p.target).items():
        ref, identity = base_recipe.reference(base, p.target.platform)
        kind, _, value = identity.partition(":")
        digest = {"sha256": value} if kind == "sha256" else {"sparkbuildRecipe": identity}
        found.append({"uri": f"oci://{ref.rsplit('@', 1)[0]}", "name": f"base:{role}", "digest": digest})
    found += [{"name": f"patch:{name}", "digest": {"sha256": h}} for name, h in p.inputs["patches"].items()]
    found.append({"uri": f"file:{files.matrix.name}", "name": "matrix", "digest": {"sha256": file_digest(files.matrix)}})
    if files.lock is not None and files.lock.is_file():
        found.append({"uri": f"file:{files.lock.name}", "name": "lock", "digest": {"sha256": file_digest(files.lock)}})
    return found


def run_details(builder: Builder, started: datetime | None, finished: datetime | None) -> dict[str, Any]:
    version = {"sparkbuild": builder.version, **({"commit": builder.commit} if builder.commit else {})}
    metadata = {
        key: value
        for key, value in (
            ("invocationId", builder.invocation),
            ("startedOn", _time(started)),
            ("finishedOn", _time(finished)),
        )
        if value is not None
    }
    return {"builder": {"id": builder.id, "version": version}, "metadata": metadata}


def _time(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def materials(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The resolved dependencies of a statement (what ``inspect`` lists)."""
    definition = (document.get("predicate") or {}).get("buildDefinition") or {}
    return list(definition.get("resolvedDependencies") or ())


SOURCE_INPUTS = ("vllm", "candidate", "triton", "flashinfer", "cutlass")


def sources(inputs: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(name, repository URL, commit) of every component built from source, from a plan's inputs
    (the manifest in the image): vLLM, its candidate, Triton, FlashInfer, CUTLASS and vLLM's
    external projects. The SBOM lists the same. (A build from upstream's wheel has no vLLM commit,
    CUTLASS or external project in its inputs: its vLLM material is the wheel.)"""
    found = []
    for name in SOURCE_INPUTS:
        source = inputs.get(name) or {}
        if source.get("commit") and source.get("repo"):
            found.append((name, str(source["repo"]), str(source["commit"])))
    for external in inputs.get("externals") or ():
        if external.get("commit") and external.get("repo"):
            found.append((str(external["name"]), str(external["repo"]), str(external["commit"])))
    return found
