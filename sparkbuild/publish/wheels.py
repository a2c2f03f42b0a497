"""Wheels beside the image: what the build's stages made, attached to the published image.

A stage that makes wheels leaves them in ``/wheels`` of its stage image (the Spark profile's
flashinfer, triton and vllm stages; the runtime stage installs from there). At publish, every file
of those folders goes to the registry as one OCI artifact whose subject is the image: a layer per
file, named by it (``oras pull`` saves them as they are), and ``wheels.json``: each wheel's name,
version, sha256 (its layer's digest, what ``pip --require-hashes`` checks), its stage, and what it
was built for: the target's GPU, arch list, CUDA, torch and platform, and the arch list the vLLM
compile itself recorded. ``sparkbuild wheels IMAGE --out DIR`` fetches them into a folder that
``pip install --find-links DIR`` reads. The local profile builds no wheel (it installs vLLM's CPU
wheel from PyPI, whose hash its SBOM lists), so nothing is attached for it.

Which stage images hold no file in ``/wheels`` is kept in the cache by image ID (``EMPTY``): an
image ID names its content, so that answer holds for good, and a target whose stages leave no
wheel (the local profile's) does not create a container from each of them on every later run: a
nightly with nothing to build creates none.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from sparkbuild.errors import PublishError
from sparkbuild.oci import push, referrers
from sparkbuild.oci.registry import Registry, file_digest
from sparkbuild.plan.plan import STAGE_REPOSITORY, TargetPlan
from sparkbuild.util import fsutil, log

if TYPE_CHECKING:
    from sparkbuild.oci.engine import Engine
    from sparkbuild.plan.matrix import Target

KIND = "wheels"
ARTIFACT_TYPE = "application/vnd.sparkbuild.wheels.v1+json"
WHEEL_MEDIA_TYPE = "application/vnd.sparkbuild.python-wheel.v1+zip"
FOLDER = "/wheels"
INDEX = "wheels.json"
SUMS = "SHA256SUMS"
# Written by the Spark vLLM stage: the environment its compile ran with.
BUILD_ENV = "vllm-build-env.txt"
REQUIREMENTS = "vllm-requirements.txt"
ARCH_ANNOTATION = "io.sparkbuild.arch-list"
# Under the cache: an empty file named by the image ID of each stage image whose /wheels holds no file.
EMPTY = Path("wheels") / "empty"
# A file name that is safe to write into the --out folder as it is.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")


@dataclass(frozen=True, kw_only=True)
class BuiltFor:
    """The build marker: what the wheels were compiled for."""

    gpu: str
    arch_list: str
    cuda: str | None
    torch: str
    platform: str

    @classmethod
    def of(cls, target: Target) -> BuiltFor:
        return cls(gpu=target.gpu, arch_list=target.arch_list, cuda=target.cuda, torch=target.torch, platform=target.platform)

    def text(self) -> str:
        return f"{self.gpu} (arch list {self.arch_list}), CUDA {self.cuda or 'none'}, torch {self.torch}, {self.platform}"


@dataclass(frozen=True, kw_only=True)
class File:
    path: Path
    stage: str
    sha256: str
    size: int

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def is_wheel(self) -> bool:
        return self.name.endswith(".whl")

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"file": self.name, "stage": self.stage, "sha256": self.sha256, "size": self.size}
        if self.is_wheel:
            name, version, _, tags = parse_wheel_filename(self.name)
            entry.update(name=str(name), version=str(version), tags=sorted(str(t) for t in tags)[:3])
        return entry


@dataclass(frozen=True, kw_only=True)
class Collected:
    """What the stages left in /wheels, with the build marker."""

    files: tuple[File, ...]
    built_for: BuiltFor
    build_env: dict[str, str]

    @property
    def wheels(self) -> tuple[File, ...]:
        return tuple(f for f in self.files if f.is_wheel)

    def index(self) -> dict[str, Any]:
        return {
            "built_for": {**vars(self.built_for)},
            "vllm_build_env": self.build_env,
            "files": [f.to_json() for f in self.files],
        }


def collect(
    engine: Engine, stages: Sequence[tuple[str, str]], into: Path, built_for: BuiltFor, *, empty: Path | None = None
) -> Collected:
    """Copy ``/wheels`` out of each stage image (name, ref) that has one, into ``into``; check it.
    ``empty``: the folder that names the stage images known to hold no file there (``EMPTY``),
    which are not read again, and where each one read and found so is named."""
    files: dict[str, File] = {}
    for stage, ref in stages:
        known = None if empty is None else empty / str(engine.inspect(ref)["Id"]).replace(":", "-")
        if known is not None and known.is_file():
            continue
        folder = engine.copy_out(ref, FOLDER, into / stage, missing_ok=True)
        found = [] if folder is None else sorted(p for p in folder.iterdir() if p.is_file())
        if not found and known is not None:
            fsutil.write_text(known, "")
        for path in found:
            if path.name in files:
                raise PublishError(
                    f"{FOLDER}/{path.name} is in the stage images of both {files[path.name].stage} and {stage}: "
                    "rename one in its stage template, so each file published beside the image is one build's"
                )
            digest, size = file_digest(path)
            files[path.name] = File(path=path, stage=stage, sha256=digest, size=size)
    build_env = _build_env(files.get(BUILD_ENV))
    collected = Collected(files=tuple(files.values()), built_for=built_for, build_env=build_env)
    check(collected)
    return collected


def _build_env(found: File | None) -> dict[str, str]:
    if found is None:
        return {}
    return dict(word.split("=", 1) for word in found.path.read_text().split() if "=" in word)


def check(collected: Collected) -> None:
    """Refuse what must not be published as this target's: a wheel whose name pip rejects, or a
    vLLM compiled for another arch list than the target's (its wheel would not run on the GPU)."""
    for f in collected.wheels:
        try:
            parse_wheel_filename(f.name)
        except InvalidWheelFilename as exc:
            raise PublishError(f"{FOLDER}/{f.name} of stage {f.stage} is not a wheel name pip accepts ({exc})") from None
    compiled = collected.build_env.get("TORCH_CUDA_ARCH_LIST")
    wanted = collected.built_for.arch_list
    if compiled is not None and _arches(compiled) != _arches(wanted):
        raise PublishError(
            f"{BUILD_ENV}: vLLM was compiled with TORCH_CUDA_ARCH_LIST={compiled}, but the target's arch list is {wanted}: "
            "its wheel is not published as this target's; rebuild the vllm stage (its content hash should have changed)"
        )


def _arches(text: str) -> frozenset[str]:
    return frozenset(a for a in re.split(r"[;,\s]+", text) if a)


# --- at publish -------------------------------------------------------------------------------


def attach(registry: Registry, repository: str, subject: str, collected: Collected) -> referrers.Attached:
    """Upload each file (streamed) and the index, then attach them to ``subject`` as one artifact."""
    index = json.dumps(collected.index(), indent=2, sort_keys=True).encode()
    layers = [
        referrers.Layer(digest=registry.upload_blob(repository, index), size=len(index), media_type=ARTIFACT_TYPE, filename=INDEX)
    ]
    for f in collected.files:
        with log.step(f"Uploading {f.name} ({_size(f.size)}) to {registry.host}/{repository}"):
            digest, size = registry.upload_file(repository, f.path)
        layers.append(referrers.Layer(digest=digest, size=size, media_type=_media_type(f.name), filename=f.name))
    annotations = {
        referrers.KIND: KIND,
        referrers.CREATED: referrers.created_now(),
        ARCH_ANNOTATION: collected.built_for.arch_list,
    }
    return referrers.attach_layers(
        registry, repository, subject, artifact_type=ARTIFACT_TYPE, layers=tuple(layers), annotations=annotations
    )


def publish(engine: Callable[[], Engine], registry: Registry, p: TargetPlan, digest: str, *, cache: Path | None = None) -> bool:
    """Attach the wheels of ``p``'s stages to ``digest``; False where its stages made none. With
    ``cache``, a stage image known there to hold no file in /wheels is not read again."""
    stages = [(s.name, s.ref) for s in p.stages if not s.final]
    with tempfile.TemporaryDirectory(prefix="sparkbuild-wheels-") as tmp:
        present = [(name, ref) for name, ref in stages if _stage_image(engine(), registry, ref, p.target.platform)]
        if len(present) < len(stages):
            missing = ", ".join(ref for name, ref in stages if (name, ref) not in present)
            log.warning(
                f"{p.id}: stage images {missing} are in neither the engine nor {registry.host}: no wheels attached; "
                f"build the target again (`sparkbuild build --only {p.id}`), then publish to attach them"
            )
            return False
        empty = None if cache is None else cache / EMPTY
        collected = collect(engine(), present, Path(tmp), BuiltFor.of(p.target), empty=empty)
        if not collected.wheels:
            log.info(f"{p.id}: no stage left a wheel in {FOLDER} (a local target installs vLLM's wheel from PyPI): none attached")
            return False
        attach(registry, p.repository, digest, collected)
    return True


def _stage_image(engine: Engine, registry: Registry, ref: str, platform: str) -> bool:
    """The stage image is in the engine, pulled from the registry's stage repository if need be."""
    if engine.image_exists(ref):
        return True
    tag = ref.rsplit(":", 1)[1]
    if registry.digest(STAGE_REPOSITORY, tag) is None:
        return False
    push.pull_as(engine, registry, STAGE_REPOSITORY, tag, platform)
    return True


def _media_type(name: str) -> str:
    if name.endswith(".whl"):
        return WHEEL_MEDIA_TYPE
    return "application/json" if name.endswith(".json") else "text/plain"


def _size(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"


# --- sparkbuild wheels IMAGE --out DIR ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Fetched:
    image: str
    out: Path
    index: dict[str, Any]
    files: tuple[referrers.Layer, ...]
    downloaded: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "out": str(self.out),
            "files": [{"file": f.filename, "sha256": f.digest, "size": f.size} for f in self.files],
            "downloaded": list(self.downloaded),
            "index": self.index,
            "install": install_command(self.out, self.index),
        }


def fetch(registry: Registry, repository: str, reference: str, out: Path) -> Fetched:
    """Download the wheels attached to the image into ``out`` (files already there with the right
    content are kept), with ``wheels.json`` and ``SHA256SUMS``."""
    digest = referrers.subject_digest(registry, repository, reference)
    image = f"{registry.host}/{repository}@{digest}"
    attached = referrers.newest(referrers.listed(registry, repository, digest)).get(KIND)
    if attached is None:
        raise PublishError(
            f"no wheels are attached to {image}: its target builds none (a local target installs vLLM's wheel from PyPI), "
            "or it was published before sparkbuild attached wheels (publish its target again to attach them; nothing is rebuilt)"
        )
    layers = referrers.layers_of(registry, repository, attached)
    if INDEX not in {layer.filename for layer in layers}:
        raise PublishError(f"{image}: the attached wheels have no {INDEX}; publish the target again to attach them anew")
    for layer in layers:
        if not SAFE_NAME.fullmatch(layer.filename) or layer.filename == SUMS:
            raise PublishError(f"{image}: attached file name {layer.filename!r} is not one sparkbuild writes; nothing fetched")
    out.mkdir(parents=True, exist_ok=True)
    downloaded = tuple(layer.filename for layer in layers if _download(registry, repository, layer, out))
    index = json.loads((out / INDEX).read_text())
    (out / SUMS).write_text("".join(f"{layer.digest.split(':', 1)[1]}  {layer.filename}\n" for layer in layers))
    return Fetched(image=image, out=out, index=index, files=tuple(layers), downloaded=downloaded)


def _download(registry: Registry, repository: str, layer: referrers.Layer, out: Path) -> bool:
    dest = out / layer.filename
    if dest.is_file() and file_digest(dest)[0] == layer.digest:
        return False
    with log.step(f"Fetching {layer.filename} ({_size(layer.size)})"):
        registry.download_blob(repository, layer.digest, dest)
    return True


def install_command(out: Path, index: Mapping[str, Any]) -> list[str]:
    """The pip command that installs the fetched wheels as the image did: with the image's torch
    and the vLLM stage's requirement file, where there is one."""
    names = sorted({str(f["name"]) for f in index.get("files") or () if f.get("name")})
    command = ["python", "-m", "pip", "install", "--find-links", str(out)]
    if any(f.get("file") == REQUIREMENTS for f in index.get("files") or ()):
        command += ["--requirement", str(out / REQUIREMENTS)]
    torch = (index.get("built_for") or {}).get("torch")
    return [*command, *([f"torch=={torch}"] if torch else []), *names]


def text(fetched: Fetched) -> str:
    """What a person reads: the files, what they were built for, and how to install them."""
    lines = [f"{fetched.image}: {len(fetched.files)} files in {fetched.out} ({len(fetched.downloaded)} downloaded)"]
    for f in fetched.files:
        lines.append(f"  {f.filename:<60} {_size(f.size):>10}  {f.digest[:19]}")
    built = fetched.index.get("built_for") or {}
    if built:
        lines.append(f"built for: {BuiltFor(**built).text()}")
    compiled = (fetched.index.get("vllm_build_env") or {}).get("TORCH_CUDA_ARCH_LIST")
    if compiled:
        lines.append(f"vLLM compiled with TORCH_CUDA_ARCH_LIST={compiled}")
    lines.append(f"checksums: {fetched.out / SUMS} (sha256sum -c)")
    lines.append("install: " + " ".join(install_command(fetched.out, fetched.index)))
    return "\n".join(lines)
