"""The one place that talks to the container engine.

Builds go through the BuildKit CLI (``docker buildx build``, or ``DOCKER_BUILDKIT=1 docker build``
with a pre-23 client that has BuildKit built in): the docker SDK only drives the legacy builder,
which has no cache mounts and no secrets. Everything else (inspect, import, run, logs, tag, push)
goes through the SDK.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Literal, overload

import docker
import docker.auth
import docker.errors
import requests
from docker.models.containers import Container as SdkContainer

from sparkbuild.config import options
from sparkbuild.errors import BuildError, EngineError
from sparkbuild.oci.buildkit import BuildCli, find_build_cli
from sparkbuild.util import cmd, host, log, signals

ENGINE_HELP = (
    "start a Docker engine (on Debian: apt-get install docker.io, then "
    "dockerd --bridge=none --iptables=false --ip-masq=false &) or point DOCKER_HOST at one"
)


@dataclass(frozen=True, kw_only=True)
class EngineFacts:
    """What ``sparkbuild doctor`` reads of the engine: whether it answers, what it is, where it keeps
    images, and the docker CLI that drives BuildKit (found whether or not the engine answers)."""

    address: str
    reachable: bool
    error: str | None = None
    version: str | None = None
    # ``uname -m`` of the machine the engine runs on (x86_64, aarch64).
    architecture: str | None = None
    root: str | None = None
    runtimes: tuple[str, ...] = ()
    cli: BuildCli | None = None
    cli_error: str | None = None


def probe(timeout_s: float = 10) -> EngineFacts:
    """Ask the engine what it is, within ``timeout_s``; never raises for an engine that is not there."""
    address = options.env("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        cli, cli_error = find_build_cli(), None
    except EngineError as exc:
        cli, cli_error = None, str(exc)
    try:
        client = docker.from_env(timeout=timeout_s)
        client.ping()
        info: dict[str, Any] = client.info()
        version = str(client.version().get("Version") or info.get("ServerVersion") or "unknown")
    except (docker.errors.DockerException, requests.RequestException) as exc:
        return EngineFacts(
            address=address,
            reachable=False,
            error=f"no Docker engine answers at {address} ({_cause(exc)}); {ENGINE_HELP}",
            cli=cli,
            cli_error=cli_error,
        )
    return EngineFacts(
        address=address,
        reachable=True,
        version=version,
        architecture=str(info.get("Architecture") or "") or None,
        root=str(info.get("DockerRootDir") or "") or None,
        runtimes=tuple(sorted(info.get("Runtimes") or {})),
        cli=cli,
        cli_error=cli_error,
    )


def _cause(exc: Exception) -> str:
    """The operating system's words under docker-py's wrapping (``[Errno 111] Connection refused``)."""
    text = str(exc)
    found = re.search(r"\[Errno \d+\] [^'\")]+", text) or re.search(r"\w+Error\(\d+, '([^']+)'\)", text)
    if found is None:
        return text
    return found.group(1) if found.lastindex else found.group(0)


@dataclass(frozen=True)
class CacheRecord:
    """One record of BuildKit's cache, as ``docker system df -v`` lists it."""

    id: str
    size: int
    # BuildKit's kind: "regular" (a layer), "exec.cachemount" (a RUN --mount=type=cache), "source.local" (a context).
    kind: str
    # An image holds its layer: removing the record frees nothing on disk.
    shared: bool
    in_use: bool
    # When BuildKit made it, in seconds since the epoch.
    created: float
    # What made it ("mount / from exec /bin/sh -c ...", "local source for context").
    description: str

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> CacheRecord:
        return cls(
            id=str(raw["ID"]),
            size=int(raw.get("Size") or 0),
            kind=str(raw.get("Type") or ""),
            shared=bool(raw.get("Shared")),
            in_use=bool(raw.get("InUse")),
            created=_epoch(str(raw["CreatedAt"])),
            description=str(raw.get("Description") or ""),
        )


def _epoch(stamp: str) -> float:
    """An RFC 3339 time as the engine writes it (nanoseconds, ``Z``) in seconds since the epoch
    (Python 3.11's ``fromisoformat`` reads six digits of a second at most)."""
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", stamp)).timestamp()


class PushFailed(Exception):
    """The daemon gave up on a push (``publish`` decides whether to push again)."""


class PushStalled(PushFailed):
    """A push made no progress for too long or passed its deadline: pushing again would only wait on
    the same stalled upload, which the daemon keeps until the registry drops it."""


class Container:
    """A running container; ``Engine.run`` removes it on exit, whatever happens."""

    def __init__(self, sdk: SdkContainer) -> None:
        self._sdk = sdk

    @property
    def name(self) -> str:
        return str(self._sdk.name)

    def _reload(self) -> None:
        """Docker's record of it now; an engine that no longer answers (another machine's, lost) or a
        container gone from it is an EngineError naming the container."""
        try:
            self._sdk.reload()
        except (docker.errors.DockerException, requests.RequestException) as exc:
            raise EngineError(f"the engine that ran container {self.name} cannot say how it stands ({exc})") from None

    def running(self) -> bool:
        self._reload()
        return self._sdk.status in ("created", "running")

    def exit_code(self) -> int | None:
        self._reload()
        code = self._sdk.attrs.get("State", {}).get("ExitCode")
        return None if self._sdk.status in ("created", "running") else int(code)

    def logs(self, tail: int | None = 40) -> str:
        """The last ``tail`` lines of its output (stdout and stderr), or all of it."""
        data: bytes = self._sdk.logs(tail="all" if tail is None else tail)
        return data.decode(errors="replace")

    def finished_at(self) -> str:
        """When its main process ended, as Docker records it (RFC 3339, so ordered as text; "" while it runs)."""
        self._reload()
        return "" if self._sdk.status in ("created", "running") else str(self._sdk.attrs.get("State", {}).get("FinishedAt", ""))

    def kill(self) -> None:
        """Stop it now (SIGKILL); one already stopped is left as it is."""
        try:
            self._sdk.kill()
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: not running, which is what was asked
                raise EngineError(f"could not stop the container {self.name}: {exc.explanation}") from None

    def state(self) -> ServerState:
        """How the container stands now: running, or how it ended (exit code, signal, OOM kill)."""
        self._reload()
        raw: dict[str, Any] = self._sdk.attrs.get("State", {})
        return ServerState.of(raw)


@dataclass(frozen=True, kw_only=True)
class ServerState:
    """Docker's ``State`` of a container, in the terms a person asks about a server that failed."""

    status: str
    exit_code: int | None
    oom_killed: bool
    error: str

    @classmethod
    def of(cls, raw: dict[str, Any]) -> ServerState:
        status = str(raw.get("Status", "unknown"))
        code = raw.get("ExitCode")
        ended = status not in ("created", "running", "restarting")
        return cls(
            status=status,
            exit_code=int(code) if ended and code is not None else None,
            oom_killed=bool(raw.get("OOMKilled", False)),
            error=str(raw.get("Error") or ""),
        )

    @property
    def signal(self) -> str | None:
        """The signal that ended the main process (exit code 128+N), by name."""
        if self.exit_code is None or self.exit_code <= 128:
            return None
        try:
            return signal.Signals(self.exit_code - 128).name
        except ValueError:
            return None

    def text(self) -> str:
        if self.exit_code is None:
            text = f"still {self.status}" if self.status in ("running", "created") else self.status
        else:
            text = f"exited with code {self.exit_code}"
            if self.signal:
                text += f" ({self.signal})"
        if self.oom_killed:
            text += ", killed by the kernel's OOM killer (give the engine more memory)"
        if self.error:
            text += f", engine error: {self.error}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "oom_killed": self.oom_killed,
            "error": self.error,
            "text": self.text(),
        }


# What the engine lays over every container's file system (moby's init layer, daemon/initlayer): in
# an export these are the container's (empty files, mount points), not the image's.
CONTAINER_PATHS = frozenset(
    {".dockerenv", "dev/console", "dev/pts", "dev/shm", "etc/hostname", "etc/hosts", "etc/mtab", "etc/resolv.conf", "proc", "sys"}
)

# The label of the named volumes sparkbuild makes for what servers compile (vLLM, inductor, Triton).
CACHE_LABEL = "io.sparkbuild.cache"

GPU_HELP = (
    "this image serves on the GPU: run it where Docker has the NVIDIA Container Toolkit "
    "(on a DGX Spark it is installed; elsewhere: nvidia-ctk runtime configure --runtime=docker)"
)


def gpu_options(gpus: bool) -> dict[str, Any]:
    """What the SDK is asked for a server that uses the GPU, as NVIDIA's DGX Spark playbook runs
    vLLM (``--gpus all --ipc host``): every GPU, and the host's IPC namespace for NCCL and torch's
    shared memory. Nothing for a CPU server."""
    if not gpus:
        return {}
    return {"device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])], "ipc_mode": "host"}


class Engine:
    def __init__(self, base_url: str | None = None, *, where: str = "") -> None:
        """This machine's engine (DOCKER_HOST, else Docker's socket), or the one at ``base_url`` (another
        machine's, forwarded: sparkbuild/oci/remote.py), which ``where`` names in errors."""
        try:
            self.client = (
                docker.from_env(timeout=600) if base_url is None else docker.DockerClient(base_url=base_url, timeout=600)
            )
        except docker.errors.DockerException as exc:
            raise no_answer(exc, base_url, where) from None
        try:
            self.client.ping()
        except docker.errors.DockerException as exc:
            self.client.close()  # the connection it tried, let go of
            raise no_answer(exc, base_url, where) from None
        self._cli: BuildCli | None = None

    def close(self) -> None:
        """Let go of the engine's connections (an engine reached for a while: another machine's, or a test's)."""
        self.client.close()

    @property
    def cli(self) -> BuildCli:
        if self._cli is None:
            self._cli = find_build_cli()
        return self._cli

    def cpus(self) -> int:
        """The CPUs of the machine the engine runs its containers on (``docker info``'s NCPU)."""
        try:
            return int(self.client.info()["NCPU"])
        except (docker.errors.DockerException, KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"the Docker engine does not say how many CPUs it has ({exc!r})") from None

    # --- images ----------------------------------------------------------------------------

    def image_exists(self, ref: str) -> bool:
        try:
            self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            return False
        return True

    def inspect(self, ref: str) -> dict[str, Any]:
        try:
            attrs: dict[str, Any] = self.client.images.get(ref).attrs
        except docker.errors.ImageNotFound:
            raise EngineError(f"image {ref} is not in the engine; build or pull it first") from None
        return attrs

    def import_rootfs(self, root: Path, ref: str, platform: str, log_file: Path) -> str:
        """An image of a root file system folder, for ``platform``: ``FROM scratch`` and the folder's tar
        ``ADD``ed, built by BuildKit. Not ``docker import``: an engine of 20.10 records the host's
        architecture in what it imports, whatever ``--platform`` says, and BuildKit, building ``FROM``
        that image for another platform, then looks for it on Docker Hub instead (issue 43)."""
        with tempfile.TemporaryDirectory(dir=root.parent, prefix="import-") as tmp:
            context = Path(tmp)
            with tarfile.open(context / "rootfs.tar", "w") as tar:
                tar.add(root, arcname=".")
            # ADD unpacks a local tar archive (owners, modes and links as archived); nothing runs on
            # the image's platform, so a foreign root is made without emulation.
            (context / "Dockerfile").write_text("FROM scratch\nADD rootfs.tar /\n", encoding="utf-8")
            labels = {"io.sparkbuild.base": ref}
            return self.build(
                context=context, tag=ref, platform=platform, labels=labels, build_args={}, secrets={}, log_file=log_file
            )

    def build(
        self,
        *,
        context: Path,
        tag: str,
        platform: str,
        labels: Mapping[str, str],
        build_args: Mapping[str, str],
        secrets: Mapping[str, Path],
        log_file: Path,
        target: str | None = None,
        output: Path | None = None,
        cache: Sequence[str] = (),
        no_cache: bool = False,
        hosts: Mapping[str, str] = {},
        bound: Bound | None = None,
    ) -> str:
        """Build ``context/Dockerfile`` with BuildKit; returns the image id (``tag``), or with ``output``
        writes the target's files there instead of making an image. ``cache``: the build cache's
        flags (``buildcache.flags``); ``no_cache``: every step run anew (``--no-cache``: BuildKit's
        layer cache is not read, and each cache mount is a new empty one); ``hosts``: name -> address
        in /etc/hosts of each RUN step (``--add-host``; not in the image); ``bound``: how long the
        build may take before it is stopped, naming the steps still running (an emulated step that
        hangs would otherwise hold the runner until its job's own limit). Output goes to the log too."""
        args: list[str] = [*self.cli.prefix, "--progress", "plain", "--network", "host", "--platform", platform]
        if no_cache:
            args.append("--no-cache")
        for name, address in sorted(hosts.items()):
            args += ["--add-host", f"{name}:{address}"]
        if output is not None:
            args += ["--output", f"type=local,dest={output}"]
        else:
            args += ["--tag", tag]
            if self.cli.prefix[-2:] == ("buildx", "build"):
                args.append("--load")
        if target is not None:
            args += ["--target", target]
        for key, value in sorted(labels.items()):
            args += ["--label", f"{key}={value}"]
        for key, value in sorted(build_args.items()):
            args += ["--build-arg", f"{key}={value}"]
        for key, path in sorted(secrets.items()):
            args += ["--secret", f"id={key},src={path}"]
        args += [*cache, str(context)]
        env = dict(self.cli.env)
        log.info(cmd.show(args, env))
        log_file.parent.mkdir(parents=True, exist_ok=True)
        tail: list[str] = []
        steps = Steps()
        with (
            log_file.open("w", encoding="utf-8") as sink,
            subprocess.Popen(
                args, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            ) as proc,
            _stopped_after(proc, bound, steps) as stopped,
        ):
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                # Progress goes to stderr with every other log line: stdout is kept for results (--json).
                print(line, end="", file=sys.stderr, flush=True)
                tail = [*tail[-29:], line]
                steps.read(line)
            code = proc.wait()
        if code != 0 and stopped.is_set() and bound is not None:  # a build that ended as its bound ran out stands
            raise BuildError(bound.exceeded(tag, platform, steps.running(), log_file))
        if code != 0:
            raise BuildError(f"build of {tag} failed (exit {code}); last lines:\n{''.join(tail)}full log: {log_file}")
        return str(output) if output is not None else str(self.inspect(tag)["Id"])

    def build_cache_bytes(self) -> int:
        """What BuildKit's cache holds on the engine's disk, in bytes (``docker system df``)."""
        return sum(r.size for r in self.build_cache())

    def build_cache(self) -> list[CacheRecord]:
        """BuildKit's cache records (``docker system df -v``), newest first."""
        try:
            raw = self.client.df().get("BuildCache") or []
        except docker.errors.APIError as exc:
            raise EngineError(f"the engine did not say what its build cache holds: {exc.explanation}") from None
        records = [CacheRecord.of(r) for r in raw]
        return sorted(records, key=lambda r: r.created, reverse=True)

    def made_since(self, before: set[str]) -> list[CacheRecord]:
        """The records made since ``before`` (record ids) that take disk of their own: no image holds
        them and no build is using them."""
        return [r for r in self.build_cache() if r.id not in before and not r.shared and not r.in_use]

    def prune_build_cache(self, records: Sequence[CacheRecord]) -> int:
        """Remove these records from BuildKit's cache; returns the bytes the engine reclaimed.

        One request per record: the engine's prune filter takes one id. Newest first, so that a
        layer goes before the one it was built on (BuildKit keeps a record another still needs)."""
        if not records:
            return 0
        log.info(f"+ docker builder prune --force --filter id=ID  (SDK; for each of {len(records)} records)")
        reclaimed = 0
        for record in sorted(records, key=lambda r: r.created, reverse=True):
            try:
                answer = self.client.api.prune_builds(filters={"id": [record.id]})
            except docker.errors.APIError as exc:
                raise EngineError(
                    f"the engine did not remove build-cache record {record.id}: {exc.explanation}; "
                    f"`docker builder prune --filter id={record.id}` removes it by hand"
                ) from None
            reclaimed += int((answer or {}).get("SpaceReclaimed") or 0)
        return reclaimed

    def remove_image(self, ref: str) -> None:
        """Untag ``ref``, and remove its image where no other tag holds it (``docker rmi``); gone already is fine."""
        log.info(f"+ docker rmi {ref}  (SDK)")
        try:
            self.client.images.remove(ref)
        except docker.errors.ImageNotFound:
            pass  # already gone is what we wanted
        except docker.errors.APIError as exc:
            raise EngineError(
                f"could not remove the image {ref}: {exc.explanation}; remove it by hand (docker rmi {ref})"
            ) from None

    def tag(self, source: str, repository: str, tag: str) -> None:
        log.info(f"+ docker tag {source} {repository}:{tag}  (SDK)")
        self.client.images.get(source).tag(repository, tag)

    def pull(self, repository: str, tag: str, platform: str) -> None:
        log.info(f"+ docker pull --platform {platform} {repository}:{tag}  (SDK)")
        try:
            self.client.images.pull(repository, tag=tag, platform=platform)
        except docker.errors.APIError as exc:
            raise EngineError(f"pull of {repository}:{tag} failed: {exc.explanation}") from None

    def push(self, repository: str, tag: str, *, stall_s: float = 600, deadline: float | None = None) -> str:
        """Push through the Engine API; returns the manifest digest the registry reported.

        No progress from the daemon for ``stall_s`` seconds, or past ``deadline`` (``time.monotonic``),
        ends the push with PushStalled; the daemon giving up ends it with PushFailed. The stream is
        read here, not through the SDK's generator, so that ending it closes the connection.
        """
        log.info(f"+ docker push {repository}:{tag}  (Engine API)")
        api = self.client.api
        registry, _ = docker.auth.resolve_repository_name(repository)
        credentials = docker.auth.get_config_header(api, registry)
        # The daemon reads credentials from the header, else from the body: "{}" is none, as the SDK sends.
        headers = {"Content-Type": "application/json", **({"X-Registry-Auth": credentials} if credentials else {})}
        url = f"{api.base_url}/v{api.api_version}/images/{repository}/push"
        end = deadline if deadline is not None else time.monotonic() + 7 * 24 * 3600
        digest = None
        layers: dict[str, str] = {}  # layer id -> how it ended: "sent" or "there" (found or mounted)
        try:
            with api.post(url, params={"tag": tag}, data="{}", headers=headers, stream=True, timeout=stall_s) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    event = json.loads(line) if line.strip() else {}
                    if "error" in event:
                        raise PushFailed(f"push of {repository}:{tag} failed: {event['error']}")
                    digest = (event.get("aux") or {}).get("Digest", digest)
                    _count_layer(event, layers)
                    if time.monotonic() > end:
                        raise PushStalled(f"push of {repository}:{tag} passed its deadline")
        except requests.Timeout:
            raise PushStalled(f"push of {repository}:{tag} stalled: no progress for {stall_s:.0f}s") from None
        except requests.ConnectionError as exc:
            if "timed out" in str(exc):  # a read timeout inside the stream comes as a ConnectionError
                raise PushStalled(f"push of {repository}:{tag} stalled: no progress for {stall_s:.0f}s") from None
            raise EngineError(f"the engine dropped the push of {repository}:{tag}: {exc}") from None
        except requests.HTTPError as exc:
            raise PushFailed(f"the engine refused the push of {repository}:{tag}: {exc}") from None
        except ValueError as exc:
            raise PushFailed(f"the engine sent a push event that is not JSON: {exc}") from None
        if digest is None:
            raise PushFailed(f"push of {repository}:{tag} reported no digest")
        sent = sum(how == "sent" for how in layers.values())
        log.info(f"  {sent} layer(s) sent, {len(layers) - sent} already in the registry (found or mounted)")
        return str(digest)

    @contextmanager
    def _created(self, image: str) -> Iterator[SdkContainer]:
        """A container made from ``image`` and never started (to read its files); always removed."""
        held = signals.Held()
        try:
            with held:
                container = self.client.containers.create(image, command=["true"], entrypoint=[])
        except docker.errors.APIError as exc:
            raise EngineError(f"could not create a container from {image}: {exc.explanation}") from None
        try:
            held.deliver()
            yield container
        finally:
            container.remove(force=True)

    @overload
    def copy_out(self, image: str, path: str, dest: Path) -> Path: ...
    @overload
    def copy_out(self, image: str, path: str, dest: Path, *, missing_ok: Literal[True]) -> Path | None: ...
    def copy_out(self, image: str, path: str, dest: Path, *, missing_ok: bool = False) -> Path | None:
        """Copy ``path`` out of ``image`` into ``dest`` (a created, never started container); where
        ``image`` has no ``path``: None with ``missing_ok``, else an EngineError."""
        log.info(f"+ docker create {image}; docker cp CONTAINER:{path} {dest}  (SDK)")
        with self._created(image) as container, tempfile.TemporaryFile() as buffer:
            try:
                _archive(container, image, path, buffer)
            except EngineError:
                if missing_ok:
                    return None
                raise
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=buffer) as tar:
                tar.extractall(dest, filter="data")
        return dest / Path(path).name

    def read_files(self, image: str, paths: Sequence[str]) -> dict[str, bytes | None]:
        """The content of each file of ``paths`` in ``image`` (None where it has none, or a link or
        folder is there), read from one created, never started container."""
        log.info(f"+ docker create {image}; docker cp CONTAINER:{{{','.join(paths)}}} -  (SDK)")
        found: dict[str, bytes | None] = {}
        with self._created(image) as container:
            for path in paths:
                with tempfile.TemporaryFile() as buffer:
                    try:
                        _archive(container, image, path, buffer)
                    except EngineError:
                        found[path] = None
                        continue
                    found[path] = _single_file(buffer)
        return found

    @contextmanager
    def export(self, image: str) -> Iterator[IO[bytes]]:
        """The file system of ``image`` as one tar stream (``docker export`` of a created, never
        started container), read as it comes: nothing is written to disk. The container is removed
        on the way out, whatever happens. The paths of CONTAINER_PATHS in it are the container's."""
        log.info(f"+ docker create {image}; docker export CONTAINER  (SDK)")
        with self._created(image) as container:
            try:
                chunks = container.export(chunk_size=1 << 20)
            except docker.errors.APIError as exc:
                raise EngineError(f"could not export a container of {image}: {exc.explanation}") from None
            try:
                yield io.BufferedReader(_ChunkReader(iter(chunks), image), buffer_size=1 << 20)
            finally:
                chunks.close()  # the stream read or not to its end: the response goes with it

    def fetch_files(self, image: str, paths: Sequence[str], dest: Path) -> dict[str, Path | None]:
        """Copy each regular file of ``paths`` out of ``image`` into ``dest`` (as ``dest/N``, N its
        place in ``paths``), from one created, never started container; None where ``image`` has no
        regular file there. Streamed through a temporary file: a file of gigabytes never sits in memory."""
        log.info(f"+ docker create {image}; docker cp CONTAINER:PATH {dest}  (SDK, {len(paths)} file(s))")
        dest.mkdir(parents=True, exist_ok=True)
        found: dict[str, Path | None] = {}
        with self._created(image) as container:
            for index, path in enumerate(paths):
                with tempfile.TemporaryFile(dir=dest) as buffer:
                    try:
                        _archive(container, image, path, buffer)
                    except EngineError:
                        found[path] = None
                        continue
                    found[path] = _extract_single(buffer, dest / str(index))
        return found

    def output(
        self,
        image: str,
        command: Sequence[str],
        *,
        timeout_s: float = 300,
        network: str = "none",
        mounts: Mapping[Path, tuple[str, str]] = {},
        name: str | None = None,
    ) -> str:
        """Run ``command`` in ``image`` (no network unless ``network`` names one, its entrypoint
        replaced; ``mounts``: host folder -> (path, "ro" or "rw"); ``name``: the container's, else
        Docker's own) to its end; its stdout. The container is always removed; a non-zero exit is an
        EngineError with its output."""
        shown = [f"--volume={src}:{dst}:{mode}" for src, (dst, mode) in mounts.items()]
        shown += ["--name", name] if name else []
        args = ["docker", "run", "--rm", "--network", network, *shown, "--entrypoint", command[0], image, *command[1:]]
        log.info(cmd.show(args) + "  (SDK)")
        volumes = {str(src): {"bind": dst, "mode": mode} for src, (dst, mode) in mounts.items()}
        held = signals.Held()
        try:
            with held:
                container = self.client.containers.create(
                    image, list(command[1:]), entrypoint=[command[0]], network_mode=network, volumes=volumes, name=name
                )
        except docker.errors.APIError as exc:
            raise EngineError(f"could not create a container from {image}: {exc.explanation}") from None
        try:
            held.deliver()
            try:
                container.start()
            except docker.errors.APIError as exc:  # a program the image lacks ends here: no exit code
                raise EngineError(f"could not run {command[0]} in {image}: {exc.explanation}") from None
            code = int(container.wait(timeout=timeout_s).get("StatusCode", -1))
            out: bytes = container.logs(stdout=True, stderr=False)
            if code != 0:
                err: bytes = container.logs(stdout=False, stderr=True)
                raise EngineError(f"{shlex.join(command)} in {image} exited {code}: {err.decode(errors='replace')[-500:]}")
            return out.decode(errors="replace")
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
            raise EngineError(f"{shlex.join(command)} in {image} did not end within {timeout_s:g}s") from None
        finally:
            container.remove(force=True)

    # --- containers ------------------------------------------------------------------------

    @contextmanager
    def run(
        self,
        image: str,
        command: Sequence[str],
        *,
        name: str,
        mounts: Mapping[Path, str] = {},
        caches: Mapping[str, str] = {},
        environment: Mapping[str, str] = {},
        shm_size: str = "1g",
        gpus: bool = False,
        entrypoint: str | None = None,
    ) -> Iterator[Container]:
        """Start a detached container on the host network (with every GPU when ``gpus``); always
        remove it on the way out. ``mounts``: host paths, read-only; ``caches``: named volumes,
        writable, kept after the container (what a server compiles once and reuses); ``entrypoint``:
        the program run in place of the image's own."""
        volumes = {str(src): {"bind": dst, "mode": "ro"} for src, dst in mounts.items()}
        volumes.update({volume: {"bind": dst, "mode": "rw"} for volume, dst in caches.items()})
        # --init: an init process reaps the server's children (inductor's compile workers), which else
        # stay zombies when the server ends and keep Docker from removing the container.
        shown = ["docker", "run", "--detach", "--init", "--name", name, "--network", "host", "--shm-size", shm_size]
        if gpus:
            shown += ["--gpus", "all", "--ipc", "host"]
        for src, dst in mounts.items():
            shown += ["--volume", f"{src}:{dst}:ro"]
        for volume, dst in caches.items():
            shown += ["--volume", f"{volume}:{dst}"]
        for key, value in environment.items():
            shown += ["--env", f"{key}={value}"]
        if entrypoint is not None:
            shown += ["--entrypoint", entrypoint]
        log.info(cmd.show([*shown, image, *command]) + "  (SDK)")
        for volume in caches:
            self.cache_volume(volume)
        # Ctrl-C waits while the container is made and started: it lands below, where it is removed.
        held = signals.Held()
        try:
            with held:
                sdk = self.client.containers.run(
                    image,
                    list(command),
                    name=name,
                    detach=True,
                    init=True,
                    network_mode="host",
                    shm_size=shm_size,
                    volumes=volumes,
                    environment=dict(environment),
                    entrypoint=None if entrypoint is None else [entrypoint],
                    **gpu_options(gpus),
                )
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # created but not started (409: the name is another container's)
                self._remove(name)
            hint = f"; {GPU_HELP}" if gpus and "device driver" in str(exc.explanation) else ""
            raise EngineError(f"could not start a container from {image}: {exc.explanation}{hint}") from None
        try:
            held.deliver()
            yield Container(sdk)
        finally:
            pending = sys.exc_info()[1]
            try:
                self._remove(name)
            except EngineError as exc:
                if pending is None:
                    raise
                log.error(str(exc))  # the failure already on its way says more; this one is logged

    def cache_volume(self, name: str) -> None:
        """The named volume ``name``, made with sparkbuild's label where it is not there yet (so a
        person, or ``docker volume ls --filter label=io.sparkbuild.cache``, can tell what made it)."""
        try:
            self.client.volumes.get(name)
        except docker.errors.NotFound:
            log.info(f"+ docker volume create --label {CACHE_LABEL}=1 {name}  (SDK)")
            self.client.volumes.create(name=name, labels={CACHE_LABEL: "1"})
        except docker.errors.APIError as exc:
            raise EngineError(f"could not read the volume {name}: {exc.explanation}") from None

    def _remove(self, name: str) -> None:
        log.info(f"+ docker rm --force {name}  (SDK)")
        try:
            self.client.api.remove_container(name, force=True)
        except docker.errors.NotFound:
            pass  # already gone is what we wanted
        except docker.errors.APIError as exc:
            raise EngineError(
                f"could not remove the container {name}: {exc.explanation}; remove it by hand (docker rm --force {name}) "
                "once the engine lets go of it"
            ) from None


def no_answer(exc: Exception, base_url: str | None, where: str) -> EngineError:
    """An engine that does not answer: this machine's (what to do), or the one at ``base_url``."""
    if base_url is not None:
        return EngineError(f"{where or base_url} does not answer ({exc}): is Docker running there?")
    return EngineError(f"no Docker engine answers ({exc}); {ENGINE_HELP}")


def _count_layer(event: dict[str, Any], layers: dict[str, str]) -> None:
    """Note how a push event ends a layer: "Pushed" was sent; "Layer already exists" and
    "Mounted from REPO" were there already (the daemon's words, stable since Docker 1.10)."""
    status, layer = str(event.get("status", "")), event.get("id")
    if not layer:
        return
    if status == "Pushed":
        layers[str(layer)] = "sent"
    elif status == "Layer already exists" or status.startswith("Mounted from"):
        layers[str(layer)] = "there"


def _archive(container: SdkContainer, image: str, path: str, buffer: IO[bytes]) -> None:
    """``path`` of ``container`` as a tar stream into ``buffer`` (rewound); EngineError if missing."""
    try:
        stream, _ = container.get_archive(path)
        for chunk in stream:
            buffer.write(chunk)
    except docker.errors.NotFound:
        raise EngineError(f"{image} has no {path}") from None
    buffer.seek(0)


class _ChunkReader(io.RawIOBase):
    """The chunks of an SDK stream (``container.export()``) as a readable raw stream, for ``tarfile``."""

    def __init__(self, chunks: Iterator[bytes], image: str) -> None:
        self._chunks = chunks
        self._image = image
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            try:
                chunk = next(self._chunks, None)
            except requests.RequestException as exc:
                raise EngineError(f"the engine dropped the export of {self._image}: {exc}") from None
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size


def _extract_single(buffer: IO[bytes], dest: Path) -> Path | None:
    """The one regular file of a ``get_archive`` tar stream written to ``dest``; None for a folder or link."""
    with tarfile.open(fileobj=buffer) as tar:
        member = tar.next()
        data = tar.extractfile(member) if member is not None and member.isfile() else None
        if data is None:
            return None
        with dest.open("wb") as sink:
            shutil.copyfileobj(data, sink, 1 << 20)
    return dest


def _single_file(buffer: IO[bytes]) -> bytes | None:
    with tarfile.open(fileobj=buffer) as tar:
        member = tar.next()
        data = tar.extractfile(member) if member is not None and member.isfile() else None
        return None if data is None else data.read()


@dataclass(frozen=True)
class Bound:
    """How long one build may take, and where that was set (named in the error)."""

    seconds: float
    where: str

    def exceeded(self, tag: str, platform: str, running: list[tuple[str, float]], log_file: Path) -> str:
        how = f"{platform}, emulated" if host.emulated(platform) else platform
        lines = [f"  {name} (for {_duration(elapsed)})" for name, elapsed in running] or ["  (no step had started)"]
        return (
            f"build of {tag} ({how}) stopped after {_duration(self.seconds)}, its bound ({self.where}); "
            "still running then:\n" + "\n".join(lines) + f"\nIf a step's output in {log_file} stopped, it "
            "hangs and will hang again: fix it; if the build is only slow, raise the bound there."
        )


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


class Steps:
    """The steps of BuildKit's plain progress that started and have not ended: ``#5 [2/3] RUN ...``
    starts step 5; ``#5 DONE 0.6s``, ``#5 CACHED``, ``#5 ERROR ...`` or ``#5 CANCELED`` ends it."""

    _START = re.compile(r"^#(\d+) (\[.+)$")
    _END = re.compile(r"^#(\d+) (DONE|CACHED|ERROR|CANCELED)\b")

    def __init__(self) -> None:
        self._open: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._stopped: list[tuple[str, float]] | None = None

    def read(self, line: str) -> None:
        with self._lock:
            if (end := self._END.match(line)) is not None:
                self._open.pop(end[1], None)
            elif (start := self._START.match(line.rstrip("\n"))) is not None:
                self._open.setdefault(start[1], (start[2], time.monotonic()))

    def stop(self) -> None:
        """Keep what runs now: the build's cancellation then ends every step (``CANCELED``)."""
        self._stopped = self.running()

    def running(self) -> list[tuple[str, float]]:
        """(the step as BuildKit names it, seconds since it started), oldest first; once stopped,
        those of that moment."""
        if self._stopped is not None:
            return self._stopped
        now = time.monotonic()
        with self._lock:
            return [(name, now - since) for name, since in self._open.values()]


# How long a build client stopped by its bound has to cancel the build and exit.
GRACE_SECONDS = 60


@contextmanager
def _stopped_after(proc: subprocess.Popen[str], bound: Bound | None, steps: Steps) -> Iterator[threading.Event]:
    """Ends the build client when ``bound`` runs out (the event says so): BuildKit cancels a build
    whose client has gone, so nothing of it runs on."""
    stopped = threading.Event()

    def stop() -> None:
        steps.stop()
        stopped.set()
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: the client cancels the build, then exits
        try:
            proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()  # a client that does not exit on Ctrl-C must not hold the lane either

    timer = threading.Timer(bound.seconds, stop) if bound is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield stopped
    finally:
        if timer is not None:
            timer.cancel()
