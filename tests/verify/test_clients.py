"""The local image serves the way users serve it and survives what clients send it (issue 26).

vLLM's CPU path compiles C++ at run time: with its defaults (torch.compile) at engine start, and for
a request with logprobs even with --enforce-eager. The shipped image carries g++ and Python's
headers for it; verify serves the shipped ``alphabet`` check compiled (tests/lanes/test_nightly.py)
and sends every check's server the client probes (sparkbuild/verify/probes.py). Here an image broken on purpose
the way the issue found it, the local image without a C++ compiler (one layer: the compiler
removed), fails each way for that reason, and verify keeps the evidence: the server's whole log,
the request that failed with its response, and how the server ended.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkbuild.oci.engine import Engine
from sparkbuild.plan import matrix
from sparkbuild.verify import verify
from tests.support import ROOT
from tests.support.images import derived_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def no_compiler(engine: Engine, local_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The local image with its C++ compiler removed: what the local image was before this issue."""
    steps = "RUN rm -f /usr/bin/g++ /usr/bin/g++-12 /usr/bin/c++ /usr/bin/*-linux-gnu-g++-12"
    return derived_image(engine, local_image, "sparkbuild-test/no-compiler:1", steps, tmp_path_factory.mktemp("no-compiler"))


def alphabet(*extra: str) -> matrix.Check:
    """The shipped alphabet check (compiled, vLLM's defaults), its benchmark out of the way."""
    check = matrix.load(ROOT / "matrix.yaml").checks["alphabet"]
    return dataclasses.replace(check, serve_args=(*check.serve_args, *extra), concurrency=(1,), bench_repeats=1)


@pytest.fixture(scope="module")
def served(
    engine: Engine, no_compiler: str, cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[verify.Verified, Path]]:
    """The image verified eager and compiled, side by side (each waits on its own server), in a
    folder each: what verify found and where it kept its evidence."""
    checks = {"eager": alphabet("--enforce-eager"), "compiled": alphabet()}
    folders = {name: tmp_path_factory.mktemp(f"no-compiler-{name}") for name in checks}
    with ThreadPoolExecutor(max_workers=len(checks)) as pool:
        futures = {
            n: pool.submit(verify.verify_all, engine, no_compiler, [c], folders[n] / "verify.json", cache=cache)
            for n, c in checks.items()
        }
        return {n: (f.result(), folders[n]) for n, f in futures.items()}


def test_an_image_whose_engine_dies_on_logprobs_fails_naming_the_request(served: dict[str, tuple[verify.Verified, Path]]) -> None:
    """Served eager (as every check was before), the image answers the greedy prompts; the first
    request with logprobs kills its engine. verify fails naming that request, and keeps it."""
    found, tmp_path = served["eager"]
    error = str(found.failures["alphabet"])
    assert "probe 'logprobs'" in error and "HTTP 500" in error, error
    assert f"its log: {tmp_path / 'server.log'}" in error
    failure = json.loads((tmp_path / "failure.json").read_text())
    assert failure["request"]["request"] == {
        "path": "/v1/completions",
        "body": {"model": verify.MODEL_NAME, "prompt": "c d e f", "max_tokens": 4, "temperature": 0, "logprobs": 2},
    }
    assert failure["request"]["status"] == 500
    assert "InvalidCxxCompiler" in (tmp_path / "server.log").read_text()
    # How the server stood when verify gave up on it, in words and in Docker's terms.
    print(failure["server"])
    assert failure["server"]["text"] in error


def test_an_image_that_cannot_compile_fails_at_start_with_how_the_server_ended(
    served: dict[str, tuple[verify.Verified, Path]],
) -> None:
    """Served with vLLM's defaults (compiled), the same image never gets healthy: verify says the
    engine failed to start (at that line, not at the startup timeout: the API server process may
    live on), and keeps the whole log and failure.json with how the server stood."""
    found, tmp_path = served["compiled"]
    error = str(found.failures["alphabet"])
    assert "before it was healthy" in error and "not healthy after" not in error, error
    failure = json.loads((tmp_path / "failure.json").read_text())
    assert failure["server"]["status"] in ("running", "exited") and failure["server"]["text"] in error
    assert "request" not in failure
    assert "InvalidCxxCompiler" in (tmp_path / "server.log").read_text()
    assert not (tmp_path / "verify.json").exists()


def test_a_check_the_cpu_image_cannot_serve_is_skipped_before_any_server_starts(
    engine: Engine, local_image: str, cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """NVFP4 has no kernel in vLLM 0.32's CPU image on any CPU: skipped with the reason, no server."""
    check = matrix.load(ROOT / "matrix.yaml").checks["moe-nvfp4"]
    found = verify.verify_all(engine, local_image, [check], tmp_path / "verify.json", cache=cache)
    assert not found.failures and not found.results
    assert "no NVFP4 linear kernel" in found.skipped["moe-nvfp4"]
    assert "docker run" not in capfd.readouterr().err
    written = json.loads((tmp_path / "verify.json").read_text())
    assert written["ok"] is False and written["skipped"] == found.skipped["moe-nvfp4"]
    # Publish may go on (nothing was proven wrong): the skip names this image by its ID.
    assert written["image_id"] == engine.inspect(local_image)["Id"]
    assert verify.tie(tmp_path / "verify.json", local_image, engine.inspect(local_image)) is None


def test_the_image_says_at_once_when_dev_shm_is_too_small(engine: Engine, local_image: str) -> None:
    """Docker's default /dev/shm (64 MiB) is too small for vLLM's engine, which fails minutes into its
    start; the image's entrypoint says so before it starts vLLM, naming what to pass."""
    entry = "python3 /opt/sparkbuild/serve_defaults.py /opt/sparkbuild/serve-defaults.json true 2>&1"
    said = engine.output(local_image, ["sh", "-c", entry])
    assert "/dev/shm has 6" in said and "--ipc=host" in said and "--shm-size 1g" in said, said
