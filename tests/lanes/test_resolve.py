"""resolve against real git remotes (git daemon on loopback) and a real registry."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import requests

from sparkbuild.config.options import Options
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import lock, plan
from sparkbuild.upstream import externals, sources
from tests.support import ROOT
from tests.support.git import git
from tests.support.upstream import Upstream, commit, spark_matrix, sparkbuild


def push_manifest(registry: Registry, repository: str, tag: str) -> str:
    """A minimal image (a config blob, no layers) put into the registry over its HTTP API."""
    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
    digest = "sha256:" + hashlib.sha256(config).hexdigest()
    start = requests.post(f"{registry.base_url}/{repository}/blobs/uploads/", timeout=10)
    location = start.headers["Location"]
    location = location if location.startswith("http") else f"http://{registry.host}{location}"
    sep = "&" if "?" in location else "?"
    assert requests.put(f"{location}{sep}digest={digest}", data=config, timeout=10).status_code == 201
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config), "digest": digest},
        "layers": [],
    }
    body = json.dumps(manifest).encode()
    response = requests.put(
        f"{registry.base_url}/{repository}/manifests/{tag}",
        data=body,
        headers={"Content-Type": str(manifest["mediaType"])},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    return "sha256:" + hashlib.sha256(body).hexdigest()


def test_resolve_pins_every_ref_and_image_and_the_build_reads_the_lock(
    upstream: Upstream, registry: Registry, tmp_path: Path
) -> None:
    digest = push_manifest(registry, "nvidia/cuda", "13.0.2-devel")
    image = f"{registry.host}/nvidia/cuda:13.0.2-devel"
    matrix = spark_matrix(tmp_path / "matrix.yaml", upstream, '{version: "0.33.0"}', image)
    opts = Options.from_env(matrix=matrix, cache=tmp_path / "cache")
    (before,) = plan.make(opts)
    assert set(before.unresolved) == {"vllm v0.33.0", "triton releases/v0.33", "cutlass v4.7.1", f"base cuda-devel ({image})"}
    declared = externals.scan(sources.vllm_sdist("0.33.0", Options.from_env().cache))

    result = sparkbuild("resolve", "--matrix", str(matrix), "--json", cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    pins = {p["name"]: p for p in json.loads(result.stdout)["pins"]}
    assert pins["vllm v0.33.0"]["value"] == upstream.shas["v0.33.0"]
    assert pins["cutlass v4.7.1"]["value"] == upstream.shas["cutlass"]
    assert pins["triton releases/v0.33"]["value"] == upstream.shas["v0.33.0"]
    assert pins["base cuda-devel"]["value"] == digest
    assert {p["change"] for p in pins.values()} <= {"new", "pinned by vLLM's CMake file"}
    # The sources vLLM's CMake files clone, read from the pinned commit and pinned through the mirror:
    # a commit in the CMake file pins itself, a tag is asked of its repository.
    for e in declared:
        pin = pins[f"{e.name} {e.ref}"]
        assert pin["source"] == e.repo.replace("https://github.com/", f"{upstream.url}/github/")
        if re.fullmatch(r"[0-9a-f]{40}", e.ref):
            assert (pin["value"], pin["how"]) == (e.ref, "cmake")
        else:
            assert (pin["value"], pin["how"]) == (upstream.shas[f"{e.repo}@{e.ref}"], "ls-remote")

    written = lock.read(lock.default_path(matrix))
    assert written.commit(f"{upstream.url}/vllm", "v0.33.0") == upstream.shas["v0.33.0"]
    assert written.digest(image) == digest
    (after,) = plan.make(opts)
    assert after.unresolved == ()
    assert after.target.externals is not None
    assert [e.name for e in after.target.externals] == [e.name for e in declared]
    # The source stage fetches each at its commit and points CMake at it: the compile clones nothing.
    vllm_stage = next(s for s in after.stages if s.name == "vllm").rendered.dockerfile
    for e in after.target.externals:
        assert f"git-at-commit {e.repo} {e.commit} /src/externals/{e.name}" in vllm_stage
        if e.handoff == "env":
            assert f"{e.env}={e.path} " in vllm_stage
        else:  # FA: FetchContent's own override, so the tree is installed as a clone's (no link into /src)
            assert f"-DFETCHCONTENT_SOURCE_DIR_{e.name.upper()}=/src/externals/{e.name}" in vllm_stage
    assert [e.name for e in after.target.externals if e.handoff == "fetchcontent"] == ["vllm-flash-attn"]
    assert 'CMAKE_ARGS="-DFETCHCONTENT_FULLY_DISCONNECTED=ON ' in vllm_stage
    fa = next(e for e in after.target.externals if e.name == "vllm-flash-attn")
    # CMake would take every submodule; the build reads csrc/cutlass alone (externals.BUILD_USES).
    assert "/src/externals/vllm-flash-attn --submodules csrc/cutlass\n" in vllm_stage and fa.submodules == "all"
    assert after.target.vllm.commit == upstream.shas["v0.33.0"]
    assert after.base_ref == f"{image}@{digest}"
    assert after.content_tag != before.content_tag

    # An annotated tag resolves to its commit, not to the tag object.
    annotated = spark_matrix(tmp_path / "annotated.yaml", upstream, '{version: "0.32.0"}', image)
    result = sparkbuild("resolve", "--matrix", str(annotated), "--json", cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    pins = {p["name"]: p for p in json.loads(result.stdout)["pins"]}
    assert pins["vllm v0.32.0"]["value"] == upstream.shas["v0.32.0"]


def test_a_moved_branch_is_reported_and_an_abbreviated_sha_is_expanded_in_the_mirror(
    upstream: Upstream, registry: Registry, tmp_path: Path
) -> None:
    image = f"{registry.host}/nvidia/cuda:13.0.2-devel"
    push_manifest(registry, "nvidia/cuda", "13.0.2-devel")
    cutlass = upstream.repo.parent / "cutlass"
    branch = f"moving-{tmp_path.name}"
    git("branch", branch, cwd=cutlass)
    abbrev = upstream.shas["bump"][:9]
    matrix = spark_matrix(tmp_path / "matrix.yaml", upstream, f'{{ref: "{abbrev}"}}', image)
    matrix.write_text(matrix.read_text().replace("cutlass: {ref: v4.7.1}", f"cutlass: {{ref: {branch}}}"))
    first = sparkbuild("resolve", "--matrix", str(matrix), "--json", cache=tmp_path / "cache")
    assert first.returncode == 0, first.stderr
    pins = {p["name"]: p for p in json.loads(first.stdout)["pins"]}
    assert pins[f"vllm {abbrev}"] | {"value": upstream.shas["bump"], "how": "mirror"} == pins[f"vllm {abbrev}"]

    (cutlass / "NEWS").write_text("moved\n")
    git("checkout", "--quiet", branch, cwd=cutlass)
    moved = commit(cutlass, "CUTLASS: a new commit on the branch")
    git("checkout", "--quiet", "main", cwd=cutlass)
    second = sparkbuild("resolve", "--matrix", str(matrix), cache=tmp_path / "cache")
    assert second.returncode == 0, second.stderr
    assert f"moved from {upstream.shas['cutlass'][:12]}" in second.stdout
    assert lock.read(lock.default_path(matrix)).commit(f"{upstream.url}/cutlass", branch) == moved


def test_an_unknown_tag_is_an_error_naming_the_nearest_tags(upstream: Upstream, tmp_path: Path) -> None:
    matrix = spark_matrix(tmp_path / "matrix.yaml", upstream, '{version: "0.33.1"}', "nvidia/cuda:13.0.2-devel")
    result = sparkbuild("resolve", "--matrix", str(matrix), cache=tmp_path / "cache")
    assert result.returncode == 2
    assert "'v0.33.1' is not a tag or branch" in result.stderr
    assert "Nearest existing tags: v0.33.0, v0.34.0rc1" in result.stderr
    assert not lock.default_path(matrix).exists()


def test_a_flashinfer_or_cutlass_other_than_the_one_vllm_names_is_refused_naming_both(upstream: Upstream, tmp_path: Path) -> None:
    """Issue 44, item 4: vLLM 0.33.0's real tree pins flashinfer-python==0.7.2.post1 and CUTLASS v4.7.1; a
    target that builds others is refused by resolve, with both sides and the line to write, before any
    image is asked for or anything compiled."""
    matrix = spark_matrix(tmp_path / "matrix.yaml", upstream, '{version: "0.33.0"}', "nvidia/cuda:13.0.2-devel")
    # FlashInfer from a repository on the loopback daemon (GitHub is not reachable here): the stand-in's.
    for tag in ("v0.7.0.post1", "v4.2.1"):  # the releases this target names, on the stand-in
        git("tag", "--force", tag, cwd=upstream.repo.parent / "cutlass")
    fi = f"flashinfer: {{ref: v0.7.0.post1, repo: {upstream.url}/cutlass}}"
    drifted = matrix.read_text().replace("cutlass: {ref: v4.7.1}", f"cutlass: {{ref: v4.2.1}}\n    {fi}")
    matrix.write_text(drifted)
    result = sparkbuild("resolve", "--matrix", str(matrix), cache=tmp_path / "cache")
    assert result.returncode == 2, result.stderr
    assert f"{matrix}:" in result.stderr and "resolve-test: not what its vLLM names:" in result.stderr
    assert (
        "flashinfer: the target builds v0.7.0.post1, vLLM v0.33.0 requires flashinfer-python==0.7.2.post1 "
        "(requirements/cuda.txt): set flashinfer: {ref: v0.7.2.post1}"
    ) in result.stderr
    assert "cutlass: the target builds v4.2.1, vLLM v0.33.0 asks for v4.7.1 (CMakeLists.txt's CUTLASS_REVISION)" in result.stderr
    assert not lock.default_path(matrix).exists()


def test_the_rc_lane_refuses_a_candidate_whose_flashinfer_its_target_does_not_build(upstream: Upstream, tmp_path: Path) -> None:
    """The rc lane's Spark target against the candidate's own pins (v0.34.0rc1 or rc2: the real 0.33.0 tree, so
    flashinfer-python==0.7.2.post1): the shipped rc target's v0.7.2.post1 passes to the patch check; one
    building v0.7.0.post1 is a plan error naming both, before any patch is checked."""
    shipped = (ROOT / "matrix.yaml").read_text()
    # The shipped rc target, its serving defaults (an alias of another target's) left out.
    rc_target = ("  - lane: rc" + shipped.split("  - lane: rc", 1)[1]).replace("    serve: *spark-serve\n", "")
    head = f"patches_dir: {ROOT / 'patches'}\n" + shipped.split("targets:")[0]
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(head + f"upstreams:\n  vllm: {upstream.url}/vllm\ntargets:\n" + rc_target)
    lane = ("rc", "--matrix", str(matrix), "--dry-run", "--json")
    same = sparkbuild(*lane, cache=tmp_path / "cache", out=tmp_path / "out1")
    assert same.returncode == 0, same.stderr[-3000:]
    report = json.loads(same.stdout)
    (row,) = report["targets"]
    assert row["patches"] == dict.fromkeys(("nvfp4-moe-b12x-auto", "mxfp4-moe-flashinfer-sm12x", "fa3-hopper-only"), "applies")
    # The session's upstream may have tagged v0.34.0rc2 by now (the rc lane's test does): the newest candidate.
    tag = report["candidate"]["tag"]
    matrix.write_text(matrix.read_text().replace("flashinfer: {ref: v0.7.2.post1}", "flashinfer: {ref: v0.7.0.post1}"))
    drifted = sparkbuild(*lane, cache=tmp_path / "cache", out=tmp_path / "out2")
    assert drifted.returncode == 2, drifted.stderr[-3000:]
    assert "vllm-rc-cu130-sm121: not what its vLLM names:" in drifted.stderr
    assert f"flashinfer: the target builds v0.7.0.post1, vLLM {tag} requires flashinfer-python==0.7.2.post1" in drifted.stderr
    assert drifted.stdout == "" and not (tmp_path / "out2" / "rc.json").exists()
