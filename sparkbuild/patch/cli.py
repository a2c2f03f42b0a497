"""``sparkbuild patch check|apply|table``: the patch engine for people.

Imports what a verdict needs (click, the engine, PyYAML, packaging) and no more: ``requests``
only to download a missing sdist, gitpython only for ``--candidate-from``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from packaging.version import InvalidVersion, Version

from sparkbuild.config import options
from sparkbuild.errors import ConfigError, PatchError
from sparkbuild.patch import engine, meta, need, releases
from sparkbuild.upstream import sources
from sparkbuild.util import log

F = TypeVar("F", bound=Callable[..., Any])


def cache_dir() -> Path:
    """The cache ``Options.from_env`` would give, without reading every other option."""
    return Path(options.env("SPARKBUILD_CACHE") or options.default_cache())


def emit_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


@click.group("patch")
def patch_group() -> None:
    """Check or apply patches/ on a vLLM source tree (an sdist or a git checkout); the support table."""


def selection(func: F) -> F:
    func = click.option("--patch", "names", multiple=True, metavar="NAME", help="Only this patch (repeatable).")(func)
    func = click.option(
        "--patches",
        "patches_dir",
        type=click.Path(path_type=Path, file_okay=False),
        help="Patches folder (default: ./patches, then the packaged set).",
    )(func)
    return func


def patch_folders(patches_dir: Path | None) -> dict[str, Path]:
    """``--patches DIR`` alone, else ``./patches`` (where it exists) before the packaged set."""
    return meta.folders((patches_dir,) if patches_dir else meta.default_dirs())


def tree_options(func: F) -> F:
    func = click.option("--source", type=click.Path(path_type=Path, file_okay=False), help="Unpacked vLLM source tree.")(func)
    func = click.option(
        "--vllm-version", metavar="X.Y.Z", help="Download this release's sdist from PyPI (cached) and use it; v0.33.0 works too."
    )(func)
    func = click.option("--as-version", metavar="X.Y.Z", help="Version of --source when it has no PKG-INFO or tag.")(func)
    return selection(func)


def check_tree(
    source: Path | None, vllm_version: str | None, as_version: str | None, names: tuple[str, ...], patches_dir: Path | None
) -> engine.Report:
    if (source is None) == (vllm_version is None):
        raise ConfigError("give exactly one of --source DIR or --vllm-version X.Y.Z")
    patches = meta.load(patch_folders(patches_dir), names or None)  # a misspelt --patch fails before any download
    if vllm_version is not None:
        source = sources.vllm_sdist(vllm_version, cache_dir())
    assert source is not None
    version = as_version or sources.tree_version(source) or (sources.release_version(vllm_version) if vllm_version else None)
    if version is None:
        raise ConfigError(f"{source}: no PKG-INFO and no git tag tells its vLLM version; pass --as-version X.Y.Z")
    return engine.check(source, patches, version)


@patch_group.command("check")
@tree_options
@click.option("--json", "as_json", is_flag=True, help="Print the statuses as JSON.")
def check_cmd(as_json: bool, **kwargs: Any) -> None:
    """Say what each patch does to the tree: applies, applied, upstream, not-applicable or conflict. Changes nothing."""
    report = check_tree(**kwargs)
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(engine.table(report))
    if not report.ok:
        raise PatchError("a patch conflicts with this tree (see above); update the patch or its version range")


@patch_group.command("apply")
@tree_options
def apply_cmd(**kwargs: Any) -> None:
    """Apply every patch that applies; all or nothing: a conflict leaves the tree untouched."""
    report = check_tree(**kwargs)
    click.echo(engine.table(report), err=True)
    written = engine.apply(report)
    log.info(f"patched {len(written)} file(s) in {report.source}; record in {engine.RECORD}")


@patch_group.command("pr")
@click.argument("repo")
@click.argument("number", type=click.IntRange(min=1))
@click.option("--base", required=True, metavar="SHA", help="The commit the PR's change is taken from (its base).")
@click.option("--head", metavar="SHA", help="The PR commit to take (default: the PR's head now).")
@click.option("--path", "paths", multiple=True, metavar="PATH", help="Only this file of the PR (repeatable).")
def pr_cmd(repo: str, number: int, base: str, head: str | None, paths: tuple[str, ...]) -> None:
    """Fetch upstream PR NUMBER of the git repository REPO and print the `change:` of a patch.yaml
    that grafts it, pinned by the sha256 of its change (a patch folder of its own, see docs/upstream-prs.md)."""
    import yaml

    from sparkbuild.patch import pullrequest

    for name, sha in (("--base", base), ("--head", head)):
        if sha is not None and not re.fullmatch(r"[0-9a-f]{40}", sha):
            raise ConfigError(f"{name} {sha!r}: give the full commit id (40 hex digits)")
    click.echo(yaml.safe_dump(pullrequest.pin(repo, number, base, head, paths), sort_keys=False), nl=False)


README_BEGIN = "<!-- patch table: generated by `sparkbuild patch table --markdown{args}`; do not edit -->"
README_END = "<!-- end of patch table -->"
# The table with need (docs/patches-needed.md): a block of its own, so a file may hold either or both.
NEEDED_BEGIN = "<!-- patch needed table: generated by `sparkbuild patch table --needed --markdown{args}`; do not edit -->"
NEEDED_END = "<!-- end of patch needed table -->"


@patch_group.command("table")
@selection
@click.option("--json", "as_json", is_flag=True, help="Print every release's statuses, details and need as JSON.")
@click.option("--markdown", is_flag=True, help="Print the table as Markdown, releases with equal statuses on one line.")
@click.option("--needed", is_flag=True, help="With --markdown: each cell also says which builds need the patch.")
@click.option("--through", metavar="X.Y.Z", help="Only releases up to this one (default: every release on PyPI).")
@click.option("--candidate-from", metavar="GIT_URL", help="Also check the newest release candidate this git remote offers.")
@click.option(
    "--cuda",
    "cudas",
    multiple=True,
    metavar="X.Y",
    help=f"Judge need for a build with this CUDA version (repeatable; default: {', '.join(need.SPARK_CUDA)}).",
)
@click.option("--arch-list", default=need.SPARK_ARCH_LIST, show_default=True, help="TORCH_CUDA_ARCH_LIST the need is judged for.")
@click.option(
    "--update-readme",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the generated tables into this Markdown file (README.md, docs/patches-needed.md): each block it holds.",
)
@click.option("--jobs", type=click.IntRange(min=1), help="Worker processes (default: one per core).")
def table_cmd(
    names: tuple[str, ...],
    patches_dir: Path | None,
    as_json: bool,
    markdown: bool,
    needed: bool,
    through: str | None,
    candidate_from: str | None,
    cudas: tuple[str, ...],
    arch_list: str,
    update_readme: Path | None,
    jobs: int | None,
) -> None:
    """Every vLLM release with a status per patch, from cached sdists (downloaded once, sha256-checked),
    and whether a Spark build (CUDA 12.9 and 13.0, 12.1a) still needs each patch there (needs cmake).

    Exits 9 when a patch conflicts on a release in its range.
    """
    folders = patch_folders(patches_dir)
    patches = meta.load(folders, names or None)
    cache = cache_dir()
    found = releases.releases(_version(through) if through else None)
    trees = releases.trees(found, cache, releases.reads(patches))
    builds = tuple(need.Build(c, arch_list) for c in cudas or need.SPARK_CUDA)
    work = [releases.Job(r.version, trees[r.version], "sdist", builds) for r in found if r.sdist is not None]
    if candidate_from:
        candidate = releases.candidate_job(candidate_from, cache)
        work += [releases.Job(candidate.version, candidate.tree, candidate.label, builds)] if candidate else []
    rows = releases.sweep(folders, names or None, work, jobs)
    wheels = [r.version for r in found if r.sdist is None]
    sdists = [r for r in rows if r.label == "sdist"]
    if update_readme is not None:
        args = f" --through {through}" if through else ""
        blocks = {
            (README_BEGIN, README_END): releases.markdown_table(sdists, wheels),
            (NEEDED_BEGIN, NEEDED_END): releases.needed_markdown(sdists, wheels),
        }
        write_blocks(update_readme, blocks, args)
        log.info(f"wrote the patch table into {update_readme}")
    elif as_json:
        emit_json(releases.to_json(rows, wheels))
    elif markdown:
        click.echo(releases.needed_markdown(rows, wheels) if needed else releases.markdown_table(rows, wheels))
    else:
        click.echo(releases.text_table(rows, wheels))
    conflicts = [f"{row.version}: {r.patch} ({r.detail})" for row in rows for r in row.results if r.status == "conflict"]
    if conflicts:
        raise PatchError(f"{len(conflicts)} conflict(s): " + "; ".join(conflicts))


def _version(text: str) -> Version:
    try:
        return Version(sources.release_version(text))
    except InvalidVersion:
        raise ConfigError(f"--through {text!r} is not a version") from None


def readme_block(readme: Path, begin: str = README_BEGIN, end: str = README_END) -> tuple[str, str]:
    """The command line arguments and the table of a generated block of ``readme``."""
    text = readme.read_text(encoding="utf-8")
    found = _block(text, begin, end)
    if found is None:
        raise ConfigError(f"{readme}: no generated patch table ({begin.format(args='')} ... {end})")
    return found.group("args"), found.group("table").rstrip("\n")


def _block(text: str, begin: str, end: str) -> re.Match[str] | None:
    pattern = re.escape(begin).replace(re.escape("{args}"), "(?P<args>[^`]*)")
    return re.search(pattern + r"\n(?P<table>(?:.*\n)*?)" + re.escape(end), text)


def write_readme(readme: Path, table: str, args: str) -> None:
    write_blocks(readme, {(README_BEGIN, README_END): table}, args)


def write_blocks(path: Path, blocks: dict[tuple[str, str], str], args: str) -> None:
    """Each generated block ``path`` holds, rewritten; a file that holds none is an error."""
    text = path.read_text(encoding="utf-8")
    held = [(marks, table) for marks, table in blocks.items() if _block(text, *marks) is not None]
    if not held:
        names = " or ".join(f"{b.format(args='')} ... {e}" for b, e in blocks)
        raise ConfigError(f"{path}: no generated patch table ({names})")
    for (begin, end), table in held:
        old_args, old_table = readme_block(path, begin, end)
        old = f"{begin.format(args=old_args)}\n{old_table}{chr(10) if old_table else ''}{end}"
        text = text.replace(old, f"{begin.format(args=args)}\n{table}\n{end}")
        path.write_text(text, encoding="utf-8")
