"""The engine with a real Docker daemon: BuildKit builds, containers that always go away."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import docker.errors
import pytest

from sparkbuild.errors import BuildError
from sparkbuild.oci.buildkit import find_build_cli
from sparkbuild.oci.engine import Engine
from tests.support.matrix import LOCAL_PLATFORM

pytestmark = pytest.mark.docker


def gone(engine: Engine, name: str) -> bool:
    try:
        engine.client.containers.get(name)
    except docker.errors.NotFound:
        return True
    return False


def test_a_buildkit_cli_is_found() -> None:
    cli = find_build_cli()
    assert cli.prefix[-1] == "build"
    assert cli.prefix[-2:] == ("buildx", "build") or dict(cli.env) == {"DOCKER_BUILDKIT": "1"}


def test_build_uses_buildkit_cache_mounts_and_secrets(engine: Engine, base: str, tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret")
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base}\n"
        "RUN --mount=type=cache,target=/cache --mount=type=secret,id=tok "
        'test "$(cat /run/secrets/tok)" = s3cret && touch /cache/x && ls /cache > /seen\n'
    )
    ref = "sparkbuild-test/buildkit:1"
    engine.build(
        context=tmp_path,
        tag=ref,
        platform=LOCAL_PLATFORM,
        labels={"a.b": "c"},
        build_args={},
        secrets={"tok": secret},
        log_file=tmp_path / "build.log",
    )
    assert engine.inspect(ref)["Config"]["Labels"]["a.b"] == "c"
    # The secret was mounted for the step, never written into a layer.
    out = engine.client.containers.run(ref, ["sh", "-c", "test ! -e /run/secrets/tok && cat /seen"], remove=True)
    assert out.strip() == b"x"


def test_a_failed_build_raises_with_its_last_lines(
    engine: Engine, base: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "Dockerfile").write_text(f"FROM {base}\nRUN echo about-to-fail && false\n")
    with pytest.raises(BuildError, match="about-to-fail"):
        engine.build(
            context=tmp_path,
            tag="sparkbuild-test/fail:1",
            platform=LOCAL_PLATFORM,
            labels={},
            build_args={},
            secrets={},
            log_file=tmp_path / "build.log",
        )
    assert "about-to-fail" in (tmp_path / "build.log").read_text()
    # Build output is progress: stderr, never stdout (which `--json` keeps for results).
    out, err = capfd.readouterr()
    assert "about-to-fail" in err and "about-to-fail" not in out


def test_container_is_removed_when_the_block_fails(engine: Engine, base: str) -> None:
    name = "sparkbuild-test-fails"
    with pytest.raises(RuntimeError), engine.run(base, ["sleep", "300"], name=name) as container:
        assert container.running()
        raise RuntimeError("boom")
    assert gone(engine, name)


def test_container_is_removed_on_ctrl_c(engine: Engine, base: str) -> None:
    name = "sparkbuild-test-interrupted"
    code = (
        "import time\n"
        "from sparkbuild.oci.engine import Engine\n"
        f"with Engine().run({base!r}, ['sleep', '300'], name={name!r}):\n"
        "    print('started', flush=True)\n"
        "    time.sleep(300)\n"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
        assert not gone(engine, name)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while not gone(engine, name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert gone(engine, name)


def test_the_records_of_a_removed_images_layers_are_pruned_and_free_their_disk(engine: Engine, base: str, tmp_path: Path) -> None:
    """BuildKit keeps a layer's record after its image goes (its garbage collection is off in
    Debian's 20.10 engine): pruning the records by id, newest first, takes a layer and the one it
    was built on in one call, and frees the bytes."""
    marker = f"sparkbuild-prune-{time.time_ns()}"  # steps no earlier build ran
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base}\nRUN head -c 3000000 /dev/urandom > /one # {marker}\nRUN head -c 2000000 /dev/urandom > /two # {marker}\n"
    )
    ref = "sparkbuild-test/prune:1"
    engine.build(
        context=tmp_path, tag=ref, platform=LOCAL_PLATFORM, labels={}, build_args={}, secrets={}, log_file=tmp_path / "build.log"
    )
    engine.remove_image(ref)
    made = [r for r in engine.build_cache() if marker in r.description]
    assert len(made) == 2 and not any(r.shared for r in made), made
    assert engine.prune_build_cache(made) >= 5_000_000
    assert [r for r in engine.build_cache() if marker in r.description] == []
