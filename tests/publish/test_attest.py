"""SBOM, provenance and verify result attached at publish, against the real embedded registry
(Debian's docker-registry: distribution 2.8, no referrers API, so the fallback tag is used), read
back by the image's digest and checked against the image itself; then ``sparkbuild inspect``.

The image is small and real: the test base (Debian bookworm) with a venv whose pip reinstalls
Debian's own wheels offline, writing a real installation report to /opt/sparkbuild/pip-report.json,
and the build manifest of a Spark plan whose commits the lock pins (made up, as in
tests/publish/test_documents.py). The verify result is a recorded one: no server is started here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from sparkbuild.config.options import Options
from sparkbuild.errors import FatalError, PublishError
from sparkbuild.lanes import pipeline
from sparkbuild.oci import push, referrers
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import plan
from sparkbuild.publish import attest, provenance, publish, sbom
from sparkbuild.upstream import kernelpath
from sparkbuild.verify import benchmark, layout, verify
from sparkbuild.verify.verify import Answer, VerifyResult
from tests.publish.test_documents import pinned_spark_plan
from tests.support import DATA, ROOT
from tests.support.cli import in_process as sparkbuild
from tests.support.matrix import LOCAL_PLATFORM

pytestmark = pytest.mark.docker

LOCAL = "sparkbuild-test/attest-image:1"
DOCKERFILE = """\
FROM {base}
ENV PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv && mkdir -p /opt/sparkbuild \\
    && pip install --no-index --force-reinstall --report /opt/sparkbuild/pip-report.json /usr/share/python-wheels/*.whl
COPY manifest.json /opt/sparkbuild/manifest.json
"""


@pytest.fixture
def spark_plan(tmp_path: Path) -> plan.TargetPlan:
    return pinned_spark_plan(tmp_path / "matrix.lock.json")


@pytest.fixture
def image(engine: Engine, base: str, spark_plan: plan.TargetPlan, tmp_path: Path) -> Iterator[str]:
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(DOCKERFILE.format(base=base))
    (context / "manifest.json").write_text(json.dumps(spark_plan.manifest(), indent=2))
    engine.build(
        context=context, tag=LOCAL, platform=LOCAL_PLATFORM, labels={}, build_args={}, secrets={}, log_file=tmp_path / "build.log"
    )
    try:
        yield LOCAL
    finally:
        for ref in (LOCAL, *(t for t in engine.inspect(LOCAL)["RepoTags"] if t != LOCAL)):
            with contextlib.suppress(docker.errors.NotFound):
                engine.client.images.remove(ref, force=True)


def recorded_verify(path: Path, image_id: str) -> None:
    """A recorded result of the target's first check (answers and speed) at ``path``, and of its
    second check (answers and kernel path) where verify writes it, in checks/moe-nvfp4/: each tied
    to the image as verify ties it (its ID, a server log beside it naming the vLLM version, that
    log's digest), so publish attaches them."""
    answer = Answer(name="completion", api="completions", prompt="c d e f", expected=" g h i j", received=" g h i j")
    bench = benchmark.from_json(json.loads((DATA / "bench" / "baseline.json").read_text()), "baseline.json")
    line = "Using 'FLASHINFER_CUTLASS' NvFp4 MoE backend out of potential backends: ['FLASHINFER_CUTLASS']"
    chosen = kernelpath.Chosen(kind="moe", expected=("FLASHINFER_CUTLASS",), found=(("FLASHINFER_CUTLASS", line),))
    results = {
        path: VerifyResult(image=LOCAL, model="alphabet", check="alphabet", startup_s=21.5, answers=(answer,), benchmark=bench),
        path.parent / "checks" / "moe-nvfp4" / "verify.json": VerifyResult(
            image=LOCAL, model="moe-nvfp4", check="moe-nvfp4", startup_s=30.0, answers=(answer,), kernels=(chosen,)
        ),
    }
    log = f"INFO vLLM API server version 0.33.0\nINFO {line}\n".encode()
    for where, result in results.items():
        where.parent.mkdir(parents=True, exist_ok=True)
        (where.parent / layout.SERVER_LOG).write_bytes(log)
        tied = dataclasses.replace(result, vllm_version="0.33.0", image_id=image_id, server_log_sha256=verify.log_digest(log))
        where.write_text(json.dumps(tied.to_json(), indent=2))


def test_publish_attaches_sbom_provenance_and_verify_that_match_the_image(
    engine: Engine, image: str, registry: Registry, spark_plan: plan.TargetPlan, tmp_path: Path
) -> None:
    recorded_verify(tmp_path / "verify.json", str(engine.inspect(image)["Id"]))
    evidence = evidence_in(tmp_path, image, spark_plan)
    done = publish.push(engine, registry, spark_plan, image, evidence=evidence)
    repo = spark_plan.repository

    # distribution 2.8: no referrers API; the fallback tag indexes the four documents.
    assert registry.referrers(repo, done.digest) is None
    assert registry.digest(repo, referrers.fallback_tag(done.digest)) is not None
    listed = referrers.listed(registry, repo, done.digest)
    attached = {a.kind: a for a in listed if a.kind != "verify"}
    assert sorted(attached) == ["provenance", "sbom"]
    # One verify result per check that has one (moe-fp8's and gptoss-mxfp4's were not written here).
    attached |= {a.annotations[attest.CHECK]: a for a in listed if a.kind == "verify"}
    assert sorted(attached) == ["alphabet", "moe-nvfp4", "provenance", "sbom"]
    assert attached["sbom"].artifact_type == "application/vnd.cyclonedx+json"
    assert attached["provenance"].artifact_type == "application/vnd.in-toto+json"

    artifact = json.loads(registry.manifest(repo, attached["sbom"].digest)[0])
    assert artifact["subject"]["digest"] == done.digest and artifact["artifactType"] == "application/vnd.cyclonedx+json"
    assert artifact["layers"][0]["annotations"] == {"org.opencontainers.image.title": "sbom.cdx.json"}
    document = json.loads(referrers.read(registry, repo, attached["sbom"]))
    check_sbom(engine, image, document, spark_plan)
    statement = json.loads(referrers.read(registry, repo, attached["provenance"]))
    check_provenance(statement, spark_plan, f"{registry.host}/{repo}", done.digest)
    assert json.loads(referrers.read(registry, repo, attached["alphabet"]))["image"] == image
    assert json.loads(referrers.read(registry, repo, attached["moe-nvfp4"]))["kernels"][0]["ok"] is True

    check_inspect(registry, f"{registry.host}/{repo}@{done.digest}", spark_plan)

    # Again: the image is the same, everything is attached; nothing new goes up.
    assert publish.push(engine, registry, spark_plan, image, evidence=evidence).digest == done.digest
    assert len(referrers.listed(registry, repo, done.digest)) == 4


def evidence_in(tmp_path: Path, image: str, p: plan.TargetPlan) -> attest.Evidence:
    """The shipped matrix, the test's lock, the verify result (where the test wrote one) in ``tmp_path``."""
    files = provenance.Files(matrix=ROOT / "matrix.yaml", lock=tmp_path / "matrix.lock.json")
    return attest.Evidence(files=files, verify=layout.result_files(tmp_path / "verify.json", p.target.checks), local=image)


def check_sbom(engine: Engine, image: str, document: dict[str, Any], p: plan.TargetPlan) -> None:
    """Against the image itself: every distribution of its pip report (with its hash), every deb
    dpkg lists, every source commit of its manifest."""
    components = document["components"]
    by_ref = {c["bom-ref"]: c for c in components}
    report = json.loads(engine.read_files(image, [sbom.PIP_REPORT])[sbom.PIP_REPORT] or b"{}")
    assert report["install"], "the image's pip report lists what pip installed"
    for item in report["install"]:
        name, version = sbom.normalize(item["metadata"]["name"]), item["metadata"]["version"]
        # Debian's pip 23.0 writes the older "hash": "sha256=<hex>"; its digest, whichever the field.
        digest = item["download_info"]["archive_info"]["hash"].removeprefix("sha256=")
        assert by_ref[f"pypi:{name}@{version}"]["hashes"] == [{"alg": "SHA-256", "content": digest}]
    debs = sbom.parse_dpkg(engine.output(image, ["dpkg-query", "-W", "-f", sbom.DPKG_FORMAT]))
    assert len(debs) > 50
    for deb in debs:
        assert f"deb:{deb.name}@{deb.version}?arch={deb.arch}" in by_ref
    commits = {c for _, _, c in provenance.sources(p.manifest()["inputs"])}
    assert {b["commit"] for b in sbom.summary(document)["from_source"]} == commits and len(commits) >= 4


def check_provenance(statement: dict[str, Any], p: plan.TargetPlan, name: str, digest: str) -> None:
    assert statement["subject"] == [{"name": name, "digest": {"sha256": digest.removeprefix("sha256:")}}]
    materials = provenance.materials(statement)
    commits = {m["digest"]["gitCommit"] for m in materials if "gitCommit" in m["digest"]}
    assert {c for _, _, c in provenance.sources(p.manifest()["inputs"])} <= commits
    patches = {m["name"].removeprefix("patch:"): m["digest"]["sha256"] for m in materials if m["name"].startswith("patch:")}
    assert patches == p.inputs["patches"]
    assert any(m["name"] == "lock" for m in materials)


def check_inspect(registry: Registry, reference: str, p: plan.TargetPlan) -> None:
    shown = sparkbuild("inspect", reference)
    assert shown.code == 0, shown.err
    text = shown.out
    assert reference in text
    assert "SBOM (CycloneDX 1.6)" in text and "deb" in text
    vllm = p.inputs["vllm"]["commit"]
    assert f"from source: vllm {vllm}" in text and f"gitCommit {vllm}" in text
    assert "verify: ok, 1/1 answers (check alphabet" in text and "decode c=1: TTFT p50 14 ms" in text
    assert "verify: ok, 1/1 answers (check moe-nvfp4" in text and "kernel path moe: FLASHINFER_CUTLASS" in text
    assert text.index("check alphabet") < text.index("check moe-nvfp4")  # the benchmarked check first
    as_json = sparkbuild("inspect", reference, "--json")
    assert as_json.code == 0, as_json.err
    report = json.loads(as_json.out)
    assert report["digest"] == reference.rsplit("@", 1)[1]
    assert {a["kind"] for a in report["attached"]} == {"sbom", "provenance", "verify"}
    assert report["sbom"]["summary"]["counts"]["source"] >= 4
    assert report["provenance"]["predicateType"] == "https://slsa.dev/provenance/v1"
    assert [(r["check"], r["ok"]) for r in report["verify"]] == [("alphabet", True), ("moe-nvfp4", True)]
    by_tag = sparkbuild("inspect", f"{p.repository}:{p.content_tag}", "--registry", registry.host, "--json")
    assert by_tag.code == 0 and json.loads(by_tag.out)["digest"] == report["digest"]


def test_a_nightly_attaches_what_an_image_published_before_lacks(
    engine: Engine, image: str, registry: Registry, spark_plan: plan.TargetPlan, tmp_path: Path
) -> None:
    """An image published without documents (as before sparkbuild attached them) gets its SBOM and
    provenance when a nightly finds it published, before its checks (none has a result attached, so
    each is a check it gained) run on it. This image is no vLLM server: the checks fail (on a host
    without a GPU, at the container's start), and the documents are attached all the same; no
    verify result is."""
    done = publish.push(engine, registry, spark_plan, image)
    assert referrers.listed(registry, spark_plan.repository, done.digest) == []
    opts = Options.from_env(matrix=ROOT / "matrix.yaml", lock=tmp_path / "matrix.lock.json", out=tmp_path / "out")
    ctx = pipeline.Context(opts, registry, tmp_path / "work", {})
    run = pipeline.TargetRun(spark_plan)
    with pytest.raises(FatalError):
        pipeline.find_published(ctx, run)
    assert run.new_checks == tuple(c.name for c in spark_plan.target.checks)
    kinds = sorted(a.kind for a in referrers.listed(registry, spark_plan.repository, done.digest))
    assert kinds == ["provenance", "sbom"]


def test_a_failed_attach_fails_the_publish_and_moves_no_readable_tag(
    engine: Engine, image: str, registry: Registry, spark_plan: plan.TargetPlan, tmp_path: Path
) -> None:
    repo = spark_plan.repository
    engine.tag(image, f"{registry.host}/{repo}", spark_plan.content_tag)
    digest = push.push_image(engine, registry, f"{registry.host}/{repo}", spark_plan.content_tag)
    # Something else under the image's referrers tag: not an index sparkbuild can add to.
    registry.put_tag(repo, referrers.fallback_tag(digest), *registry.manifest(repo, digest))
    evidence = evidence_in(tmp_path, image, spark_plan)
    with pytest.raises(PublishError, match=r"attaching the SBOM.*is not an image index.*No readable tag moved"):
        publish.push(engine, registry, spark_plan, image, evidence=evidence)
    assert all(registry.digest(repo, tag) is None for tag in spark_plan.tags)


STAGE_DOCKERFILE = """\
FROM {base}
RUN mkdir /wheels && cp /usr/share/python-wheels/{wheel}-*.whl /wheels/ && echo {build_env} > /wheels/{stage}-build-env.txt
"""
# Debian's own wheels stand in for the ones the stages build (real wheels, small; the rehearsal test
# publishes the real vLLM and FlashInfer wheels the Spark build made).
STAND_INS = {"flashinfer": "setuptools", "vllm": "pip"}


@pytest.fixture
def stages(engine: Engine, spark_plan: plan.TargetPlan) -> Iterator[dict[str, str]]:
    """The plan's stage images that make wheels (made here by ``build_stages``), removed after the test."""
    refs = {s.name: s.ref for s in spark_plan.stages if not s.final}
    assert sorted(refs) == sorted(STAND_INS)
    yield refs
    for ref in refs.values():
        with contextlib.suppress(docker.errors.NotFound):
            engine.client.images.remove(ref, force=True)


def build_stages(engine: Engine, base: str, refs: dict[str, str], folder: Path, arch_list: str) -> None:
    for stage, ref in refs.items():
        context = folder / stage
        context.mkdir(parents=True)
        build_env = f'"MAX_JOBS=2 TORCH_CUDA_ARCH_LIST={arch_list}"' if stage == "vllm" else "JOBS=2"
        dockerfile = STAGE_DOCKERFILE.format(base=base, wheel=STAND_INS[stage], build_env=build_env, stage=stage)
        (context / "Dockerfile").write_text(dockerfile)
        log = context / "build.log"
        engine.build(context=context, tag=ref, platform=LOCAL_PLATFORM, labels={}, build_args={}, secrets={}, log_file=log)


def test_publish_attaches_the_wheels_its_stages_made_and_sparkbuild_wheels_fetches_them(
    engine: Engine,
    image: str,
    base: str,
    registry: Registry,
    spark_plan: plan.TargetPlan,
    stages: dict[str, str],
    tmp_path: Path,
) -> None:
    build_stages(engine, base, stages, tmp_path / "stages", arch_list=spark_plan.target.arch_list)
    evidence = evidence_in(tmp_path, image, spark_plan)
    done = publish.push(engine, registry, spark_plan, image, evidence=evidence)
    repo = spark_plan.repository
    attached = {a.kind: a for a in referrers.listed(registry, repo, done.digest)}
    assert sorted(attached) == ["provenance", "sbom", "wheels"]
    layers = {layer.filename: layer for layer in referrers.layers_of(registry, repo, attached["wheels"])}
    found = sorted(name for name in layers if name.endswith(".whl"))
    assert [name.split("-")[0] for name in found] == ["pip", "setuptools"]
    assert sorted(layers) == sorted(["wheels.json", *found, "flashinfer-build-env.txt", "vllm-build-env.txt"])
    assert {layers[name].media_type for name in found} == {"application/vnd.sparkbuild.python-wheel.v1+zip"}
    wheel = found[0]

    out = tmp_path / "fetched"
    fetched = sparkbuild("wheels", f"{registry.host}/{repo}:{spark_plan.content_tag}", "--out", str(out), "--json")
    assert fetched.code == 0, fetched.err
    report = json.loads(fetched.out)
    assert report["image"] == f"{registry.host}/{repo}@{done.digest}"
    assert (
        report["index"]["built_for"]["arch_list"] == "12.1a"
        and report["index"]["vllm_build_env"]["TORCH_CUDA_ARCH_LIST"] == "12.1a"
    )
    # Byte for byte the stage's wheel, and listed in SHA256SUMS as `sha256sum -c` reads it.
    original = engine.read_files(stages["vllm"], [f"/wheels/{wheel}"])[f"/wheels/{wheel}"]
    assert (out / wheel).read_bytes() == original
    sums = (out / "SHA256SUMS").read_text().splitlines()
    assert f"{hashlib.sha256(original or b'').hexdigest()}  {wheel}" in sums
    # Fetched again: everything is there already, nothing is downloaded.
    again = sparkbuild("wheels", report["image"], "--out", str(out), "--json")
    assert again.code == 0 and json.loads(again.out)["downloaded"] == []
    shown = sparkbuild("inspect", report["image"])
    assert "wheels: 2, built for" in shown.out and "(arch list 12.1a)" in shown.out and wheel in shown.out


def test_a_vllm_stage_compiled_for_another_arch_list_fails_the_publish_before_any_readable_tag(
    engine: Engine, image: str, base: str, registry: Registry, spark_plan: plan.TargetPlan, stages: dict[str, str], tmp_path: Path
) -> None:
    build_stages(engine, base, stages, tmp_path / "stages", arch_list="12.0")
    evidence = evidence_in(tmp_path, image, spark_plan)
    with pytest.raises(PublishError, match=r"compiled with TORCH_CUDA_ARCH_LIST=12.0, but the target's arch list is 12.1a"):
        publish.push(engine, registry, spark_plan, image, evidence=evidence)
    assert all(registry.digest(spark_plan.repository, tag) is None for tag in spark_plan.tags)


def test_sparkbuild_wheels_says_why_an_image_has_none(
    engine: Engine, image: str, registry: Registry, spark_plan: plan.TargetPlan
) -> None:
    done = publish.push(engine, registry, spark_plan, image)
    fetched = sparkbuild("wheels", f"{registry.host}/{spark_plan.repository}@{done.digest}", "--out", "unused")
    assert fetched.code == 7
    assert "no wheels are attached to" in fetched.err and "a local target installs vLLM's wheel from PyPI" in fetched.err
