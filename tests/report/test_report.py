"""``sparkbuild report``: several nights published to a real registry, the site written from it
alone, and read in a real browser (Debian's chromium, driven by Playwright) as a person reads it.

The nights are made here, not waited for: each night's image is a real (tiny) OCI image uploaded
to the registry, its documents (verify result, SBOM) attached as publish attaches them, and its run
recorded as the lane records it (``sparkbuild.publish.runrecord``), from the rows the lane's own
``TargetRun.row()`` writes around real benchmark figures judged by the real speed gate. What is
faked, and why: the dates (a night cannot be waited for), and the images' contents (what is read
back is the registry's, whatever the image holds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sparkbuild.config.options import Options, default_limits
from sparkbuild.errors import PublishError
from sparkbuild.lanes import pipeline
from sparkbuild.oci.registry import Registry
from sparkbuild.plan import plan
from sparkbuild.publish import publish, runrecord, sbom
from sparkbuild.report import site
from sparkbuild.verify import benchreport, regression, verify
from sparkbuild.verify.verify import VerifyResult
from tests.publish.test_documents import contents
from tests.support import DATA, ROOT
from tests.support import nights as made
from tests.support.cli import run as sparkbuild
from tests.support.faults import FaultProxy, Rule

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

BENCH = DATA / "bench"
FAST = dataclasses.replace(default_limits(), backoff_initial_s=0.05, backoff_max_s=0.2, timeout_s=2, give_up_after_s=10)
PATCH = "cpu-moe-fix"
BAD_RUN = "run-nightly-20261206T030000000000Z"
BUILD_LOG = "ninja: build stopped: subcommand failed (csrc/cpu/moe.cpp)"


@dataclass
class Night:
    night: str
    lane: str = "nightly"
    status: pipeline.Status = pipeline.Status.PUBLISHED
    measured: str | None = "baseline.json"
    baseline: str | None = None
    hold: bool = False
    moe: str = "CPU"
    patch: str = "applies"
    vllm: str = "0.32.0"
    packages: dict[str, str] = dataclasses.field(default_factory=dict)
    malformed_verify: bool = False


NIGHTS = (
    Night("20261201"),
    Night("20261202", baseline="baseline.json", packages={"numpy": "9.9.9"}),
    Night("20261203", status=pipeline.Status.REGRESSED, measured="slower.json", baseline="baseline.json", hold=True, moe="TORCH"),
    Night("20261204", status=pipeline.Status.FAILED, measured=None),
    Night("20261205", lane="rc", vllm="0.33.0rc1", patch="upstream", malformed_verify=True, measured=None),
)


@dataclass(frozen=True)
class Site:
    registry: Registry
    repository: str
    target: str
    index: Path
    digests: dict[str, str]
    tags: tuple[str, ...]
    out: subprocess.CompletedProcess[str]


def a_row(p: plan.TargetPlan, n: Night, digest: str | None, out: Path) -> tuple[dict[str, Any], VerifyResult]:
    result = made.alphabet_result(made.figures(n.measured) if n.measured else None, n.moe)
    run = pipeline.TargetRun(p, status=n.status, digest=digest, result=result, seconds=600.0)
    run.verified = verify.Verified(checks=("alphabet",), results={"alphabet": result}, failures={})
    if n.measured:
        check = p.target.checks[0]
        was = made.figures(n.baseline) if n.baseline else None
        gate = regression.compare(made.figures(n.measured), was, threshold_pct=10, baseline_of="sha256:before" if was else None)
        table = benchreport.table(made.figures(n.measured), was, gate)
        run.speeds["alphabet"] = pipeline.Speed(
            check=check, measured=made.figures(n.measured), baseline=was, gate=gate, table=table, plot=Path("benchmark.png")
        )
    if n.hold:
        run.held = ("alphabet",)
        pipeline.regressed(run, held=True)
    if n.status == pipeline.Status.FAILED:
        run.failed_at, run.verified, run.digest = pipeline.Status.BUILDING, None, None
        run.error = "the vLLM stage failed: ninja: build stopped (log: error.log)"
        (out / p.id).mkdir(parents=True, exist_ok=True)
        (out / p.id / "error.log").write_text(f"{p.id} failed while building:\n...\n{BUILD_LOG}\n")
    row = run.row()
    row["vllm"], row["patches"] = n.vllm, {PATCH: n.patch}
    return row, result


def attach_documents(registry: Registry, p: plan.TargetPlan, digest: str, n: Night, result: VerifyResult) -> None:
    verify_doc = b"not json{" if n.malformed_verify else json.dumps(result.to_json()).encode()
    made.attach(registry, p.repository, digest, verify_doc, sbom_of(registry, p, digest, n.packages))


def sbom_of(registry: Registry, p: plan.TargetPlan, digest: str, changed: dict[str, str]) -> bytes:
    made = contents({"config": {"digest": digest}})
    installed = tuple((name, changed.get(name, version)) for name, version in made.installed)
    made = dataclasses.replace(made, installed=installed)
    return sbom.to_json(sbom.make(made, image=f"{registry.host}/{p.repository}", digest=digest)).encode()


def publish_nights(registry: Registry, p: plan.TargetPlan, out: Path) -> dict[str, str]:
    digests: dict[str, str] = {}
    for n in NIGHTS:
        digest = None if n.status == pipeline.Status.FAILED else made.tiny_image(registry, p.repository, f"built on {n.night}\n")
        row, result = a_row(p, n, digest, out)
        if digest is not None:
            digests[n.night] = digest
            attach_documents(registry, p, digest, n, result)
            # As publish moves them: a held image gets no readable tag, and an rc's are its own (not these).
            if not n.hold and n.lane == "nightly":
                publish.point(registry, p.repository, (*p.tags, publish.last_good_tag(p.id)), digest)
        started = datetime.strptime(n.night, "%Y%m%d").replace(hour=3, tzinfo=UTC)
        runrecord.push(registry, p.repository, lane=n.lane, night=n.night, started=started, rows=[row], out=out)
    # A tag that looks like a run but is an image: that run says it is unreadable, the rest stands.
    body, media_type = registry.manifest(p.repository, digests["20261201"])
    registry.put_tag(p.repository, BAD_RUN, body, media_type)
    return digests


@pytest.fixture(scope="module")
def nights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    from sparkbuild.oci.registry import embedded

    folder = tmp_path_factory.mktemp("report")
    (p,) = plan.make(Options.from_env(matrix=ROOT / "matrix.yaml", date="20261201", profile="local"))
    with embedded(folder / "registry") as registry:
        digests = publish_nights(registry, p, folder / "out")
        env = {"SPARKBUILD_REGISTRY": registry.host, "SPARKBUILD_CACHE": str(folder / "c"), "SPARKBUILD_OUT": str(folder / "o")}
        done = sparkbuild("report", "--repository", p.repository, "--site", folder / "site", "--json", env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        yield Site(registry, p.repository, p.id, folder / "site" / "index.html", digests, p.tags, done)


def opened(browser: Browser, path: Path) -> Page:
    page = browser.new_page()
    page.set_default_timeout(10_000)  # a local file: anything missing is missing, not late
    page.goto(path.as_uri())
    return page


def test_the_report_says_what_it_read(nights: Site) -> None:
    said = json.loads(nights.out.stdout)
    assert said["index"] == str(nights.index)
    # A web server reads the site as another user.
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in nights.index.parent.rglob("*") if f.is_file())
    (repo,) = said["repositories"]
    assert repo == {"repository": nights.repository, "runs": 5, "images": 4, "unreadable": [BAD_RUN]}


def test_the_grid_shows_each_night_as_it_ended(nights: Site, browser: Browser) -> None:
    page = opened(browser, nights.index)

    def cell(night: str) -> Locator:
        return page.locator(f"[id='cell-{nights.target}-{night}']")

    assert cell("20261201").get_attribute("class") == "cell published"
    assert cell("20261201").locator("a").first.inner_text() == "published"
    held = cell("20261203")
    assert held.get_attribute("class") == "cell held-back"
    assert "held back by the speed gate: check alphabet" in held.inner_text()
    failed = cell("20261204")
    assert failed.get_attribute("class") == "cell failed"
    assert "failed at building" in failed.inner_text()
    # The log link leads to the failing log, kept in the registry with the run.
    failed.locator("a.log", has_text="error.log").click()
    assert BUILD_LOG in page.locator("body").inner_text()


def test_a_malformed_document_is_its_cell_and_the_rest_of_the_page_is_whole(nights: Site, browser: Browser) -> None:
    page = opened(browser, nights.index)
    cell = page.locator(f"[id='cell-{nights.target}-20261205']")
    assert "documents:" in cell.inner_text() and "not a JSON object" in (cell.get_attribute("title") or "")
    assert f"Run {BAD_RUN} could not be read" in page.locator(f"[id='problem-{BAD_RUN}']").inner_text()
    assert page.locator("td.cell").count() == 5


def test_a_speed_figure_that_moved_is_plotted_and_marked(nights: Site, browser: Browser) -> None:
    page = opened(browser, nights.index)
    figure = page.locator(f"[id='speed-{nights.target}-alphabet']")
    assert figure.locator("img").evaluate("img => img.complete && img.naturalWidth > 0")
    figure.locator("summary").click()
    moved = figure.locator("tr.point", has_text="20261203").filter(has_text="regressed")
    assert moved.count() >= 1
    assert figure.locator("tr.point", has_text="20261201").first.inner_text().endswith("no baseline")
    svg = (nights.index.parent / str(figure.locator("img").get_attribute("src"))).read_text()
    assert 'id="moved-20261203-' in svg
    assert 'id="moved-20261202-' not in svg  # within the band: not marked


def test_a_patch_that_went_upstream_on_the_rc_shows_so(nights: Site, browser: Browser) -> None:
    page = opened(browser, nights.index)
    headers = page.locator("table.patches tr").first.locator("th").all_inner_texts()
    assert headers == ["patch", "0.32.0", "0.33.0rc1 (rc)"]
    assert page.locator(f"[id='patch-{PATCH}'] td").all_inner_texts() == [PATCH, "applies", "upstream"]


def test_the_readable_tags_point_at_the_last_good_night_and_kernel_changes_show(nights: Site, browser: Browser) -> None:
    page = opened(browser, nights.index)
    for tag in (*nights.tags, publish.last_good_tag(nights.target)):
        row = page.locator(f"[id='pull-{nights.target}-{tag}']")
        assert row.locator("td").all_inner_texts()[2:] == [nights.digests["20261202"].split(":")[1][:12], "20261202"]
    kernels = page.locator(f"[id='kernels-{nights.target}'] tr").all_inner_texts()
    assert [k.split("\t") for k in kernels[2:]] == [
        ["20261201", "alphabet", "moe", "CPU", "-"],
        ["20261203", "alphabet", "moe", "TORCH", "CPU"],
        ["20261205", "alphabet", "moe", "CPU", "TORCH"],
    ]


def test_an_image_page_shows_inspect_and_the_sbom_against_the_night_before(
    nights: Site, browser: Browser, tmp_path: Path
) -> None:
    page = opened(browser, nights.index)
    page.locator(f"[id='cell-{nights.target}-20261202'] a").first.click()
    assert nights.digests["20261202"] in page.locator("#inspect").inner_text()
    assert page.locator("#check-alphabet h3").inner_text() == "alphabet: ok"
    assert "numpy" in page.locator("ul.diff li.changed").inner_text() and "-> 9.9.9" in page.locator("ul.diff").inner_text()
    # docs/img/report.png is this screenshot: SPARKBUILD_REPORT_SCREENSHOT=docs/img/report.png makes it again.
    shot = Path(os.environ.get("SPARKBUILD_REPORT_SCREENSHOT") or tmp_path / "report.png")
    opened(browser, nights.index).screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def test_a_registry_that_answers_500_writes_nothing_half(nights: Site, tmp_path: Path) -> None:
    host, port = nights.registry.host.rsplit(":", 1)
    dest = tmp_path / "site"
    site.make(nights.registry, [nights.repository], dest, tmp_path / "cache")
    before = (dest / "index.html").read_text()
    with FaultProxy((host, int(port))) as proxy:
        proxy.add(Rule(kind="status", status=500, path="/manifests/", times=-1))
        failing = Registry(proxy.address, limits=FAST)
        with pytest.raises(PublishError, match=r"HTTP 500 after \d+ tries.*report: nothing written; .* is as it was"):
            site.make(failing, [nights.repository], dest, tmp_path / "fresh-cache")
    assert (dest / "index.html").read_text() == before
    assert not list(tmp_path.glob(".site-*"))  # no half-written site left beside it


def test_a_registry_out_of_reach_is_one_clear_error_and_no_site(nights: Site, tmp_path: Path) -> None:
    with FaultProxy(("127.0.0.1", 9)) as proxy:  # nothing answers behind it: every connection is reset
        proxy.close()  # and now nothing listens at its address either
        gone = Registry(proxy.address, limits=FAST)
    done = sparkbuild("report", "--repository", nights.repository, "--registry", gone.host, "--site", tmp_path / "site")
    assert done.returncode == 7, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"registry {gone.host}" in last and "ConnectionError" in last
    assert last.endswith(f"report: nothing written; no site at {tmp_path / 'site'}")
    assert not (tmp_path / "site").exists()


def test_a_site_folder_that_holds_something_else_is_refused_before_any_read(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    (home / "notes.txt").write_text("mine\n")
    done = sparkbuild("report", "--repository", "team/vllm", "--registry", "127.0.0.1:9", "--site", home)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--site {home}: exists and is not a site sparkbuild report wrote" in done.stderr
    assert "GET" not in done.stderr  # refused before the registry is asked anything
    assert (home / "notes.txt").read_text() == "mine\n" and (home / "work").is_dir()
