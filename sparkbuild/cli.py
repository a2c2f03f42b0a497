"""The ``sparkbuild`` command. Thin: builds one frozen Options and calls a stage.

Each command imports the stages it runs, so ``sparkbuild patch ...`` (a verdict in about a second)
does not load Docker, Jinja2 or gitpython first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import click

from sparkbuild import __version__, errors
from sparkbuild.config import options
from sparkbuild.config.options import Options
from sparkbuild.errors import ConfigError, EngineError, FatalError, VerifyError
from sparkbuild.models import model
from sparkbuild.util import log

if TYPE_CHECKING:
    from sparkbuild.lanes import bisect
    from sparkbuild.oci.engine import Engine
    from sparkbuild.plan import plan
    from sparkbuild.plan.matrix import Check, Matrix
    from sparkbuild.verify.verify import Verified, VerifyResult

F = TypeVar("F", bound=Callable[..., Any])
# bisect.STAGES, written here so that --help does not import bisect (and with it Docker and git);
# tests/test_startup.py holds the two equal.
BISECT_STAGES = ("patch", "build", "verify")
# matrix.LANES, written here for the same reason (the same test holds them equal).
LANES = ("nightly", "rc")


def selection(func: F) -> F:
    """The options every matrix-reading command shares."""
    func = click.option("--matrix", type=click.Path(path_type=Path), help="Matrix file (default: matrix.yaml).")(func)
    func = click.option("--only", multiple=True, metavar="GLOB", help="Only targets whose id matches (repeatable).")(func)
    func = click.option("--profile", type=click.Choice(["local", "spark"]), help="Only targets of this profile.")(func)
    func = click.option("--date", metavar="YYYYMMDD", help="Date for readable tags (default: today, UTC).")(func)
    func = click.option(
        "--lock", type=click.Path(path_type=Path), help="Lock file from `sparkbuild resolve` (default: <matrix>.lock.json)."
    )(func)
    return func


def waiting(func: F) -> F:
    """``--no-wait`` for the commands that hold the cache's run lock."""
    return click.option(
        "--no-wait", "no_wait", is_flag=True, help="If another run holds this cache's run lock, stop at once (exit 13)."
    )(func)


def node_options(node_help: str) -> Callable[[F], F]:
    """``--node HOST`` (repeated), ``--interface`` and ``--ssh-config``: the other machines of a cluster."""

    def add(func: F) -> F:
        # Applied last first, so that --help lists them in this order: --node, --interface, --ssh-config.
        path = click.Path(exists=True, dir_okay=False, path_type=Path)
        ssh = "With --node: the ssh config naming the hosts (default: ssh's own)."
        link = "With --node: the interface of the link the nodes share (a Spark pair's QSFP port)."
        func = click.option("--ssh-config", type=path, help=ssh)(func)
        func = click.option("--interface", help=link)(func)
        return click.option("--node", "nodes", multiple=True, metavar="HOST", help=node_help)(func)

    return add


def make_options(**kwargs: Any) -> Options:
    only = kwargs.pop("only", ())
    wait = not kwargs.pop("no_wait", False)
    return Options.from_env(only=tuple(only) or None, wait=wait, **kwargs)


def emit_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def patch_group() -> click.Group:
    # Imported here for start-up: the patch group loads the release and sdist code (tens of ms) that
    # only `sparkbuild patch ...` needs (tests/test_startup.py).
    from sparkbuild.patch.cli import patch_group

    return patch_group


class LazyGroup(click.Group):
    """A group whose ``lazy`` subgroups are imported only when one of them is run or asked for its
    help: click's "Lazily Loading Subcommands" pattern. Its own ``--help`` lists each with the help
    written here beside its loader, so listing imports none of them (tests/test_startup.py holds
    that help equal to the subgroup's own)."""

    def __init__(self, *args: Any, lazy: dict[str, tuple[Callable[[], click.Command], str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy
        self._listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.lazy:
            return super().get_command(ctx, cmd_name)
        load, help_text = self.lazy[cmd_name]
        # While the commands are listed, a stand-in with the same help gives the same line.
        return click.Command(cmd_name, help=help_text) if self._listing else load()

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self._listing = False


# Each lazy subgroup: its loader, and its help as its docstring says it.
LAZY_GROUPS: dict[str, tuple[Callable[[], click.Command], str]] = {
    "patch": (
        patch_group,
        "Check or apply patches/ on a vLLM source tree (an sdist or a git checkout); the support table.",
    ),
}


@click.group(cls=LazyGroup, lazy=LAZY_GROUPS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sparkbuild")
def cli() -> None:
    """Build, patch, verify and publish vLLM images for the NVIDIA DGX Spark."""


@cli.command("doctor")
@click.option("--matrix", type=click.Path(path_type=Path), help="Matrix file (default: matrix.yaml).")
@click.option("--lock", type=click.Path(path_type=Path), help="Lock file (default: <matrix>.lock.json).")
@click.option("--registry", help="host:port of the registry the lanes would use (default: SPARKBUILD_REGISTRY).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@node_options("What HOST (reached with ssh) lacks for `run --node`; the interface checked on this machine and each HOST.")
@click.option("--image", help="With --node: the image every node must hold, the same build as this machine's.")
def doctor_cmd(
    matrix: Path | None,
    lock: Path | None,
    registry: str | None,
    as_json: bool,
    nodes: tuple[str, ...],
    interface: str | None,
    image: str | None,
    ssh_config: Path | None,
) -> None:
    """What this host can run: machine, CPU features, memory, disk, engine and BuildKit, emulation, GPU
    and driver, registry; then each profile, target and check of the matrix, and why not. With --node:
    what this machine and each HOST lack to serve together (docs/multi-node.md)."""
    from sparkbuild.lanes import doctor

    if nodes:
        doctor_nodes(nodes, interface, image, ssh_config, as_json=as_json)
        return

    # Before `sparkbuild init` there is no matrix: the host is still worth a report.
    optional = matrix is None and not options.env("SPARKBUILD_MATRIX")
    found = doctor.report(make_options(matrix=matrix, lock=lock, registry=registry), matrix_optional=optional)
    if as_json:
        emit_json(found.to_json())
    else:
        click.echo(found.text())
    if found.matrix_error is not None:
        raise ConfigError(found.matrix_error)


def doctor_nodes(
    hosts: tuple[str, ...], interface: str | None, image: str | None, ssh_config: Path | None, *, as_json: bool
) -> None:
    """`doctor --node`: each node's findings; exit 4 where one lacks what a run needs (warnings do not fail)."""
    from sparkbuild.lanes import nodes
    from sparkbuild.oci.remote import Node

    head = Node(host=None)
    head_id = None
    if image:
        with contextlib.suppress(EngineError):  # this machine's own finding says it lacks the image
            head_id = nodes.image_id(head, image)
    every = (head, *(Node(host=h, ssh_config=ssh_config) for h in hosts))
    found = {n.name: nodes.examine(n, interface=interface, image=image, head_id=head_id) for n in every}
    if as_json:
        emit_json({name: [dataclasses.asdict(f) for f in findings] for name, findings in found.items()})
    else:
        click.echo("\n".join(f"{name}:\n" + "\n".join(f.line() for f in findings) for name, findings in found.items()))
    lacking = [f"{name}: {f.what}" for name, findings in found.items() for f in findings if f.ok is False]
    if lacking:
        raise EngineError(f"{len(lacking)} thing(s) a multi-node run needs are missing: {'; '.join(lacking)}")


@cli.command("init")
@click.option("--matrix", type=click.Path(path_type=Path, dir_okay=False), help="Where to write it (default: ./matrix.yaml).")
def init_cmd(matrix: Path | None) -> None:
    """Write a commented starter matrix.yaml (Spark and local profiles); never replaces one."""
    from sparkbuild.config import starter

    starter.write(matrix or Path.cwd() / "matrix.yaml")


@cli.command("plan")
@selection
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--ids", is_flag=True, help="Print only the selected target ids, as one compact JSON list (a workflow's job matrix)."
)
@click.option(
    "--lane", type=click.Choice(LANES), default="nightly", show_default=True, help="The lane whose targets --ids lists."
)
def plan_cmd(as_json: bool, ids: bool, lane: str, **kwargs: Any) -> None:
    """Print targets, their build steps and image tags. No Docker, no network."""
    from sparkbuild.build import buildcache
    from sparkbuild.lanes import disk
    from sparkbuild.plan import plan

    if ids:
        click.echo(json.dumps(list(plan.lane_ids(make_options(**kwargs), lane)), separators=(",", ":")))
        return
    if lane != "nightly":
        raise ConfigError(f"--lane {lane} needs --ids: `sparkbuild {lane}` plans its targets once it has found the candidate")
    opts = make_options(**kwargs)
    plans = plan.make(opts)
    if as_json:
        cache = {p.id: buildcache.describe(p, opts.build_cache, opts.registry) for p in plans}
        emit_json([{**p.to_json(), "disk_gb": disk.estimate(p), "build_cache": cache[p.id]} for p in plans])
        return
    for p in plans:
        click.echo(f"{p.id}  ({p.target.profile}, {p.target.platform})")
        click.echo(f"  vllm:    {p.target.vllm.kind} {p.target.vllm.spec}")
        if p.choice is not None:
            click.echo(f"  from:    {p.choice.text()}")
        arch = f"   arch: {p.target.arch_list}" if p.target.cuda else ""
        click.echo(f"  torch:   {p.target.torch}   cuda: {p.target.cuda or 'none'}{arch}")
        click.echo(f"  base:    {p.base_ref}")
        if p.templates is not None:
            click.echo(f"  templates: {p.templates.text()}")
        click.echo(f"  patches: {', '.join(patch_origin(p, name) for name in p.target.patches) or 'none'}")
        for name in p.target.patches:
            click.echo(f"  patch:   {name}: {p.patch_summaries.get(name, '')}")
        if p.jobs is not None:
            click.echo(f"  jobs:    {p.jobs.text()}")
        click.echo(f"  bound:   {p.target.build_timeout_minutes} min a stage build (build_timeout_minutes)")
        if p.target.serve.command():
            click.echo(f"  serve:   {shlex.join(p.target.serve.command())}")
        click.echo(f"  checks:  {', '.join(c.name for c in p.target.checks)}")
        for name, why in p.target.left_out:
            click.echo(f"  left out: {name}: {why}")
        for s in p.stages:
            needs = f"  (uses {', '.join(s.rendered.needs)})" if s.rendered.needs else ""
            click.echo(f"  stage:   {s.name:<11} {s.ref}{needs}")
        for line in buildcache.lines(p, opts.build_cache, opts.registry):
            click.echo(f"  cache:   {line}")
        if p.unresolved:
            click.echo(f"  UNRESOLVED: {', '.join(p.unresolved)} (build refuses; `sparkbuild resolve` pins them)")
        sizes = disk.estimate(p)
        click.echo(f"  disk:    {', '.join(f'{name} ~{gb:g} GB' for name, gb in sizes.items())}  (checked before a run)")
        click.echo(f"  steps:   {' -> '.join(p.steps)}")
        click.echo(f"  image:   {p.repository}:{p.content_tag}")
        click.echo(f"  tags:    {', '.join(p.tags)}")


def patch_origin(p: plan.TargetPlan, name: str) -> str:
    """``name (packaged)``, or with its folder where the matrix's own patches supplied it."""
    found = p.patch_sources.get(name)
    if found is None:
        return name
    return f"{name} (packaged)" if found.origin == "packaged" else f"{name} ({found.text()})"


@cli.command("render")
@selection
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("sparkbuild-out/render"), show_default=True)
def render_cmd(out_dir: Path, **kwargs: Any) -> None:
    """Write each target's stage Dockerfiles and context files to OUT/<target>/NN-<stage>/."""
    from sparkbuild.build import build
    from sparkbuild.plan import plan

    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: a file is there; give a folder (made if missing)")
    for p in plan.make(make_options(**kwargs)):
        for folder in build.write_contexts(p, out_dir / p.id):
            click.echo(f"{p.id}: {folder / 'Dockerfile'}")
        if p.unresolved:
            log.warning(f"{p.id}: {', '.join(p.unresolved)} not pinned; `sparkbuild build` refuses it until `sparkbuild resolve`")


@cli.command("build")
@selection
@click.option(
    "--registry", help="host:port to pull and push stage images (default: SPARKBUILD_REGISTRY; none: stages stay local)."
)
@click.option("--json", "as_json", is_flag=True, help="Print each image and what its stages did as JSON.")
@waiting
def build_cmd(registry: str | None, as_json: bool, **kwargs: Any) -> None:
    """Build the images of the selected targets (no verify, no publish)."""
    from sparkbuild.build import build
    from sparkbuild.lanes import disk, doctor, pipeline
    from sparkbuild.oci.engine import Engine
    from sparkbuild.plan import plan
    from sparkbuild.util import runlock

    opts = make_options(registry=registry, **kwargs)
    plans = plan.make(opts)
    doctor.require([p.target for p in plans], opts, registry=opts.registry is not None, gpu=False)
    engine = Engine()
    with contextlib.ExitStack() as stack:
        stack.enter_context(runlock.run(opts.cache, wait=opts.wait))
        root = disk.engine_root(engine.client.info())
        disk.check(disk.needs(plans, opts.cache, engine_root=root, in_engine=engine.image_exists, registry_storage=None))
        reg = stack.enter_context(pipeline.open_registry(opts)) if opts.registry else None
        results = [build.build(engine, p, opts, reg) for p in plans]
    if as_json:
        emit_json(
            [
                {"target": p.id, "image": r.image, "stages": [s.to_json() for s in r.stages]}
                for p, r in zip(plans, results, strict=True)
            ]
        )
        return
    for p, r in zip(plans, results, strict=True):
        click.echo(f"{p.id}: {r.image}  ({r.summary()})")


@cli.command("resolve")
@click.option("--matrix", type=click.Path(path_type=Path), help="Matrix file (default: matrix.yaml).")
@click.option("--lock", type=click.Path(path_type=Path), help="Lock file to write (default: <matrix>.lock.json).")
@click.option("--json", "as_json", is_flag=True, help="Print every pin as JSON.")
@click.option(
    "--wheels-only",
    is_flag=True,
    help="Pin only upstream's vLLM wheels (package index, check-binary); keep every other pin of the lock.",
)
@waiting
def resolve_cmd(matrix: Path | None, lock: Path | None, as_json: bool, wheels_only: bool, no_wait: bool) -> None:
    """Pin every git ref to a commit, every base image to a digest and upstream's vLLM wheel of each
    Spark release target (judged by check-binary for its GPU); write the lock file."""
    from sparkbuild.lanes import resolve
    from sparkbuild.util import runlock

    opts = make_options(matrix=matrix, lock=lock, no_wait=no_wait)
    with runlock.run(opts.cache, wait=opts.wait):
        result = resolve.resolve(opts, wheels_only=wheels_only)
    log.step_summary(f"## sparkbuild resolve\n\n```\n{resolve.table(result)}\n```")
    if as_json:
        emit_json({"lock": str(result.path), "pins": [p.to_json() for p in result.pins], "wheels": result.lock.wheels})
    else:
        click.echo(resolve.table(result))


@cli.command("rehearse")
@click.option("--matrix", type=click.Path(path_type=Path), help="Matrix file (default: matrix.yaml).")
@click.option("--only", multiple=True, metavar="GLOB", help="Only targets whose id matches (repeatable).")
@click.option("--lock", type=click.Path(path_type=Path), help="Lock file (default: <matrix>.lock.json).")
@click.option(
    "--offline", is_flag=True, help="Sources from PyPI sdists and marked stand-ins on a local git daemon (no GitHub needed)."
)
@click.option("--json", "as_json", is_flag=True, help="Print every rehearsal as JSON.")
def rehearse_cmd(matrix: Path | None, only: tuple[str, ...], lock: Path | None, offline: bool, as_json: bool) -> None:
    """Build every stage of Spark targets here for real, swapping only vLLM's kernel compile for preflight."""
    from sparkbuild.lanes import rehearse

    opts = make_options(matrix=matrix, only=only, lock=lock)
    results = rehearse.rehearse(opts, offline_sources=offline)
    text = rehearse.table(results)
    log.step_summary(f"## sparkbuild rehearse\n\n```\n{text}\n```")
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "rehearse.json").write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    if as_json:
        emit_json([r.to_json() for r in results])
    else:
        click.echo(text)
    skipped = [r.target for r in results if r.not_rehearsable]
    if skipped:
        log.warning(f"rehearse: not rehearsable here (see each reason): {', '.join(skipped)}")
    if len(skipped) == len(results):
        log.warning("rehearse: no target could be rehearsed on this machine; nothing was built")
    failed = [r.target for r in results if r.error]
    if failed:
        raise errors.LaneFailed(
            f"rehearse: {len(failed)} of {len(results) - len(skipped)} rehearsable target(s) failed: {', '.join(failed)}"
        )


@cli.command("reproduce")
@click.argument("targets", nargs=-1, metavar="[TARGET]...")
@click.option("--matrix", type=click.Path(path_type=Path), help="Matrix file (default: matrix.yaml).")
@click.option("--only", multiple=True, metavar="GLOB", help="Only targets whose id matches (repeatable; as TARGET).")
@click.option("--lock", type=click.Path(path_type=Path), help="Lock file (default: <matrix>.lock.json).")
@click.option(
    "--rehearsal", is_flag=True, help="Build Spark targets as `sparkbuild rehearse` does (this machine's platform and bases)."
)
@click.option("--offline", is_flag=True, help="With --rehearsal: sources from PyPI sdists and marked stand-ins (no GitHub).")
@click.option(
    "--stage", "stages", multiple=True, metavar="NAME", help="Only this stage and those it needs (repeatable; default: all)."
)
@click.option("--keep", is_flag=True, help="Keep the two builds' images (sparkbuild/reproduce:...) instead of removing them.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print every finding as JSON (also in sparkbuild-out/<target>/reproduce.json)."
)
@waiting
def reproduce_cmd(
    targets: tuple[str, ...],
    only: tuple[str, ...],
    matrix: Path | None,
    lock: Path | None,
    rehearsal: bool,
    offline: bool,
    stages: tuple[str, ...],
    keep: bool,
    as_json: bool,
    no_wait: bool,
) -> None:
    """Build each TARGET twice without cache and compare the builds: every wheel's members and ELF
    symbols, the installed packages, every file of each stage image; exit 15 when they differ."""
    from sparkbuild.lanes import reproduce

    if not (targets or only):
        raise ConfigError("name the target(s) to build twice: `sparkbuild reproduce TARGET` (`sparkbuild plan` lists them)")
    if offline and not rehearsal:
        raise ConfigError("--offline takes the rehearsal's sources: give --rehearsal with it")
    opts = make_options(matrix=matrix, only=(*targets, *only), lock=lock, no_wait=no_wait)
    results = reproduce.reproduce(opts, rehearsal=rehearsal, offline_sources=offline, keep=keep, stages=stages)
    text = reproduce.table(results)
    log.step_summary(f"## sparkbuild reproduce\n\n```\n{text}\n```")
    if as_json:
        emit_json([r.to_json() for r in results])
    else:
        click.echo(text)
        click.echo("\n".join(f"full findings: {opts.out / r.target / 'reproduce.json'}" for r in results))
    differing = [r.target for r in results if not r.matches]
    if differing:
        raise errors.NotReproducible(
            f"reproduce: two builds without cache differ for {', '.join(differing)}; each difference and its cause: "
            + ", ".join(str(opts.out / t / "reproduce.json") for t in differing)
        )


@cli.command("accept")
@selection
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@waiting
def accept_cmd(as_json: bool, **kwargs: Any) -> None:
    """Build one target, check its binaries, verify it on the GPU; write accept.json and accept.md to attach to an issue."""
    from sparkbuild.lanes import accept
    from sparkbuild.util import runlock

    opts = make_options(**kwargs)
    with runlock.run(opts.cache, wait=opts.wait):
        result = accept.accept(opts)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(result.markdown())
    failed = next((s.error for s in result.steps if s.error is not None), None)
    if failed is not None:
        raise failed  # its own exit code; the report is written


@cli.command("closure")
@click.option("--matrix", type=click.Path(path_type=Path), help="Matrix file (default: matrix.yaml).")
@click.option("--only", multiple=True, metavar="GLOB", help="Only targets whose id matches (repeatable).")
@click.option("--profile", type=click.Choice(["local", "spark"]), help="Only targets of this profile.")
@click.option("--lock", type=click.Path(path_type=Path), help="Lock file (default: <matrix>.lock.json).")
@click.option(
    "--offline",
    is_flag=True,
    help="Read vLLM's requirements from its PyPI sdist (no git remote needed), relaxing the matrix's `rehearsal: relax:` pins.",
)
@click.option("--json", "as_json", is_flag=True, help="Print every closure as JSON.")
def closure_cmd(
    matrix: Path | None, only: tuple[str, ...], profile: str | None, lock: Path | None, offline: bool, as_json: bool
) -> None:
    """Resolve each target's runtime for its own platform and Python: every wheel must exist, torch the
    build the target asks for (Spark: its CUDA build; local: the CPU build); what cannot be checked from
    here is named, never passed."""
    from sparkbuild.build import closure
    from sparkbuild.plan import plan
    from sparkbuild.upstream import gitrepo, sources

    opts = make_options(matrix=matrix, only=only, lock=lock)
    m = plan.load_matrix(opts)
    targets = plan.select(tuple(t for t in m.targets if t.vllm.kind != "candidate"), opts.only, profile)
    found = []
    for t in targets:
        if t.profile == "local":
            with log.step(f"Closure of {t.id} for {t.platform}"):
                found.append(closure.check_local(t, opts))
            continue
        if offline:
            tree = sources.vllm_sdist(t.vllm.version, opts.cache)
            t = dataclasses.replace(t, relax=m.rehearsal.relax)  # this machine's index gaps
        else:
            git = t.vllm.git()
            if git.commit is None:
                raise ConfigError(f"{t.where}: vLLM {git.ref} is not pinned; run `sparkbuild resolve`, or pass --offline")
            tree = gitrepo.Mirror(opts.cache, git.repo).extract(
                git.commit, ("setup.py", "requirements"), opts.cache / "closure" / t.id
            )
        with log.step(f"Closure of {t.id} for {t.platform}"):
            found.append(closure.check(t, tree, opts))
    if as_json:
        emit_json([c.to_json() for c in found])
    else:
        click.echo("\n".join(c.text() for c in found))
    bad = [c for c in found if not c.ok]
    if bad:
        raise errors.BuildError(
            f"{len(bad)} of {len(found)} target(s) have no runtime proven installable here: "
            + "; ".join(f"{c.target}: {c.verdict}" for c in bad)
        )


@cli.command("model")
@click.argument("name", type=click.Choice(model.names()))
def model_cmd(name: str) -> None:
    """Make (or find in the cache) a check model and print its folder."""
    click.echo(model.ensure(Options.from_env().cache, name))


@cli.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("image")
@click.argument("model")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--port", type=int, default=8000, show_default=True, help="Where the OpenAI API listens (host network).")
@click.option("--name", help="The container's name.")
@click.option("--detach", "-d", is_flag=True, help="Start it in the background and print the command.")
@click.option(
    "--hf-cache",
    type=click.Path(file_okay=False, path_type=Path),
    help="The host's Hugging Face cache to mount (default: $HF_HOME, else ~/.cache/huggingface).",
)
@click.option(
    "--volume-prefix",
    default="sparkbuild-",
    show_default=True,
    help="The JIT caches' named volumes are PREFIX<cache> (flashinfer, vllm, inductor, triton, cuda).",
)
@click.option("--gpus/--no-gpus", default=None, help="Give it every GPU (default: unless the image has no CUDA).")
@click.option("--print", "print_only", is_flag=True, help="Print the docker run command; start nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --print or --detach: the command as a JSON list.")
@node_options(
    "Serve across this machine and HOST (repeat for more), reached with ssh: vLLM's multi-node launch, tensor parallel."
)
@click.option(
    "--master-port", type=int, help="With --node: where the nodes meet on this machine (default: 29501; with Ray, 6379)."
)
@click.option(
    "--launch",
    "launch_with",
    type=click.Choice(["vllm", "ray"]),
    default="vllm",
    show_default=True,
    help="With --node: vLLM's own multi-node launch, or Ray (ray start on every node, then vllm serve on this one).",
)
def run_cmd(
    image: str,
    model: str,
    vllm_args: tuple[str, ...],
    port: int,
    name: str | None,
    detach: bool,
    hf_cache: Path | None,
    volume_prefix: str,
    gpus: bool | None,
    print_only: bool,
    as_json: bool,
    nodes: tuple[str, ...],
    interface: str | None,
    master_port: int | None,
    launch_with: str,
    ssh_config: Path | None,
) -> None:
    """Serve MODEL with IMAGE as a Spark needs it: host IPC and network, the GPUs, the Hugging Face
    cache, and the JIT caches (FlashInfer, torch.compile, Inductor, Triton, CUDA) on named volumes.
    VLLM_ARGS go to `vllm serve` after the image's serving defaults; put them after `--`.
    With --node, this machine and each HOST serve it together (docs/multi-node.md)."""
    from sparkbuild.lanes import launch

    spec = launch.Launch(
        image=image,
        model=model,
        args=vllm_args,
        name=name,
        port=port,
        hf_cache=hf_cache,
        prefix=volume_prefix,
        gpus=gpus,
        detach=detach,
    )
    if nodes or interface or ssh_config or launch_with != "vllm":
        run_cluster(spec, nodes, interface, master_port, ssh_config, print_only=print_only, launch_with=launch_with)
        return
    args = launch.run(spec, dry_run=print_only)
    if as_json:
        emit_json(args)
    elif print_only:
        click.echo(shlex.join(args))


def run_cluster(
    spec: Any,
    hosts: tuple[str, ...],
    interface: str | None,
    master_port: int | None,
    ssh_config: Path | None,
    *,
    print_only: bool,
    launch_with: str = "vllm",
) -> None:
    """`sparkbuild run --node`: this machine and each host serving one model (sparkbuild/lanes/nodes.py)."""
    from sparkbuild.lanes import nodes
    from sparkbuild.oci.remote import Node

    if not hosts or not interface:
        raise ConfigError(
            "--node and --interface go together (--launch and --ssh-config need them): the hosts to serve with, and the "
            "interface they share"
        )
    if print_only:
        raise ConfigError("--print: a cluster's commands depend on what each node says (its address); run without --print")
    found = nodes.Cluster(
        launch=spec,
        nodes=tuple(Node(host=h, ssh_config=ssh_config) for h in hosts),
        interface=interface,
        master_port=master_port,
        launch_with=launch_with,
    )
    names = nodes.start(found, follow=not spec.detach)
    if spec.detach:
        click.echo("\n".join(names))


@cli.command("verify")
@click.argument("image", required=False)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Serve this model folder instead of the check's own.",
)
@click.option("--url", help="Check a server that is already running (http://HOST:PORT) instead of serving IMAGE.")
@click.option(
    "--log",
    "log_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --url: the server's startup log, which the kernel-path gate reads (docker logs NAME > FILE 2>&1).",
)
@click.option("--check", "check_name", help="Check to run (default: every check of the image's target, the first benchmarked).")
@click.option("--matrix", type=click.Path(path_type=Path))
@click.option(
    "--result",
    type=click.Path(path_type=Path),
    help="First check's result file (default: sparkbuild-out/<target>/verify.json); the others' go in checks/NAME/ beside it.",
)
@node_options(
    "A check served across nodes runs its nodes past this machine on HOST, reached with ssh (SPARKBUILD_NODES; with "
    "--interface: SPARKBUILD_NODE_INTERFACE, --ssh-config: SPARKBUILD_SSH_CONFIG)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify_cmd(
    image: str | None,
    model_dir: Path | None,
    url: str | None,
    log_file: Path | None,
    check_name: str | None,
    matrix: Path | None,
    result: Path | None,
    nodes: tuple[str, ...],
    interface: str | None,
    ssh_config: Path | None,
    as_json: bool,
) -> None:
    """Serve IMAGE (or check the server at --url): its known answers, its kernel path, its speed.
    A check served across nodes runs them here (the local profile) or on --node HOST (docs/multi-node.md)."""
    from sparkbuild.lanes import pipeline
    from sparkbuild.plan import matrix as matrix_mod
    from sparkbuild.verify import verify

    if (image is None) == (url is None):
        raise ConfigError("verify: give an IMAGE to serve, or --url of a running server (with --check NAME), not both")
    if log_file is not None and url is None:
        raise ConfigError("verify: --log goes with --url (sparkbuild reads the log of a server it starts itself)")
    opts = make_options(matrix=matrix, nodes=nodes or None, node_interface=interface, ssh_config=ssh_config)
    loaded = matrix_mod.load(opts.matrix)
    checks = loaded.checks
    if check_name is not None and check_name not in checks:
        raise ConfigError(f"{opts.matrix}: no check '{check_name}'; known: {', '.join(checks)}")
    if url is not None:
        if check_name is None:
            raise ConfigError(f"verify --url: name the check to run with --check NAME (known: {', '.join(checks)})")
        out = result or opts.out / "url" / "verify.json"
        res = _judged(lambda: verify.verify_url(url, checks[check_name], out, log_file), out, as_json)
        if as_json:
            emit_json(res.to_json())
        else:
            click.echo(f"{res.image}: {pipeline.verify_cell(res)}; result in {out}")
        return
    assert image is not None
    found = _verify_image(image, loaded, check_name, model_dir, result, opts)
    if as_json:
        emit_json([r.to_json() for r in found.results.values()])
    else:
        click.echo(f"{image}: {pipeline.verified_cell(found)}")
    found.require()


def _judged(run: Callable[[], VerifyResult], out: Path, as_json: bool) -> VerifyResult:
    """``run()``; on a failure with --json, the result written so far is printed first."""
    try:
        return run()
    except VerifyError:
        if as_json and out.is_file():
            click.echo(out.read_text())
        raise


def _verify_image(
    image: str, loaded: Matrix, check_name: str | None, model_dir: Path | None, result: Path | None, opts: Options
) -> Verified:
    """Verify IMAGE: its target's checks (from its label) unless one is named, on the GPU for a Spark image."""
    from sparkbuild.oci.engine import Engine
    from sparkbuild.verify import multinode, verify

    engine = Engine()
    labels = engine.inspect(image)["Config"].get("Labels") or {}
    target_id = labels.get("io.sparkbuild.target")
    by_target = {t.id: t.checks for t in loaded.targets}
    checks: tuple[Check, ...]
    if check_name is not None:
        checks = (loaded.checks[check_name],)
    elif target_id in by_target:
        checks = by_target[target_id]
    else:
        raise ConfigError(f"{image} names no target of {opts.matrix} (label io.sparkbuild.target={target_id}); pass --check NAME")
    if model_dir is not None and len(checks) > 1:
        raise ConfigError(f"verify --model serves one model: name its check with --check (the target has {len(checks)})")
    out = result or opts.out / (target_id or "image") / "verify.json"
    # A Spark image (it names the GPU it is for) serves on the GPU; a CPU image does not.
    gpus = "io.sparkbuild.gpu" in labels and labels.get("io.sparkbuild.cuda") != "none"
    # One check of the target: its result where the target's results go (where publish looks).
    names = [c.name for c in by_target.get(target_id or "", ())]
    layout = names if result is None and all(c.name in names for c in checks) else ()
    peers = multinode.peers_of(opts)
    return verify.verify_all(engine, image, checks, out, cache=opts.cache, gpus=gpus, model=model_dir, layout=layout, peers=peers)


@cli.command("publish")
@selection
@click.option("--registry", help="host:port of the registry (default: SPARKBUILD_REGISTRY, else an embedded one).")
@click.option("--unverified", is_flag=True, help="Publish without a passing verify result.")
@waiting
def publish_cmd(registry: str | None, unverified: bool, **kwargs: Any) -> None:
    """Push built images by digest, check the digest, attach SBOM, provenance and verify result, then move readable tags."""
    from sparkbuild.lanes import disk, pipeline
    from sparkbuild.oci.engine import Engine
    from sparkbuild.plan import plan
    from sparkbuild.publish import attest, publish
    from sparkbuild.util import runlock

    opts = make_options(registry=registry, **kwargs)
    engine = Engine()
    plans = plan.make(opts)
    for p in plans:
        require_verified(engine, opts, p, unverified)
    with runlock.run(opts.cache, wait=opts.wait), pipeline.open_registry(opts) as reg:
        storage = opts.cache / "registry" / "storage" if opts.registry is None else None
        todo = [p for p in plans if reg.digest(p.repository, p.content_tag) is None]
        disk.check(disk.needs(todo, opts.cache, engine_root=None, in_engine=engine.image_exists, registry_storage=storage))
        for p in plans:
            evidence = attest.Evidence.of(opts, p, p.local_ref)
            done = publish.push(engine, reg, p, p.local_ref, verified=not unverified, evidence=evidence, signer=opts.signer)
            click.echo(f"{p.id}: {done.reference} ({', '.join(done.tags)}; {done.signature})")


def require_verified(engine: Engine, opts: Options, p: plan.TargetPlan, unverified: bool) -> None:
    """A passing result of every check of the target, each tied to this image (``verify.tie``:
    its ID, its server's vLLM version and log), or --unverified."""
    from sparkbuild.verify import layout, verify

    if unverified:
        return
    local = p.local_ref
    inspected = engine.inspect(local)
    files = layout.result_files(opts.out / p.id / "verify.json", p.target.checks)
    lacking = [
        f"{name} ({path}: {why})" for name, path in files.items() if (why := verify.tie(path, local, inspected)) is not None
    ]
    if lacking:
        raise VerifyError(
            f"{local} has no passing verify result of check {'; '.join(lacking)}; run "
            f"`sparkbuild verify {local}` first, or pass --unverified"
        )


@cli.command("inspect")
@click.argument("image")
@click.option(
    "--registry",
    help="host:port for an IMAGE named without one (default: SPARKBUILD_REGISTRY, else the cache's embedded registry).",
)
@click.option("--json", "as_json", is_flag=True, help="Print everything attached as JSON (the documents in full).")
def inspect_cmd(image: str, registry: str | None, as_json: bool) -> None:
    """Print what is attached to a published IMAGE (host/repo@sha256:..., host/repo:tag): SBOM, provenance, verify."""
    from sparkbuild.publish import inspection

    opts = make_options(registry=registry)
    host, repository, reference = inspection.parse_image(image)
    with inspection.reach(host, opts.registry, opts.cache, opts.registry_limits) as reg:
        report = inspection.inspect(reg, repository, reference)
    if as_json:
        emit_json(report)
        return
    click.echo(inspection.text(report))


@cli.command("report")
@selection
@click.option(
    "--repository",
    "repositories",
    multiple=True,
    help="A repository to report on (repeatable; default: those of the matrix's selected targets).",
)
@click.option("--registry", help="host:port of the registry (default: SPARKBUILD_REGISTRY, else the cache's embedded registry).")
@click.option(
    "--site",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder to write the site into, replaced whole (default: <out>/report).",
)
@click.option(
    "--nights",
    type=click.IntRange(min=1),
    default=30,
    show_default=True,
    help="Nights the grid, the tables under the plots and the image pages show (the plots: every night).",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was read and where the site is, as JSON.")
def report_cmd(
    repositories: tuple[str, ...], registry: str | None, site: Path | None, nights: int, as_json: bool, **kwargs: Any
) -> None:
    """Write a static site of every night's images, gates and speed, read from the registry alone."""
    from sparkbuild.publish import inspection
    from sparkbuild.report import site as report_site

    opts = make_options(registry=registry, **kwargs)
    if not repositories:
        from sparkbuild.plan import plan

        repositories = tuple(dict.fromkeys(p.repository for p in plan.make(opts)))
    dest = site or opts.out / "report"
    with inspection.reach(None, opts.registry, opts.cache, opts.registry_limits) as reg:
        made = report_site.make(reg, repositories, dest, opts.cache, nights)
    if as_json:
        emit_json({"index": str(made.index), "repositories": made.counts})
        return
    read = "; ".join(f"{r['repository']}: {r['runs']} run(s), {r['images']} image(s)" for r in made.counts)
    click.echo(f"{made.index}: {read}")


@cli.command("wheels")
@click.argument("image")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder to fetch into.")
@click.option(
    "--registry",
    help="host:port for an IMAGE named without one (default: SPARKBUILD_REGISTRY, else the cache's embedded registry).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the files, their hashes and the build marker as JSON.")
def wheels_cmd(image: str, out: Path, registry: str | None, as_json: bool) -> None:
    """Fetch the wheels published with IMAGE (vLLM, FlashInfer, Triton when built) into OUT, checked by sha256."""
    from sparkbuild.publish import inspection, wheels

    opts = make_options(registry=registry)
    host, repository, reference = inspection.parse_image(image)
    with inspection.reach(host, opts.registry, opts.cache, opts.registry_limits) as reg:
        fetched = wheels.fetch(reg, repository, reference, out)
    if as_json:
        emit_json(fetched.to_json())
        return
    click.echo(wheels.text(fetched))


@cli.command("gc")
@selection
@click.option("--registry", help="host:port of the registry (default: SPARKBUILD_REGISTRY, else an embedded one).")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print every decision as JSON.")
@waiting
def gc_cmd(registry: str | None, dry_run: bool, as_json: bool, **kwargs: Any) -> None:
    """Keep each nightly target's newest keep_nightlies images; delete older ones no other tag points to."""
    from sparkbuild.lanes import pipeline
    from sparkbuild.plan import plan
    from sparkbuild.publish import retention
    from sparkbuild.util import runlock

    opts = make_options(registry=registry, **kwargs)
    targets = plan.select(tuple(t for t in plan.load_matrix(opts).targets if t.lane == "nightly"), opts.only, opts.profile)
    with runlock.run(opts.cache, wait=opts.wait), pipeline.open_registry(opts) as reg:
        decisions = retention.gc(reg, targets, dry_run=dry_run)
    if as_json:
        emit_json({"dry_run": dry_run, "decisions": [d.to_json() for d in decisions]})
        return
    gone = sum(d.action == "delete" for d in decisions)
    click.echo(f"{'would delete' if dry_run else 'deleted'} {gone}, kept {len(decisions) - gone} image tag(s)")


@cli.command("rollback")
@click.argument("target_id", metavar="TARGET")
@click.option("--to", "to", metavar="DIGEST|TAG", help="Where to point the tags (default: the target's last-good tag).")
@click.option("--matrix", type=click.Path(path_type=Path), help="Matrix file (default: matrix.yaml).")
@click.option("--lock", type=click.Path(path_type=Path), help="Lock file (default: <matrix>.lock.json).")
@click.option("--registry", help="host:port of the registry (default: SPARKBUILD_REGISTRY, else an embedded one).")
@click.option("--json", "as_json", is_flag=True, help="Print each tag's before and after as JSON.")
@waiting
def rollback_cmd(target_id: str, to: str | None, registry: str | None, as_json: bool, **kwargs: Any) -> None:
    """Point TARGET's readable tags without {date} back at its last-good image (or --to), printing before and after."""
    from sparkbuild.lanes import pipeline
    from sparkbuild.plan import plan
    from sparkbuild.plan.matrix import readable_tag
    from sparkbuild.publish import retention
    from sparkbuild.util import runlock

    opts = make_options(registry=registry, **kwargs)
    target = retention.find_target(plan.load_matrix(opts).targets, target_id)
    tags = tuple(readable_tag(t, {"vllm_version": target.version, "id": target.id}, target) for t in retention.moving(target))
    with runlock.run(opts.cache, wait=opts.wait), pipeline.open_registry(opts) as reg:
        moves = retention.rollback(reg, target, tags, to)
    if as_json:
        emit_json([m.to_json() for m in moves])
        return
    for m in moves:
        state = "unchanged" if m.before == m.after else f"{m.before or '(none)'} -> {m.after}"
        click.echo(f"{target.repository}:{m.tag}  {state}")


@cli.command("nightly")
@selection
@click.option("--registry", help="host:port of the registry (default: SPARKBUILD_REGISTRY, else an embedded one).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary rows as JSON.")
@waiting
def nightly_cmd(registry: str | None, as_json: bool, **kwargs: Any) -> None:
    """Plan, build, verify and publish every target; print a summary."""
    from sparkbuild.lanes import pipeline

    runs = pipeline.nightly(make_options(registry=registry, **kwargs), table_to_stderr=as_json)
    if as_json:
        emit_json([r.row() for r in runs])


@cli.command("rc")
@selection
@click.option("--registry", help="host:port of the registry (default: SPARKBUILD_REGISTRY, else an embedded one).")
@click.option("--dry-run", is_flag=True, help="Find the candidate and check the patches on it; build nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the candidate and the summary rows as JSON.")
@waiting
def rc_cmd(registry: str | None, dry_run: bool, as_json: bool, **kwargs: Any) -> None:
    """The release-candidate lane: newest vLLM rc -> patch check -> build, verify, publish (tags X.Y.ZrcN, rc)."""
    from sparkbuild.lanes import rc

    opts = make_options(registry=registry, **kwargs)
    try:
        result = rc.rc(opts, dry_run=dry_run, table_to_stderr=as_json)
    except errors.LaneFailed:
        if as_json and (opts.out / "rc.json").is_file():
            click.echo((opts.out / "rc.json").read_text())
        raise
    if as_json:
        emit_json(result.to_json())


@cli.command("summary")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--targets", "targets_json", required=True, metavar="JSON", help="The planned target ids, as `plan --ids` printed them."
)
@click.option("--prefix", default="", metavar="TEXT", help="Each target's folder is FOLDER/<TEXT><target id>.")
@click.option("--lane", type=click.Choice(LANES), default="nightly", show_default=True, help="The lane, for the heading.")
@click.option("--json", "as_json", is_flag=True, help="Print the merged rows as JSON (the table goes to stderr).")
def summary_cmd(folder: Path, targets_json: str, prefix: str, lane: str, as_json: bool) -> None:
    """Merge a fanned-out lane's summary.json files (one per target's job) into one table; fail if any target did."""
    from sparkbuild.lanes import summary

    targets = summary.parse_targets(targets_json)
    rows = summary.merge(targets, folder, prefix)
    text = "\n\n".join(
        filter(None, (summary.table(rows), summary.reasons(rows), summary.check_notes(rows), summary.speeds(rows)))
    )
    click.echo(f"{text}\n\n{len(targets)} target(s), one job each", err=as_json)
    log.step_summary(f"## sparkbuild {lane}: every target\n\n{text}")
    if as_json:
        emit_json(rows)
    failed = summary.failed(rows)
    if failed:
        raise errors.LaneFailed(
            f"{lane}: {len(failed)} of {len(targets)} target(s) failed or left no summary: {', '.join(failed)}"
        )


@cli.command("bisect")
@click.option("--good", required=True, metavar="REF", help="A tag, branch or commit where the stage passes.")
@click.option("--bad", required=True, metavar="REF", help="A later one where it fails.")
@click.option("--stage", type=click.Choice(BISECT_STAGES), default="patch", show_default=True, help="What must pass.")
@click.option("--patch", "names", multiple=True, metavar="NAME", help="Only this patch (repeatable; stage patch).")
@click.option("--matrix", type=click.Path(path_type=Path), help="Matrix file (default: matrix.yaml).")
@click.option("--only", multiple=True, metavar="GLOB", help="The target whose patches (and build) to use.")
@click.option("--lock", type=click.Path(path_type=Path), help="Lock file (default: <matrix>.lock.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the result and every step as JSON.")
@waiting
def bisect_cmd(
    good: str,
    bad: str,
    stage: bisect.Stage,
    names: tuple[str, ...],
    matrix: Path | None,
    only: tuple[str, ...],
    lock: Path | None,
    as_json: bool,
    no_wait: bool,
) -> None:
    """Name the first upstream vLLM commit between GOOD and BAD at which STAGE fails."""
    from sparkbuild.lanes import bisect
    from sparkbuild.util import runlock

    opts = make_options(matrix=matrix, only=only, lock=lock, no_wait=no_wait)
    with runlock.run(opts.cache, wait=opts.wait):
        result = bisect.bisect(opts, good, bad, stage, names)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(result.text())


@cli.command("check-binary")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--arch", default="12.1a", show_default=True, help="The GPU the code must run on (12.1a: the DGX Spark).")
@click.option("--json", "as_json", is_flag=True, help="Print one entry per library as JSON, with every kernel and its verdict.")
def check_binary_cmd(paths: tuple[Path, ...], arch: str, as_json: bool) -> None:
    """Judge every kernel in CUDA objects, libraries and wheels for the GPU ARCH; fail naming each kernel
    that has code for ARCH's family (sm_12x) but none that runs on ARCH.

    A kernel runs from a cubin (sass) or from PTX the driver JIT-compiles (ptx); one with code only for
    other GPUs (sm_90a) is listed as not for this GPU. Folders are searched for *.so and *.o; a wheel
    (*.whl) has each of its shared libraries checked. Exit 11 on a failing kernel, or when no kernel at
    all runs on ARCH. Uses cuobjdump (PyPI: nvidia-cuda-cuobjdump). See docs/check-binary.md.
    """
    from sparkbuild.build import binaries

    device = binaries.Arch.parse(arch)
    reports = binaries.check(list(paths), device)
    if as_json:
        emit_json([r.to_json() for r in reports])
    else:
        click.echo(binaries.table(reports, device))
    binaries.require(reports, device)


def _terminate(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so `finally` blocks remove containers and stop the registry.
    raise KeyboardInterrupt


def main() -> None:
    """Run the command; every way out is a code of ``errors.EXIT_CODES``."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:  # click's name for a KeyboardInterrupt inside a command
        log.error("interrupted")
        sys.exit(errors.INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(ConfigError.exit_code)  # a usage mistake, like any other invalid input
    except FatalError as exc:
        log.error(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        log.error("interrupted")
        sys.exit(errors.INTERRUPTED)
    except Exception:
        traceback.print_exc()
        log.error(f"this is a bug in sparkbuild {__version__}, not in its input; please report it with the traceback above")
        sys.exit(errors.INTERNAL)
