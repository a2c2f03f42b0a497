"""The image's software bill of materials: CycloneDX, made with cyclonedx-python-lib.

What is in an image is read out of it once (``read_image``, through the engine); the BOM is made
from that by pure functions. Every component says what kind it is in the property
``sparkbuild:kind`` (python, deb, source) so that ``sparkbuild inspect`` and a person's ``jq`` can
count them; NVIDIA's CUDA wheels carry ``sparkbuild:cuda-wheel``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cyclonedx.model import ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, Property, XsUri
from cyclonedx.model.bom import Bom
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.output import make_outputter
from cyclonedx.schema import OutputFormat, SchemaVersion
from packageurl import PackageURL

from sparkbuild import __version__
from sparkbuild.errors import PublishError
from sparkbuild.publish import provenance
from sparkbuild.util import log

if TYPE_CHECKING:
    from sparkbuild.oci.engine import Engine

MEDIA_TYPE = "application/vnd.cyclonedx+json"
SCHEMA = SchemaVersion.V1_6
KIND = "sparkbuild:kind"
CUDA_WHEEL = "sparkbuild:cuda-wheel"
# Where the runtime stage's pip writes its installation report, and sparkbuild its build manifest.
PIP_REPORT = "/opt/sparkbuild/pip-report.json"
MANIFEST = "/opt/sparkbuild/manifest.json"
# /etc/os-release is often a link to the other (os-release(5)).
OS_RELEASE = ("/etc/os-release", "/usr/lib/os-release")
# The source components of the plan's inputs (``plan.TargetPlan.inputs``) and what they are.
# pip's report names hash algorithms as hashlib does.
HASHES = {"sha256": HashAlgorithm.SHA_256, "sha384": HashAlgorithm.SHA_384, "sha512": HashAlgorithm.SHA_512}


@dataclass(frozen=True, kw_only=True)
class Deb:
    name: str
    version: str
    arch: str


@dataclass(frozen=True, kw_only=True)
class ImageContents:
    """What the SBOM is made from, as read out of the image."""

    # pip's installation report of the runtime stage (None: the image has none).
    pip_report: Mapping[str, Any] | None
    # Every Python distribution installed in the image, (name, version): earlier stages' too (torch).
    installed: tuple[tuple[str, str], ...]
    debs: tuple[Deb, ...]
    # /etc/os-release's ID (debian, ubuntu); the purl namespace of the deb packages.
    distro: str
    manifest: Mapping[str, Any]


# --- parsing what the image says ---------------------------------------------------------------

# dpkg-query reads the \\t and \\n escapes itself.
DPKG_FORMAT = r"${Package}\t${Version}\t${Architecture}\n"


def parse_dpkg(text: str) -> tuple[Deb, ...]:
    """``dpkg-query -W -f '${Package}\\t${Version}\\t${Architecture}\\n'`` -> packages."""
    found = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0] and parts[1]:  # a package with no version is not installed
            found.append(Deb(name=parts[0], version=parts[1], arch=parts[2]))
    return tuple(found)


def parse_os_release(text: str) -> str:
    """The ``ID=`` of /etc/os-release (``debian`` when it says none)."""
    match = re.search(r'^ID="?([A-Za-z0-9._-]+)"?\s*$', text, re.MULTILINE)
    return match.group(1).lower() if match else "debian"


def normalize(name: str) -> str:
    """A distribution's name as PyPI and purl compare it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# Every Python distribution the image's python3 (its venv's, first on PATH) sees, as JSON.
LIST_DISTRIBUTIONS = (
    "import importlib.metadata as m, json; "
    "print(json.dumps(sorted({(d.metadata['Name'], d.version) for d in m.distributions() if d.metadata['Name']})))"
)


def read_image(engine: Engine, image: str) -> ImageContents:
    """Read what the SBOM lists out of ``image``: its files through a created container, its
    package lists by running dpkg-query and python3 in containers that are always removed."""
    files = engine.read_files(image, [PIP_REPORT, MANIFEST, *OS_RELEASE])
    if files[MANIFEST] is None:
        log.warning(f"{image} has no {MANIFEST} (not built by sparkbuild?): its SBOM lists no source-built component")
    dpkg = engine.output(image, ["dpkg-query", "-W", "-f", DPKG_FORMAT])
    installed = json.loads(engine.output(image, ["python3", "-c", LIST_DISTRIBUTIONS]))
    report = files[PIP_REPORT]
    return ImageContents(
        pip_report=None if report is None else json.loads(report),
        installed=tuple((str(name), str(version)) for name, version in installed),
        debs=parse_dpkg(dpkg),
        distro=parse_os_release(next((data for data in map(files.get, OS_RELEASE) if data), b"").decode()),
        manifest=json.loads(files[MANIFEST] or b"{}"),
    )


# --- the BOM ----------------------------------------------------------------------------------


def make(contents: ImageContents, *, image: str, digest: str | None) -> Bom:
    """The BOM of the image ``image`` (``host/repository``) at ``digest``."""
    bom = Bom()
    root = _image_component(image, digest, contents.manifest)
    bom.metadata.component = root
    bom.metadata.tools.components.add(Component(type=ComponentType.APPLICATION, name="sparkbuild", version=__version__))
    components = [
        *python_components(contents.pip_report, contents.installed),
        *deb_components(contents.debs, contents.distro),
        *source_components(contents.manifest.get("inputs") or {}),
        *wheel_components(contents.manifest.get("inputs") or {}),
    ]
    for component in components:
        bom.components.add(component)
    # The image holds every component directly (pip's report does not say which needs which).
    bom.register_dependency(root, components)
    return bom


def _image_component(image: str, digest: str | None, manifest: Mapping[str, Any]) -> Component:
    name = image.rsplit("/", 1)[-1]
    purl = PackageURL(type="oci", name=name, version=digest, qualifiers={"repository_url": image}) if digest else None
    return Component(
        type=ComponentType.CONTAINER,
        name=image,
        version=str(manifest.get("content_tag") or digest or "unknown"),
        purl=purl,
        bom_ref=f"image:{image}@{digest}",
    )


def _props(kind: str, **more: str) -> list[Property]:
    return [Property(name=KIND, value=kind), *(Property(name=f"sparkbuild:{k}", value=v) for k, v in more.items())]


def python_components(report: Mapping[str, Any] | None, installed: Iterable[tuple[str, str]]) -> list[Component]:
    """One component per distribution installed in the image, with its hash where pip's report has
    that version; one an earlier stage installed (the local profile's torch) says it has none, and
    one the report has but a later step uninstalled is left out. With no list of what is installed
    (no python3 in the image), the report's."""
    reported = {normalize(i["metadata"]["name"]): i for i in (report or {}).get("install", [])}
    present = {normalize(name): (name, version) for name, version in installed}
    if not present:
        present = {key: (i["metadata"]["name"], i["metadata"]["version"]) for key, i in reported.items()}
    found = []
    for key, (name, version) in sorted(present.items()):
        item = reported.get(key)
        found.append(_python(name, version, item if item and item["metadata"]["version"] == version else None))
    return found


def _python(name: str, version: str, item: Mapping[str, Any] | None) -> Component:
    hashes = report_hashes(item)
    more = {"cuda-wheel": "true"} if normalize(name).startswith("nvidia-") else {}
    if item is None:
        more["note"] = "installed by an earlier stage; not in the runtime's pip report"
    # No download URL: an index URL may carry credentials, and where a wheel came from does not
    # change it (its hash says what it is).
    return Component(
        type=ComponentType.LIBRARY,
        name=name,
        version=version,
        purl=PackageURL(type="pypi", name=normalize(name), version=version),
        bom_ref=f"pypi:{normalize(name)}@{version}",
        hashes=[HashType(alg=HASHES[alg], content=value) for alg, value in sorted(hashes.items()) if alg in HASHES],
        properties=_props("python", **more),
    )


def report_hashes(item: Mapping[str, Any] | None) -> dict[str, str]:
    """A pip report item's archive hashes: ``hashes`` (pip >= 23.1), else the older ``hash``
    (``sha256=<hex>``, as Debian bookworm's pip 23.0 writes it)."""
    archive = ((item or {}).get("download_info") or {}).get("archive_info") or {}
    if archive.get("hashes"):
        return dict(archive["hashes"])
    algorithm, _, value = str(archive.get("hash") or "").partition("=")
    return {algorithm: value} if value else {}


def deb_components(debs: Iterable[Deb], distro: str) -> list[Component]:
    return [
        Component(
            type=ComponentType.LIBRARY,
            name=d.name,
            version=d.version,
            purl=PackageURL(type="deb", namespace=distro, name=d.name, version=d.version, qualifiers={"arch": d.arch}),
            bom_ref=f"deb:{d.name}@{d.version}?arch={d.arch}",
            properties=_props("deb"),
        )
        for d in debs
    ]


def source_components(inputs: Mapping[str, Any]) -> list[Component]:
    return [
        Component(
            type=ComponentType.LIBRARY,
            name=name,
            version=commit,
            purl=_git_purl(name, repo, commit),
            bom_ref=f"source:{name}@{commit}",
            external_references=[ExternalReference(type=ExternalReferenceType.VCS, url=XsUri(f"{repo}@{commit}"))],
            properties=_props("source", commit=commit, repository=repo),
        )
        for name, repo, commit in provenance.sources(inputs)
    ]


def wheel_components(inputs: Mapping[str, Any]) -> list[Component]:
    """Upstream's vLLM wheel a Spark image was built from (``vllm_from`` in the plan's inputs), by
    file name and sha256: what the image's vLLM is, before the patch set changed its Python files."""
    wheel = inputs.get("vllm_from") or {}
    if wheel.get("mode") != "wheel" or not wheel.get("wheel") or not wheel.get("sha256"):
        return []
    filename, sha256 = str(wheel["wheel"]), str(wheel["sha256"])
    version = filename.split("-")[1] if filename.count("-") >= 4 else "unknown"
    return [
        Component(
            type=ComponentType.LIBRARY,
            name="vllm",
            version=version,
            purl=PackageURL(type="pypi", name="vllm", version=version, qualifiers={"file_name": filename}),
            bom_ref=f"upstream-wheel:{filename}",
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=sha256)],
            properties=_props("upstream-wheel", file=filename, sha256=sha256),
        )
    ]


def _git_purl(name: str, repo: str, commit: str) -> PackageURL:
    """``pkg:github/owner/name@commit`` for GitHub; else ``pkg:generic`` with the ``vcs_url``."""
    github = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?", repo)
    if github:
        return PackageURL(type="github", namespace=github.group(1), name=github.group(2), version=commit)
    return PackageURL(type="generic", name=name, version=commit, qualifiers={"vcs_url": f"git+{repo}@{commit}"})


def to_json(bom: Bom) -> str:
    """CycloneDX JSON, checked against the schema first: an SBOM that does not validate is not attached."""
    # Imported here, not with the module: the validator loads jsonschema with its format checkers,
    # whose IRI grammar is compiled at import (seconds on two busy cores), and only making an SBOM
    # needs it; a nightly with nothing to publish does not (tests/test_startup.py).
    from cyclonedx.validation.json import JsonStrictValidator

    text = make_outputter(bom, OutputFormat.JSON, SCHEMA).output_as_string(indent=2)
    error = JsonStrictValidator(SCHEMA).validate_str(text)
    if error is not None:
        raise PublishError(f"the SBOM made for {bom.metadata.component} is not valid CycloneDX {SCHEMA.to_version()}: {error}")
    return text


# --- reading one back (inspect) ---------------------------------------------------------------


def summary(document: Mapping[str, Any]) -> dict[str, Any]:
    """What ``inspect`` shows of a CycloneDX JSON SBOM: counts by kind, and the sources' commits."""
    counts = {"python": 0, "deb": 0, "cuda_wheels": 0, "source": 0, "other": 0}
    built = []
    for component in document.get("components") or ():
        props = {p.get("name"): p.get("value") for p in component.get("properties") or ()}
        kind = props.get(KIND) if props.get(KIND) in counts else "other"
        counts[str(kind)] += 1
        counts["cuda_wheels"] += props.get(CUDA_WHEEL) == "true"
        if kind == "source":
            built.append(
                {
                    "name": component.get("name"),
                    "commit": props.get("sparkbuild:commit"),
                    "repository": props.get("sparkbuild:repository"),
                }
            )
    spec = document.get("specVersion", "?")
    return {
        "format": f"CycloneDX {spec}",
        "components": len(document.get("components") or ()),
        "counts": counts,
        "from_source": built,
    }


def loads(data: bytes) -> dict[str, Any]:
    document = json.loads(data)
    if not isinstance(document, dict) or document.get("bomFormat") != "CycloneDX":
        raise PublishError("an attached SBOM is not a CycloneDX JSON document")
    return document
