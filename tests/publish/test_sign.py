"""Signing for real: cosign (Debian's build, fetched once and checked by sha256) signs the published
digest with a key pair made here, in the real embedded registry, before readable tags move. No
transparency log is reachable here, so the key mode runs with SPARKBUILD_COSIGN_TLOG=0, as for a
registry that stays internal; keyless signing needs a GitHub OIDC token and Sigstore (not here)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkbuild.config.options import Options, Signer
from sparkbuild.errors import PublishError
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import plan
from sparkbuild.publish import publish
from tests.support import ROOT

pytestmark = pytest.mark.docker

# Debian trixie's cosign (amd64): the deb pool keeps it by name; the hash is its Packages entry's.
COSIGN_DEB = "http://deb.debian.org/debian/pool/main/c/cosign/cosign_2.5.0-2+b5_amd64.deb"
COSIGN_SHA256 = "3b6eadd27f3c4c00bfa7eab5c2397a6a15a763630c7a1d40d06ff60d24799eef"


@pytest.fixture(scope="session")
def cosign_bin(cache: Path) -> Path:
    """A folder with ``cosign`` in it, for PATH."""
    folder = cache / "tools" / f"cosign-{COSIGN_SHA256[:12]}"
    if not (folder / "cosign").is_file():
        deb = cache / "tools" / Path(COSIGN_DEB).name
        deb.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(COSIGN_DEB, timeout=120) as response:  # a fixed URL; the hash is checked
            data = response.read()
        assert hashlib.sha256(data).hexdigest() == COSIGN_SHA256, f"{COSIGN_DEB} is not the deb this test pins"
        deb.write_bytes(data)
        (folder / "root").mkdir(parents=True)  # dpkg-deb makes one folder level, not the path to it
        subprocess.run(["dpkg-deb", "-x", str(deb), str(folder / "root")], check=True)
        (folder / "cosign").symlink_to(folder / "root" / "usr" / "bin" / "cosign")
    return folder


def key_pair(folder: Path, password: str) -> tuple[str, str]:
    folder.mkdir()
    subprocess.run(["cosign", "generate-key-pair"], cwd=folder, env={**os.environ, "COSIGN_PASSWORD": password}, check=True)
    return (folder / "cosign.key").read_text(), (folder / "cosign.pub").read_text()


@pytest.fixture
def keyed(cosign_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    monkeypatch.setenv("PATH", f"{cosign_bin}:{os.environ['PATH']}")
    private, public = key_pair(tmp_path / "keys", "test password")
    monkeypatch.setenv("SPARKBUILD_COSIGN_KEY", private)
    monkeypatch.setenv("COSIGN_PASSWORD", "test password")
    yield private, public


def local_plan() -> plan.TargetPlan:
    return plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", date="20261121"))[0]


def image(engine: Engine, base: str, name: str) -> str:
    """A small image of its own (the base plus a label), so each test signs its own digest."""
    engine.tag(base, "sparkbuild-test/sign", name)
    return f"sparkbuild-test/sign:{name}"


def signatures(registry: Registry, repository: str, digest: str) -> int:
    """How many signatures cosign stored for ``digest`` (layers of its ``sha256-<hex>.sig`` manifest)."""
    sig = registry.digest(repository, digest.replace(":", "-") + ".sig")
    if sig is None:
        return 0
    return len(json.loads(registry.manifest(repository, sig)[0])["layers"])


def test_a_published_digest_is_signed_and_checked_before_tags_move_and_once(
    keyed: tuple[str, str], engine: Engine, base: str, registry: Registry, tmp_path: Path
) -> None:
    p = local_plan()
    signer = Signer(mode="key", tlog=False)
    done = publish.push(engine, registry, p, image(engine, base, "signed"), signer=signer)
    assert done.signature == "cosign (key)"
    assert registry.digest(p.repository, "nightly") == done.digest
    assert signatures(registry, p.repository, done.digest) == 1
    # Anyone with the public key checks it, with cosign alone.
    (tmp_path / "cosign.pub").write_text(keyed[1])
    check = ["cosign", "verify", "--key", str(tmp_path / "cosign.pub"), "--insecure-ignore-tlog=true", "--allow-http-registry"]
    subprocess.run([*check, done.reference], check=True, capture_output=True)
    # A rerun that finishes the move (the content tag is there) finds the signature and adds none.
    again = publish.move_tags(registry, p, done.digest, signer=signer)
    assert again.signature == "cosign (key)" and signatures(registry, p.repository, done.digest) == 1


def test_a_signature_the_check_rejects_moves_no_tag(
    keyed: tuple[str, str], engine: Engine, base: str, registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check is made with another key's public half: as if the runner signed with the wrong key.
    _, other = key_pair(tmp_path / "other", "another password")
    monkeypatch.setenv("SPARKBUILD_COSIGN_PUB", other)
    p = local_plan()
    with pytest.raises(PublishError, match=r"checking the signature of .* failed .*readable tags were not moved"):
        publish.push(engine, registry, p, image(engine, base, "rejected"), signer=Signer(mode="key", tlog=False))
    assert registry.digest(p.repository, "nightly") is None
    assert registry.digest(p.repository, f"{p.id}-last-good") is None


def test_without_a_signer_publish_says_the_image_is_unsigned(
    engine: Engine, base: str, registry: Registry, capfd: pytest.CaptureFixture[str]
) -> None:
    done = publish.push(engine, registry, local_plan(), image(engine, base, "unsigned"), signer=Signer.from_env("auto", {}))
    assert done.signature == "unsigned"
    assert f"{done.reference}: not signed: no signer configured" in capfd.readouterr().err
