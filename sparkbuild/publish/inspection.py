"""``sparkbuild inspect IMAGE``: what is attached to a published image, read back by its digest."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkbuild.config.options import Limits
from sparkbuild.errors import ConfigError, PublishError
from sparkbuild.oci import referrers
from sparkbuild.oci.registry import Registry, embedded, embedded_address
from sparkbuild.publish import attest, provenance, sbom, wheels
from sparkbuild.util import log
from sparkbuild.util.net import check_address


def parse_image(image: str) -> tuple[str | None, str, str]:
    """``host/repo@sha256:...``, ``host/repo:tag`` or ``repo:tag`` -> (host or None, repository,
    tag or digest)."""
    name, at, digest = image.partition("@")
    tag = ""
    if not at:
        last = name.rsplit("/", 1)[-1]
        name, tag = (name.rsplit(":", 1)[0], last.rsplit(":", 1)[1]) if ":" in last else (name, "")
    if not (digest or tag):
        raise ConfigError(f"inspect {image}: name a tag or a digest (host/repository:tag or host/repository@sha256:...)")
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return check_address(first), rest, digest or tag
    return None, name, digest or tag


@contextmanager
def reach(host: str | None, registry: str | None, cache: Path, limits: Limits) -> Iterator[Registry]:
    """The registry an image lives in, reached as publish reaches it: the host its name gives,
    else ``registry`` (--registry, else SPARKBUILD_REGISTRY), else this cache's embedded registry,
    started for the call as a nightly starts it. A name whose host is the embedded registry's
    own address (the reference a nightly printed) reaches it too, started again once that run
    has ended."""
    data = cache / "registry"
    named = host or registry
    if named is not None and (named != embedded_address(data) or Registry.parse(named, limits).ping()):
        yield Registry.parse(named, limits)
        return
    with embedded(data, limits) as started:
        if named is not None and started.host != named:
            log.warning(f"the embedded registry of {cache} listens on {started.host} now, not {named}: reading it there")
        yield started


def inspect(registry: Registry, repository: str, reference: str) -> dict[str, Any]:
    """Everything attached to the image, as JSON: the attached list and each document read back
    (the newest of each kind)."""
    digest = referrers.subject_digest(registry, repository, reference)
    attached = referrers.listed(registry, repository, digest)
    newest = referrers.newest(attached)
    # The wheels' first layer is their index (wheels.json): read like a document, the wheels themselves are not.
    documents = {kind: _document(registry, repository, a) for kind, a in newest.items() if kind in (*attest.MADE, wheels.KIND)}
    document = documents.get("sbom")
    return {
        "image": f"{registry.host}/{repository}@{digest}",
        "digest": digest,
        "attached": [{"kind": a.kind, **a.to_json()} for a in attached],
        "sbom": None if document is None else {"summary": sbom.summary(document), "document": document},
        "provenance": documents.get("provenance"),
        # One verify result per check, the benchmarked check's first.
        "verify": verify_results(registry, repository, attached),
        "wheels": documents.get(wheels.KIND),
    }


def verify_results(registry: Registry, repository: str, attached: list[referrers.Attached]) -> list[dict[str, Any]]:
    """The newest verify result of each check, the one with a benchmark (the target's first check) first."""
    by_check = referrers.newest([a for a in attached if a.kind == "verify"], key=lambda a: a.annotations.get(attest.CHECK, ""))
    results = [_document(registry, repository, a) for a in by_check.values()]
    return sorted(results, key=lambda r: (not r.get("benchmark"), str(r.get("check"))))


def _document(registry: Registry, repository: str, attached: referrers.Attached) -> dict[str, Any]:
    try:
        data = json.loads(referrers.read(registry, repository, attached))
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise PublishError(f"{registry.host}/{repository}@{attached.digest}: the attached {attached.kind} is not a JSON object")
    return data


def text(report: Mapping[str, Any]) -> str:
    """The short summary a person reads."""
    lines = [str(report["image"])]
    if not report["attached"]:
        return "\n".join(
            [*lines, "  nothing attached (published before sparkbuild attached documents; `sparkbuild nightly` adds them)"]
        )
    lines.append("  attached: " + ", ".join(f"{a['kind']} {a['digest'][:19]}" for a in report["attached"]))
    lines += _sbom_lines(report["sbom"]) + _provenance_lines(report["provenance"]) + _verify_lines(report["verify"])
    lines += _wheels_lines(report.get("wheels"))
    return "\n".join(lines)


def _sbom_lines(found: Mapping[str, Any] | None) -> list[str]:
    if found is None:
        return ["  SBOM: none attached"]
    s = found["summary"]
    counts = s["counts"]
    lines = [
        f"  SBOM ({s['format']}): {s['components']} components: {counts['python']} python "
        f"({counts['cuda_wheels']} CUDA wheels), {counts['deb']} deb, {counts['source']} from source"
    ]
    lines += [f"    from source: {b['name']} {b['commit']} ({b['repository']})" for b in s["from_source"]]
    return lines


def _provenance_lines(statement: Mapping[str, Any] | None) -> list[str]:
    if statement is None:
        return ["  provenance: none attached"]
    run = statement.get("predicate", {}).get("runDetails", {})
    builder = run.get("builder", {})
    version = builder.get("version", {})
    commit = f" (commit {version['commit'][:12]})" if version.get("commit") else ""
    lines = [
        f"  provenance ({statement.get('predicateType')}): built by {builder.get('id')} "
        f"with sparkbuild {version.get('sparkbuild')}{commit}"
    ]
    for material in provenance.materials(statement):
        digests = ", ".join(f"{alg} {value}" for alg, value in (material.get("digest") or {}).items())
        lines.append("    " + "  ".join(str(part) for part in (material.get("name"), material.get("uri"), digests) if part))
    return lines


def _rate(value: float | None) -> str:
    """A per-request rate; None where tokens reached the client in bursts (sparkbuild/verify/benchmark.py)."""
    return "bursts" if value is None else f"{value:.0f}"


def _verify_lines(results: list[Mapping[str, Any]]) -> list[str]:
    if not results:
        return ["  verify: none attached"]
    return [line for result in results for line in _check_lines(result)]


def _check_lines(result: Mapping[str, Any]) -> list[str]:
    if result.get("skipped"):
        return [f"  verify: SKIPPED (check {result.get('check')}): {result['skipped']}"]
    answers = result.get("answers") or []
    good = sum(bool(a.get("ok")) for a in answers)
    lines = [
        f"  verify: {'ok' if result.get('ok') else 'FAILED'}, {good}/{len(answers)} answers "
        f"(check {result.get('check')}, started in {result.get('startup_s', 0):.1f}s)"
    ]
    numbers = result.get("numbers") or []
    lines += [
        f"    logprobs {n['mode']}: {'as recorded' if n.get('ok') else 'MOVED'} ({n['positions']} positions, "
        f"at most {n['max_logprob_delta']:.4f} from the reference)"
        for n in numbers
    ]
    if result.get("probes"):
        lines.append(f"    client probes answered: {len(result['probes'])}")
    kernels = result.get("kernels") or []
    lines += [
        f"    kernel path {k['kind']}: {'/'.join(c['backend'] for c in k['chosen']) or 'not logged'}"
        f"{'' if k.get('ok') else ' (UNEXPECTED)'}" + (f" [UNVERIFIED: {k['unverified']}]" if k.get("unverified") else "")
        for k in kernels
    ]
    bench = result.get("benchmark") or {}
    lines += [
        f"    {lv['scenario']} c={lv['concurrency']}: TTFT p50 {f['ttft_ms_p50']:.0f} ms p99 {f['ttft_ms_p99']:.0f} ms, "
        f"{_rate(f['tokens_per_s_per_request'])} tok/s per request, {f['tokens_per_s']:.0f} in all ({f['requests']} requests)"
        for lv in bench.get("levels") or ()
        for f in (lv["figures"],)
    ]
    return lines


def _wheels_lines(index: Mapping[str, Any] | None) -> list[str]:
    if index is None:
        return ["  wheels: none attached (a local target builds none)"]
    built = index.get("built_for") or {}
    found = [f for f in index.get("files") or () if f.get("name")]
    marker = f"{built.get('gpu')} (arch list {built.get('arch_list')})"
    lines = [f"  wheels: {len(found)}, built for {marker}; `sparkbuild wheels` fetches them"]
    lines += [f"    {f['file']}  {f['sha256'][:19]}  ({f['stage']} stage)" for f in found]
    return lines
