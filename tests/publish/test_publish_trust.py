"""Publish trusts only a verify result it can tie to the image it pushes (issue 29, item 5).

On the shipped local image, under a repository of this test's own (the content tag is the shipped
target's: the repository is not in the content hash), through the command a user runs:

- a hand-written ``verify.json`` (``"ok": true`` and the image's name) is refused with exit 6, as
  is one with the right image ID but no server log, or an edited server log;
- a real result of the image as it was before a rebuild (the tag moved to a derived image) is
  refused with exit 6: it names the old image's ID;
- the real result of this image publishes; ``sparkbuild inspect`` of the reference publish
  printed works after publish ended (the embedded registry is started again, as publish starts
  it), and so does the name without a registry.

A check added to the target, run on the published image at the next nightly, is
tests/lanes/test_nightly.py's (its second and third nightlies).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkbuild.config import options
from sparkbuild.oci.engine import Engine
from sparkbuild.plan import plan
from tests.support import ROOT
from tests.support.cli import run as run_sparkbuild
from tests.support.images import derived_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]

REPOSITORY = "sparkbuild-test/trust-vllm-cpu"


@dataclass(frozen=True)
class Setup:
    folder: Path
    matrix: Path
    env: dict[str, str]
    target: str
    image: str
    out: Path

    def result(self, check: str = "alphabet") -> Path:
        first = self.out / self.target / "verify.json"
        return first if check == "alphabet" else first.parent / "checks" / check / "verify.json"

    def sparkbuild(self, *args: str, matrix: Path | None = None) -> Any:
        return run_sparkbuild(args[0], "--matrix", str(matrix or self.matrix), *args[1:], env=self.env)


def team_matrix(folder: Path, checks: list[str]) -> Path:
    """The shipped local target under this test's repository, with ``checks``, each served once
    without a benchmark (speed is not this test's subject)."""
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    (local,) = [t for t in shipped["targets"] if t.get("profile") == "local"]
    local.update(check=checks, repository=REPOSITORY)
    shipped["targets"] = [local]
    shipped.pop("rehearsal", None)
    for check in shipped["checks"].values():
        check.update(bench=False)
    path = folder / f"matrix-{len(checks)}.yaml"
    path.write_text(yaml.safe_dump(shipped, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def setup(engine: Engine, local_image: str, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("trust")
    (folder / "patches").symlink_to(ROOT / "patches")
    matrix = team_matrix(folder, ["alphabet"])
    out = folder / "out"
    (p,) = plan.make(options.Options.from_env(matrix=matrix, cache=cache, out=out))
    image = p.local_ref
    # The shipped image under this test's own name: its tag is this test's to move.
    engine.tag(local_image, REPOSITORY, p.content_tag)
    env = {"SPARKBUILD_CACHE": str(cache), "SPARKBUILD_OUT": str(out), "SPARKBUILD_REGISTRY": "", "SPARKBUILD_DATE": "20261121"}
    try:
        yield Setup(folder=folder, matrix=matrix, env=env, target=p.id, image=image, out=out)
    finally:  # the names this test gave (pushed ones too); the shipped image keeps its own
        for found in engine.client.images.list():
            for name in found.tags:
                if name.startswith(REPOSITORY) or f"/{REPOSITORY}:" in name:
                    engine.client.images.remove(name)


def test_a_hand_written_result_is_refused_with_exit_6(setup: Setup, engine: Engine) -> None:
    result = setup.result()
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps({"image": setup.image, "check": "alphabet", "ok": True}))
    refused = setup.sparkbuild("publish")
    assert refused.returncode == 6, refused.stderr[-2000:]
    assert "names image ID None" in refused.stderr and "stale or hand-written" in refused.stderr
    # Its ID copied in by hand, it still has no server log to show.
    own = str(engine.inspect(setup.image)["Id"])
    written = {"image": setup.image, "image_id": own, "check": "alphabet", "ok": True, "vllm_version": "0.32.0"}
    result.write_text(json.dumps(written))
    refused = setup.sparkbuild("publish")
    assert refused.returncode == 6 and "no server log beside it" in refused.stderr, refused.stderr[-2000:]
    (result.parent / "server.log").write_text("INFO vLLM API server version 0.32.0\n")
    refused = setup.sparkbuild("publish")
    assert refused.returncode == 6 and "an edited or hand-written result" in refused.stderr, refused.stderr[-2000:]


@pytest.fixture(scope="module")
def verified(setup: Setup, engine: Engine) -> dict[str, Any]:
    """``sparkbuild verify`` of the image, for real: the result publish trusts."""
    done = run_sparkbuild("verify", setup.image, "--matrix", str(setup.matrix), env=setup.env)
    assert done.returncode == 0, done.stderr[-3000:]
    data: dict[str, Any] = json.loads(setup.result().read_text())
    return data


def test_a_real_result_names_the_image_id_the_server_version_and_its_log(
    setup: Setup, engine: Engine, verified: dict[str, Any]
) -> None:
    assert verified["image_id"] == engine.inspect(setup.image)["Id"]
    assert verified["vllm_version"].startswith("0.32.0")
    log = (setup.result().parent / "server.log").read_bytes()
    assert verified["vllm_version"] in log.decode()
    assert verified["server_log_sha256"] == "sha256:" + hashlib.sha256(log).hexdigest()


def test_an_edited_log_or_a_stale_result_is_refused_and_the_real_one_publishes(
    setup: Setup, engine: Engine, local_image: str, verified: dict[str, Any], tmp_path: Path
) -> None:
    log = setup.result().parent / "server.log"
    kept = log.read_bytes()
    log.write_bytes(kept + b"one more line\n")
    refused = setup.sparkbuild("publish")
    assert refused.returncode == 6 and "an edited or hand-written result" in refused.stderr, refused.stderr[-2000:]
    log.write_bytes(kept)

    # Rebuilt since: the tag now names another image (one layer more), the result the old one's.
    repository, tag = setup.image.rsplit(":", 1)
    rebuilt = derived_image(engine, local_image, "sparkbuild-test/trust-rebuilt:1", "RUN touch /rebuilt", tmp_path / "rebuilt")
    try:
        engine.tag(rebuilt, repository, tag)
        refused = setup.sparkbuild("publish")
        assert refused.returncode == 6, refused.stderr[-2000:]
        assert f"names image ID '{verified['image_id']}'" in refused.stderr and "stale" in refused.stderr
    finally:
        engine.tag(local_image, repository, tag)
        engine.client.images.remove("sparkbuild-test/trust-rebuilt:1")
        shutil.rmtree(tmp_path / "rebuilt")

    published = setup.sparkbuild("publish")
    assert published.returncode == 0, published.stderr[-3000:]
    # The reference publish printed: the embedded registry's address, stopped since.
    (reference,) = re.findall(rf"\S+/{REPOSITORY}@sha256:[0-9a-f]{{64}}", published.stdout)
    shown = run_sparkbuild("inspect", reference, "--json", env=setup.env)
    assert shown.returncode == 0, shown.stderr[-2000:]
    (attached,) = json.loads(shown.stdout)["verify"]
    assert attached["image_id"] == verified["image_id"] and attached["ok"] is True
    # And by the name alone: no registry named, none configured, so the cache's embedded one.
    by_name = run_sparkbuild("inspect", setup.image, "--json", env=setup.env)
    assert by_name.returncode == 0, by_name.stderr[-2000:]
    assert json.loads(by_name.stdout)["digest"] == reference.rsplit("@", 1)[1]
