"""Registries: a small HTTP client for the distribution API, and the embedded registry.

Publishing needs only three calls: the digest behind a tag, a manifest by digest, and putting a
manifest under a new tag (moving a readable tag without pushing anything again).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from builder import cmd, log
from builder.errors import EngineError, PublishError, ToolMissingError

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)


@dataclass(frozen=True)
class Registry:
    """A registry at ``host`` (``127.0.0.1:5000``); plain HTTP on loopback, HTTPS elsewhere."""

    host: str
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, address: str) -> Registry:
        host = address.removeprefix("http://").removeprefix("https://").rstrip("/")
        return cls(host, os.environ.get("SPARKBUILD_REGISTRY_USER"), os.environ.get("SPARKBUILD_REGISTRY_PASSWORD"))

    @property
    def base_url(self) -> str:
        loopback = self.host.startswith(("127.", "localhost", "[::1]"))
        return f"{'http' if loopback else 'https'}://{self.host}/v2"

    @property
    def _auth(self) -> tuple[str, str] | None:
        return (self.username, self.password) if self.username and self.password else None

    def _request(self, method: str, url: str, headers: dict[str, str] | None = None, **kwargs: object) -> requests.Response:
        """One request; a ``WWW-Authenticate: Bearer realm=...,service=...,scope=...`` challenge
        (Docker Hub, nvcr.io, ghcr.io) is answered with a token from that realm and the request repeated once."""
        try:
            response = requests.request(method, url, auth=self._auth, headers=headers, timeout=60, **kwargs)  # type: ignore[arg-type]
            challenge = response.headers.get("WWW-Authenticate", "")
            if response.status_code == 401 and challenge.lower().startswith("bearer "):
                bearer = {**(headers or {}), "Authorization": f"Bearer {self._bearer_token(challenge)}"}
                response = requests.request(method, url, headers=bearer, timeout=60, **kwargs)  # type: ignore[arg-type]
        except requests.RequestException as exc:
            raise PublishError(f"registry {self.host} did not answer: {exc}") from None
        return response

    def _bearer_token(self, challenge: str) -> str:
        """A token from the challenge's realm: anonymous, or with this registry's credentials."""
        fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = fields.pop("realm", "")
        if not realm:
            raise PublishError(f"registry {self.host} asked for a token without a realm: {challenge}")
        response = requests.get(realm, params=fields, auth=self._auth, timeout=60)
        if response.status_code != 200:
            raise PublishError(f"token service {realm} gave HTTP {response.status_code} for {fields.get('scope', '')}")
        data = response.json()
        return str(data.get("token") or data.get("access_token") or "")

    def ping(self) -> bool:
        try:
            return requests.get(f"{self.base_url}/", timeout=2).status_code in (200, 401)
        except requests.RequestException:
            return False

    def digest(self, repository: str, reference: str) -> str | None:
        """The manifest digest behind a tag, or None when the tag does not exist."""
        response = self._request(
            "HEAD", f"{self.base_url}/{repository}/manifests/{reference}", headers={"Accept": ", ".join(MANIFEST_TYPES)}
        )
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise PublishError(f"registry {self.host}: HEAD {repository}:{reference} gave HTTP {response.status_code}")
        return response.headers["Docker-Content-Digest"]

    def manifest(self, repository: str, digest: str) -> tuple[bytes, str]:
        """A manifest by digest, checked against that digest."""
        response = self._request(
            "GET", f"{self.base_url}/{repository}/manifests/{digest}", headers={"Accept": ", ".join(MANIFEST_TYPES)}
        )
        if response.status_code != 200:
            raise PublishError(f"registry {self.host}: GET {repository}@{digest} gave HTTP {response.status_code}")
        body = response.content
        actual = "sha256:" + hashlib.sha256(body).hexdigest()
        if actual != digest:
            raise PublishError(f"registry {self.host} served {repository}@{digest} with content digest {actual}")
        return body, response.headers["Content-Type"]

    def put_tag(self, repository: str, tag: str, body: bytes, media_type: str) -> str:
        response = self._request(
            "PUT", f"{self.base_url}/{repository}/manifests/{tag}", data=body, headers={"Content-Type": media_type}
        )
        if response.status_code not in (200, 201):
            raise PublishError(
                f"registry {self.host}: PUT {repository}:{tag} gave HTTP {response.status_code}: {response.text[:300]}"
            )
        return response.headers.get("Docker-Content-Digest", "")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


CONFIG = """\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


@contextmanager
def embedded(data: Path) -> Iterator[Registry]:
    """Run Debian's ``docker-registry`` on 127.0.0.1 with its data in ``data``; stop it after."""
    binary = shutil.which("docker-registry")
    if binary is None:
        raise ToolMissingError(
            "no registry configured and docker-registry is not installed: "
            "apt-get install docker-registry, or set SPARKBUILD_REGISTRY=host:port"
        )
    port = free_port()
    (data / "storage").mkdir(parents=True, exist_ok=True)
    config = data / "config.yml"
    config.write_text(CONFIG.format(root=data / "storage", port=port))
    args = [binary, "serve", str(config)]
    log.info(cmd.show(args))
    with (data / "registry.log").open("ab") as sink:
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT)
    registry = Registry(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while not registry.ping():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise EngineError(f"embedded registry did not start; see {data / 'registry.log'}")
            time.sleep(0.1)
        log.info(f"embedded registry at {registry.host} (data in {data})")
        yield registry
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- resolving an image name to its digest ---------------------------------------------------

DOCKER_HUB = "registry-1.docker.io"


def split_image(image: str) -> tuple[str, str, str]:
    """``nvidia/cuda:13.0.2-devel`` -> (registry host, repository, tag), Docker's naming rules."""
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return first, rest, tag
    return DOCKER_HUB, name if "/" in name else f"library/{name}", tag


def image_digest(image: str) -> str:
    """The manifest digest (the multi-platform index where there is one) that ``image`` names now."""
    host, repository, tag = split_image(image)
    digest = Registry(host).digest(repository, tag)
    if digest is None:
        raise PublishError(f"{image}: {host} has no tag '{tag}' in {repository}; fix 'image:' under bases: in the matrix")
    return digest
