"""Render a target's stage Dockerfiles from ``dockerfiles/<profile>/`` with jinja2 (StrictUndefined).

A profile folder holds one template per stage, ``NN-<stage>.Dockerfile.j2``, built in file-name
order; the last stage is the image, the others are stage images that later stages use through
``{{ stage("name") }}`` (``COPY --from=`` or ``RUN --mount=...,from=``). A stage template that
renders no ``FROM`` is skipped (for example FlashInfer when the target does not build it).

An earlier stage enters a Dockerfile as ``FROM ${SPARKBUILD_STAGE_<NAME>} AS sparkbuild-stage-<name>``
with the global ``ARG``'s default set to its content-addressed reference. The docker driver finds that
in its image store; any other BuildKit builder (docker-container, remote) is given the
registry-qualified reference as a build argument: the Dockerfile, and so the stage's hash, stays
the same wherever the stages are shared.

``{{ file("name") }}`` puts a file of the profile folder, or a resource the plan provides (the
patch set, the patch engine), into that stage's build context. A stage's digest covers its
Dockerfile and exactly the files it asked for, so a stage changes only when what it uses does.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from sparkbuild.errors import ConfigError
from sparkbuild.util import fsutil

SUFFIX = ".Dockerfile.j2"
_NAME_RE = re.compile(r"^\d+-([a-z][a-z0-9-]*)\.Dockerfile\.j2$")
_FROM_RE = re.compile(r"^\s*FROM\s", re.MULTILINE)

# Context files: (path inside the build context, content), sorted by path.
Files = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, kw_only=True)
class Rendered:
    """One stage: its Dockerfile, the context files it uses and the earlier stages it reads."""

    name: str
    template: str
    dockerfile: str
    files: Files
    needs: tuple[str, ...]

    def digest(self) -> str:
        h = hashlib.sha256(self.dockerfile.encode())
        for name, content in self.files:
            h.update(f"\0{name}\0".encode())
            h.update(content)
        return h.hexdigest()


def profile_dir(folder: Path, profile: str) -> Path:
    """``folder`` (``project.profile_folder``'s answer) once it is known to hold stage templates."""
    if folder.is_dir():
        fsutil.files(folder)  # refuses symlinks out of the profile folder
    if not folder.is_dir() or not stage_templates(folder):
        raise ConfigError(f"{folder}: no stage templates (NN-<stage>{SUFFIX}) for profile '{profile}'")
    return folder


def stage_templates(folder: Path) -> list[tuple[str, Path]]:
    found = []
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        match = _NAME_RE.match(path.name)
        if match is None:
            raise ConfigError(f"{path}: a stage template is named NN-<stage>{SUFFIX}, with a lowercase stage name")
        found.append((match.group(1), path))
    return found


def render(
    folder: Path,
    profile: str,
    variables: Mapping[str, Any],
    *,
    stage_ref: Callable[[Rendered], str],
    resources: Mapping[str, Files] | None = None,
) -> tuple[Rendered, ...]:
    """Render every stage in order; ``stage_ref`` names the image of a rendered stage."""
    folder = profile_dir(folder, profile)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 - Dockerfiles, not HTML
    )
    done: list[Rendered] = []
    refs: dict[str, str] = {}
    for name, path in stage_templates(folder):
        stage = _render_one(env, folder, name, path, variables, refs, resources or {})
        if stage is None:
            continue
        done.append(stage)
        refs[name] = stage_ref(stage)
    if not done:
        raise ConfigError(f"{folder}: every stage template rendered no FROM for this target")
    return tuple(done)


def _render_one(
    env: jinja2.Environment,
    folder: Path,
    name: str,
    path: Path,
    variables: Mapping[str, Any],
    refs: Mapping[str, str],
    resources: Mapping[str, Files],
) -> Rendered | None:
    needs: list[str] = []
    files: dict[str, bytes] = {}

    def stage(other: str) -> str:
        if other not in refs:
            raise ConfigError(
                f"{path}: stage('{other}') is not an earlier stage of this target; rendered so far: {', '.join(refs)}"
            )
        needs.append(other)
        return stage_alias(other)

    def file(wanted: str) -> str:
        if wanted in resources:
            files.update(resources[wanted])
        elif (folder / wanted).is_file() and not wanted.endswith(SUFFIX):
            if not (folder / wanted).resolve().is_relative_to(folder.resolve()):
                raise ConfigError(f"{path}: file('{wanted}') is outside {folder} (a symlink or '..'); keep stage files in it")
            files[wanted] = (folder / wanted).read_bytes()
        else:
            known = sorted([*resources, *(p.name for p in folder.iterdir() if p.is_file() and not p.name.endswith(SUFFIX))])
            raise ConfigError(f"{path}: file('{wanted}') is neither in {folder} nor a plan resource; known: {', '.join(known)}")
        return wanted

    try:
        text = env.get_template(path.name).render(**variables, stage=stage, file=file)
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"{path}: {exc.message}; the plan gives: {', '.join(sorted(variables))}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{exc.filename or path}:{exc.lineno}: template syntax error: {exc.message}") from None
    if not _FROM_RE.search(text):
        return None
    needed = tuple(dict.fromkeys(needs))
    return Rendered(
        name=name,
        template=path.name,
        dockerfile=_stage_preamble(needed, refs) + text,
        files=tuple(sorted(files.items())),
        needs=needed,
    )


def stage_alias(name: str) -> str:
    return f"sparkbuild-stage-{name}"


def stage_arg(name: str) -> str:
    """The build argument that names an earlier stage's image (``SPARKBUILD_STAGE_VLLM``)."""
    return "SPARKBUILD_STAGE_" + name.upper().replace("-", "_")


def _stage_preamble(needs: tuple[str, ...], refs: Mapping[str, str]) -> str:
    if not needs:
        return ""
    lines = ["# Earlier stages by content-addressed reference; a build may pass registry-qualified ones."]
    lines += [f"ARG {stage_arg(n)}={refs[n]}" for n in needs]
    lines += [f"FROM ${{{stage_arg(n)}}} AS {stage_alias(n)}" for n in needs]
    return "\n".join(lines) + "\n"
