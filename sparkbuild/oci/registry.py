"""Registries: a small HTTP client for the distribution API, and the embedded registry.

Publishing needs only three calls: the digest behind a tag, a manifest by digest, and putting a
manifest under a new tag (moving a readable tag without pushing anything again); ``gc`` adds the
tag list, an image's config blob and deleting a manifest. Each call is
retried (tenacity) on what may pass: 408, 429 (as long as Retry-After asks, within a bound), 5xx,
connection resets and timeouts; the limits are in ``defaults.yaml`` (``registry:``). Credentials go
to the registry's own host, and to a token service only on that host or one allowed by name.
"""

from __future__ import annotations

import ctypes
import email.utils
import hashlib
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
import tenacity

from sparkbuild import __version__
from sparkbuild.config import options
from sparkbuild.config.options import Limits, default_limits
from sparkbuild.errors import EngineError, PublishError, ToolMissingError
from sparkbuild.util import cmd, fsutil, log, runlock, signals
from sparkbuild.util.net import check_address, free_port, is_loopback

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
USER_AGENT = f"sparkbuild/{__version__}"
# Worth another try: the registry or something in front of it may recover.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# What each refusal means and what to do; these are never retried.
REFUSED = {
    400: "the registry refused the request as malformed (a repository or tag it does not accept?)",
    401: "not authorized: set SPARKBUILD_REGISTRY_USER and SPARKBUILD_REGISTRY_PASSWORD, or check them",
    403: "forbidden: these credentials may not do this on this repository; ask the registry's owner for access",
    404: "not found: no such repository or manifest here; check --registry and the repository name",
}


def _authority(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


def file_digest(path: Path) -> tuple[str, int]:
    """``sha256:<hex>`` of a file, read in chunks, and its size."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    return "sha256:" + digest.hexdigest(), path.stat().st_size


def _rewind(data: object) -> None:
    """A file body is sent from its start on every try (a retry, or the repeat after a token)."""
    seek = getattr(data, "seek", None)
    if callable(seek):
        seek(0)


class _Transient(Exception):
    """An answer worth another try (408, 429, 5xx); carries what Retry-After asked for."""

    def __init__(self, response: requests.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.retry_after = _retry_after(response.headers.get("Retry-After"))


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds: a number of seconds or an HTTP date."""
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class _Backoff(tenacity.wait.wait_base):
    """Full-jitter exponential backoff; a Retry-After the registry sends is honoured up to a bound."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.jitter = tenacity.wait_random_exponential(multiplier=limits.backoff_initial_s, max=limits.backoff_max_s)

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        wait = float(self.jitter(retry_state))
        error = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(error, _Transient) and error.retry_after is not None:
            wait = max(wait, min(error.retry_after, self.limits.retry_after_max_s))
        return wait


RETRIED = (_Transient, requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


def _retried(error: BaseException) -> bool:
    # A certificate problem stays a problem: only the network and the registry's mood pass.
    return isinstance(error, RETRIED) and not isinstance(error, requests.exceptions.SSLError)


def _say_retry(state: tenacity.RetryCallState, what: str, attempts: int) -> None:
    error = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0.0
    reason = str(error) if isinstance(error, _Transient) else type(error).__name__
    log.info(f"  {what}: {reason} (try {state.attempt_number} of {attempts}); trying again in {wait:.1f}s")


@dataclass(frozen=True, kw_only=True)
class Stored:
    """A manifest the registry took: its digest, and the subject it says it indexed (if any)."""

    digest: str
    subject: str | None


@dataclass(frozen=True)
class Registry:
    """A registry at ``host`` (``127.0.0.1:5000``); plain HTTP only on loopback, HTTPS elsewhere."""

    host: str
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    limits: Limits = field(default_factory=default_limits, repr=False)
    # Token services other than the registry's own host that may receive its credentials.
    token_hosts: tuple[str, ...] = ()

    @classmethod
    def parse(cls, address: str, limits: Limits | None = None, token_hosts: tuple[str, ...] = ()) -> Registry:
        host = check_address(address)
        return cls(
            host,
            options.env("SPARKBUILD_REGISTRY_USER"),
            options.env("SPARKBUILD_REGISTRY_PASSWORD"),
            limits or default_limits(),
            token_hosts,
        )

    @property
    def base_url(self) -> str:
        return f"{'http' if is_loopback(self.host) else 'https'}://{self.host}/v2"

    @property
    def _auth(self) -> tuple[str, str] | None:
        return (self.username, self.password) if self.username and self.password else None

    def _request(
        self, method: str, url: str, what: str, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> requests.Response:
        """One call, tried again on what may pass; what fails for good is a PublishError saying what it was."""
        stop = tenacity.stop_after_attempt(self.limits.attempts) | tenacity.stop_after_delay(self.limits.give_up_after_s)
        retrying = tenacity.Retrying(
            stop=stop,
            wait=_Backoff(self.limits),
            retry=tenacity.retry_if_exception(_retried),
            before_sleep=lambda state: _say_retry(state, what, self.limits.attempts),
            reraise=True,
        )
        start = time.monotonic()
        try:
            for attempt in retrying:
                with attempt:
                    response = self._exchange(method, url, headers or {}, **kwargs)
                    if response.status_code in TRANSIENT_STATUS:
                        raise _Transient(response)
        except _Transient as exc:
            tries = retrying.statistics.get("attempt_number", 1)
            raise PublishError(
                f"registry {self.host}: {what} still gave HTTP {exc.response.status_code} after {tries} tries in "
                f"{time.monotonic() - start:.0f}s{_errors(exc.response)}; it may be overloaded or out of disk "
                "(its log says which); rerun later",
                unreachable=True,
            ) from None
        except requests.RequestException as exc:
            raise PublishError(
                f"registry {self.host}: {what} failed: {type(exc).__name__}: {str(exc)[:200]}; "
                "check that it runs and that this machine reaches it, then rerun",
                unreachable=True,
            ) from None
        return response

    def _exchange(self, method: str, url: str, headers: dict[str, str], **kwargs: Any) -> requests.Response:
        """One HTTP exchange; a ``WWW-Authenticate: Bearer realm=...`` challenge (Docker Hub, nvcr.io,
        ghcr.io) is answered with a token from that realm and the request repeated once."""
        headers = {"User-Agent": USER_AGENT, **headers}
        timeout = self.limits.timeout_s
        _rewind(kwargs.get("data"))
        response = requests.request(method, url, auth=self._auth, headers=headers, timeout=timeout, **kwargs)
        challenge = response.headers.get("WWW-Authenticate", "")
        if response.status_code == 401 and challenge.lower().startswith("bearer "):
            bearer = {**headers, "Authorization": f"Bearer {self._bearer_token(challenge)}"}
            _rewind(kwargs.get("data"))
            response = requests.request(method, url, headers=bearer, timeout=timeout, **kwargs)
        return response

    def _bearer_token(self, challenge: str) -> str:
        """A token from the challenge's realm: with this registry's credentials only where they may go."""
        fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = fields.pop("realm", "")
        scheme, host, _ = _authority(realm)
        if scheme not in ("http", "https") or not host:
            raise PublishError(f"registry {self.host} asked for a token from '{realm}', which is not an http(s) URL")
        if scheme == "http" and not is_loopback(urlsplit(realm).netloc):
            raise PublishError(
                f"registry {self.host} asked for a token over plain HTTP from {realm}; refused (plain HTTP only on loopback)"
            )
        auth = self._auth if self._may_send_credentials(realm) else None
        if self._auth and auth is None:
            log.warning(
                f"registry {self.host}: its credentials are not sent to the token service {realm} (another host); "
                f"if that service is the registry's own, allow it by name: SPARKBUILD_TOKEN_REALMS={host}"
            )
        headers = {"User-Agent": USER_AGENT}
        response = requests.get(realm, params=fields, auth=auth, headers=headers, timeout=self.limits.timeout_s)
        if response.status_code in TRANSIENT_STATUS:
            raise _Transient(response)
        if response.status_code != 200:
            raise PublishError(f"token service {realm} gave HTTP {response.status_code} for {fields.get('scope', '')}")
        try:
            data = response.json()
        except ValueError:
            raise PublishError(f"token service {realm} answered with something that is not JSON") from None
        return str(data.get("token") or data.get("access_token") or "") if isinstance(data, dict) else ""

    def _may_send_credentials(self, realm: str) -> bool:
        """The registry's own scheme, host and port, or a host named in ``token_hosts``."""
        if _authority(realm) == _authority(self.base_url):
            return True
        netloc = urlsplit(realm).netloc.lower()
        host = (urlsplit(realm).hostname or "").lower()
        return any(allowed.lower() in (netloc, host) for allowed in self.token_hosts)

    def ping(self) -> bool:
        """The registry answers ``GET /v2/`` (200, or 401 before credentials), after retries."""
        try:
            return self._request("GET", f"{self.base_url}/", "GET /v2/").status_code in (200, 401)
        except PublishError:
            return False

    def answers(self) -> bool:
        """One quick ``GET /v2/`` without retries (waiting for a registry to start)."""
        try:
            return requests.get(f"{self.base_url}/", timeout=2, headers={"User-Agent": USER_AGENT}).status_code in (200, 401)
        except requests.RequestException:
            return False

    def _manifest_call(
        self, method: str, repository: str, reference: str, what: str, *, missing_ok: bool
    ) -> requests.Response | None:
        """``method`` on the manifest ``reference`` (a tag or a digest), accepting every manifest type;
        None for a 404 where ``missing_ok``, a refusal raised for anything else but 200."""
        url = f"{self.base_url}/{repository}/manifests/{reference}"
        response = self._request(method, url, what, headers={"Accept": ", ".join(MANIFEST_TYPES)})
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code != 200:
            raise self._refused(response, what)
        return response

    def digest(self, repository: str, reference: str) -> str | None:
        """The manifest digest behind a tag, or None when the tag does not exist (404)."""
        what = f"HEAD {repository}:{reference}"
        response = self._manifest_call("HEAD", repository, reference, what, missing_ok=True)
        if response is None:
            return None
        digest = response.headers.get("Docker-Content-Digest", "")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise PublishError(f"registry {self.host}: {what} answered without a sha256 Docker-Content-Digest header")
        return digest

    def tagged(self, repository: str, tag: str) -> tuple[str, bytes] | None:
        """The manifest ``tag`` names, and its digest (the sha256 of the bytes served), in one GET where
        ``digest`` and ``manifest`` take two; None when the tag does not exist (404)."""
        response = self._manifest_call("GET", repository, tag, f"GET {repository}:{tag}", missing_ok=True)
        if response is None:
            return None
        return "sha256:" + hashlib.sha256(response.content).hexdigest(), response.content

    def manifest(self, repository: str, digest: str) -> tuple[bytes, str]:
        """A manifest by digest, checked against that digest."""
        what = f"GET {repository}@{digest}"
        response = self._manifest_call("GET", repository, digest, what, missing_ok=False)
        assert response is not None  # a 404 was raised as a refusal
        body = response.content
        actual = "sha256:" + hashlib.sha256(body).hexdigest()
        if actual != digest:
            raise PublishError(f"registry {self.host} served {repository}@{digest} with content digest {actual}")
        return body, response.headers.get("Content-Type", MANIFEST_TYPES[-1])

    def put_tag(self, repository: str, tag: str, body: bytes, media_type: str) -> str:
        return self.put_manifest(repository, tag, body, media_type).digest

    def put_manifest(self, repository: str, reference: str, body: bytes, media_type: str) -> Stored:
        """PUT a manifest under a tag or its own digest; what the registry answered."""
        what = f"PUT {repository}:{reference}" if ":" not in reference else f"PUT {repository}@{reference}"
        response = self._request(
            "PUT", f"{self.base_url}/{repository}/manifests/{reference}", what, data=body, headers={"Content-Type": media_type}
        )
        if response.status_code not in (200, 201):
            raise self._refused(response, what)
        # OCI distribution 1.1: a registry that keeps the referrers index itself says so with OCI-Subject.
        return Stored(digest=response.headers.get("Docker-Content-Digest", ""), subject=response.headers.get("OCI-Subject"))

    def upload_blob(self, repository: str, data: bytes) -> str:
        """Put a blob (one POST and PUT: attached documents are small), unless the registry has it; its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        what = f"upload blob {repository}@{digest}"
        if self._request("HEAD", f"{self.base_url}/{repository}/blobs/{digest}", what).status_code == 200:
            return digest
        start = self._request("POST", f"{self.base_url}/{repository}/blobs/uploads/", what)
        if start.status_code != 202 or "Location" not in start.headers:
            raise self._refused(start, what)
        location = urljoin(self.base_url, start.headers["Location"])
        done = self._request(
            "PUT", location, what, params={"digest": digest}, data=data, headers={"Content-Type": "application/octet-stream"}
        )
        if done.status_code != 201:
            raise self._refused(done, what)
        return digest

    def upload_file(self, repository: str, path: Path) -> tuple[str, int]:
        """Put a file as a blob, streamed from disk (a wheel may be a gigabyte), unless the registry
        has it; its digest and size. A retried PUT sends the file again from its start."""
        digest, size = file_digest(path)
        what = f"upload {path.name} to {repository}@{digest}"
        if self._request("HEAD", f"{self.base_url}/{repository}/blobs/{digest}", what).status_code == 200:
            return digest, size
        start = self._request("POST", f"{self.base_url}/{repository}/blobs/uploads/", what)
        if start.status_code != 202 or "Location" not in start.headers:
            raise self._refused(start, what)
        location = urljoin(self.base_url, start.headers["Location"])
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        with path.open("rb") as body:
            done = self._request("PUT", location, what, params={"digest": digest}, data=body, headers=headers)
        if done.status_code != 201:
            raise self._refused(done, what)
        return digest, size

    def download_blob(self, repository: str, digest: str, dest: Path) -> int:
        """Stream a blob into ``dest`` (through a temporary file beside it, renamed only once its
        content matches ``digest``); its size."""
        what = f"GET blob {repository}@{digest}"
        response = self._request("GET", f"{self.base_url}/{repository}/blobs/{digest}", what, stream=True)
        if response.status_code != 200:
            raise self._refused(response, what)
        partial = dest.with_name(f".{dest.name}.partial")
        hasher, size = hashlib.sha256(), 0
        try:
            with response, partial.open("wb") as out:
                for chunk in response.iter_content(chunk_size=1 << 20):
                    hasher.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
        except requests.RequestException as exc:
            partial.unlink(missing_ok=True)
            broke = f"{what} broke off after {size} bytes ({type(exc).__name__})"
            raise PublishError(f"registry {self.host}: {broke}; nothing written, rerun") from None
        if "sha256:" + hasher.hexdigest() != digest:
            partial.unlink()
            raise PublishError(f"registry {self.host} served blob {repository}@{digest} with other content; nothing written")
        partial.replace(dest)
        return size

    def referrers(self, repository: str, digest: str) -> list[dict[str, Any]] | None:
        """The manifests whose subject is ``digest``, from the referrers API (OCI distribution 1.1);
        None where the registry has no such API (404), so the caller reads the fallback tag."""
        what = f"GET {repository} referrers of {digest}"
        response = self._request("GET", f"{self.base_url}/{repository}/referrers/{digest}", what)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._refused(response, what)
        try:
            return list(response.json().get("manifests") or [])
        except (ValueError, AttributeError):
            raise PublishError(f"registry {self.host}: {what} answered with something that is not an image index") from None

    def tags(self, repository: str) -> list[str]:
        """Every tag of ``repository`` (none when it does not exist), page by page as the registry
        links them (``Link: <...>; rel="next"``)."""
        found: list[str] = []
        url: str | None = f"{self.base_url}/{repository}/tags/list?n=1000"
        while url is not None:
            what = f"GET {repository} tags"
            response = self._request("GET", url, what)
            if response.status_code == 404:
                return found
            if response.status_code != 200:
                raise self._refused(response, what)
            found += (response.json() or {}).get("tags") or []
            following = response.links.get("next", {}).get("url")
            url = None if following is None else urljoin(self.base_url, following)
        return found

    def blob(self, repository: str, digest: str) -> bytes:
        """A blob (an image's config) by digest, checked against that digest."""
        what = f"GET blob {repository}@{digest}"
        response = self._request("GET", f"{self.base_url}/{repository}/blobs/{digest}", what)
        if response.status_code != 200:
            raise self._refused(response, what)
        if "sha256:" + hashlib.sha256(response.content).hexdigest() != digest:
            raise PublishError(f"registry {self.host} served blob {repository}@{digest} with other content")
        return response.content

    def delete(self, repository: str, digest: str) -> None:
        """Delete a manifest by digest: every tag on it goes too. Its blobs stay until the registry's
        own garbage collection runs."""
        what = f"DELETE {repository}@{digest}"
        response = self._request("DELETE", f"{self.base_url}/{repository}/manifests/{digest}", what)
        if response.status_code == 405:
            raise PublishError(
                f"registry {self.host}: {what} gave HTTP 405: this registry does not allow deletes; "
                "enable them (distribution: storage.delete.enabled: true, or REGISTRY_STORAGE_DELETE_ENABLED=true)"
            )
        if response.status_code not in (200, 202, 404):
            raise self._refused(response, what)

    def _refused(self, response: requests.Response, what: str) -> PublishError:
        meaning = REFUSED.get(response.status_code, "an answer sparkbuild does not expect here")
        return PublishError(f"registry {self.host}: {what} gave HTTP {response.status_code}{_errors(response)}: {meaning}")


def _errors(response: requests.Response) -> str:
    """The registry's own error codes and messages (``{"errors": [{"code", "message"}]}``), if any."""
    try:
        found = response.json().get("errors") or []
        text = "; ".join(f"{e.get('code', '')} {e.get('message', '')}".strip() for e in found if isinstance(e, dict))
    except (ValueError, AttributeError):
        text = ""
    return f" ({text[:200]})" if text else ""


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


def _die_with_parent() -> None:
    """In the registry's process, before exec: SIGTERM it when sparkbuild dies, even by kill -9."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1


@contextmanager
def embedded(data: Path, limits: Limits | None = None) -> Iterator[Registry]:
    """Run Debian's ``docker-registry`` on 127.0.0.1 with its data in ``data``; stop it after.

    One registry at a time uses a data folder (a lock beside its storage), with its own config;
    it runs in its own session (a Ctrl-C reaches sparkbuild, which stops it) and dies with
    sparkbuild if sparkbuild is killed.
    """
    binary = shutil.which("docker-registry")
    if binary is None:
        raise ToolMissingError(
            "no registry configured and docker-registry is not installed: "
            "apt-get install docker-registry, or set SPARKBUILD_REGISTRY=host:port"
        )
    with runlock.hold(data / "registry.lock", f"the embedded registry's storage in {data}"):
        for attempt in range(3):  # the free port may be taken before the registry binds it
            port = _port(data, first=attempt == 0)
            (data / "storage").mkdir(parents=True, exist_ok=True)
            config = data / "config.yml"
            fsutil.write_text(config, CONFIG.format(root=data / "storage", port=port))
            args = [binary, "serve", str(config)]
            log.info(cmd.show(args))
            held = signals.Held()
            with held, (data / "registry.log").open("ab") as sink:
                proc = subprocess.Popen(
                    args, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
                )
            registry = Registry(f"127.0.0.1:{port}", limits=limits or default_limits())
            try:
                held.deliver()
                if _started(proc, registry):
                    log.info(f"embedded registry at {registry.host} (data in {data})")
                    yield registry
                    return
            finally:
                _stop(proc)
            log.warning(f"embedded registry did not start on port {port} (try {attempt + 1} of 3)")
        raise EngineError(f"embedded registry did not start; see {data / 'registry.log'}")


def embedded_address(data: Path) -> str | None:
    """The address the embedded registry of ``data`` had last (and takes again where the port is
    free); None where it never ran."""
    try:
        port = int((data / "port").read_text())
    except (OSError, ValueError):
        return None
    return f"127.0.0.1:{port}"


def _port(data: Path, *, first: bool) -> int:
    """The port this storage's registry had last time, where it is free; else a new one, kept.

    Docker remembers which layers it pushed to which host:port. At the same address, the next push
    of an image that shares layers with one already in the storage mounts them (any repository)
    instead of compressing and sending them again: seconds instead of minutes for a vLLM image."""
    saved = data / "port"
    if first:
        try:
            port = int(saved.read_text())
        except (OSError, ValueError):
            port = 0
        if 1024 <= port <= 65535 and _is_free(port):
            return port
    port = free_port()
    fsutil.write_text(saved, f"{port}\n")
    return port


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the registry binds (Go sets SO_REUSEADDR): a port in TIME_WAIT is free to it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _started(proc: subprocess.Popen[bytes], registry: Registry) -> bool:
    deadline = time.monotonic() + 30
    # It answers within tens of ms here: asked at 5, 10, 20 ... ms, then every 0.1 s, a lane does
    # not wait a whole tenth of a second for it (a nightly with nothing to build takes about one).
    pause = 0.005
    while not registry.answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    return True


def _stop(proc: subprocess.Popen[bytes]) -> None:
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
