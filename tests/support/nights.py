"""Nights made for the report's test and its scale benchmark: tiny real images uploaded to a real
registry, the documents publish attaches, and benchmark figures as the lane judges them.

What is made up, and why: each image's contents (one file naming its night: the report reads what
the registry holds, whatever the image is) and the dates (a night cannot be waited for).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import tarfile

from sparkbuild.oci import referrers
from sparkbuild.oci.registry import Registry
from sparkbuild.publish import attest, sbom
from sparkbuild.upstream import kernelpath
from sparkbuild.verify import benchmark
from sparkbuild.verify.verify import Answer, VerifyResult
from tests.support import DATA

BENCH = DATA / "bench"


def tiny_image(registry: Registry, repository: str, text: str, architecture: str = "amd64") -> str:
    """A real OCI image (one layer, one file holding ``text``) uploaded to ``registry``; its digest."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        data = text.encode()
        info = tarfile.TarInfo("night")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    layer = gzip.compress(raw.getvalue(), mtime=0)
    diff_id = "sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()
    rootfs = {"type": "layers", "diff_ids": [diff_id]}
    config = json.dumps({"architecture": architecture, "os": "linux", "rootfs": rootfs}).encode()
    config_type, layer_type = "application/vnd.oci.image.config.v1+json", "application/vnd.oci.image.layer.v1.tar+gzip"
    manifest = {
        "schemaVersion": 2,
        "mediaType": referrers.OCI_MANIFEST,
        "config": {"mediaType": config_type, "digest": registry.upload_blob(repository, config), "size": len(config)},
        "layers": [{"mediaType": layer_type, "digest": registry.upload_blob(repository, layer), "size": len(layer)}],
    }
    body = json.dumps(manifest).encode()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    registry.put_manifest(repository, digest, body, referrers.OCI_MANIFEST)
    return digest


def attach(registry: Registry, repository: str, digest: str, verify_payload: bytes, sbom_payload: bytes) -> None:
    """The documents publish attaches to an image (``sparkbuild.publish.attest``): the verify result
    of check ``alphabet`` and the SBOM."""
    for kind, payload, media_type, extra in (
        ("verify", verify_payload, attest.VERIFY_MEDIA_TYPE, {attest.CHECK: "alphabet"}),
        ("sbom", sbom_payload, sbom.MEDIA_TYPE, {}),
    ):
        annotations = {referrers.KIND: kind, referrers.CREATED: referrers.created_now(), **extra}
        filename = attest.FILES[kind]
        document = referrers.Document(payload=payload, artifact_type=media_type, filename=filename, annotations=annotations)
        referrers.attach(registry, repository, digest, document)


def figures(name: str) -> benchmark.Benchmark:
    """A recorded benchmark of tests/data/bench, each level's median taken over 7 repeats (so the
    speed gate judges it)."""
    found = benchmark.from_json(json.loads((BENCH / name).read_text()), name)
    return dataclasses.replace(found, levels=tuple(dataclasses.replace(lv, repeats=7) for lv in found.levels))


def alphabet_result(measured: benchmark.Benchmark | None, moe: str = "CPU") -> VerifyResult:
    """Check ``alphabet``'s verify result as the lane keeps it: one right answer, the benchmark
    ``measured``, and the MoE backend ``moe`` read from the line vLLM logs for it."""
    line = f"Using {moe} Unquantized MoE backend out of potential backends: ['{moe}']"
    return VerifyResult(
        image="img",
        model="m",
        check="alphabet",
        startup_s=1.0,
        answers=(Answer(name="completion", api="completions", prompt="c d e f", expected=" g h i j", received=" g h i j"),),
        benchmark=measured,
        kernels=(kernelpath.Chosen(kind="moe", expected=("CPU", "TORCH"), found=((moe, line),)),),
    )
