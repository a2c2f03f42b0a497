"""Run options: one frozen dataclass, read once. Precedence: defaults.yaml, environment, command line."""

from __future__ import annotations

import datetime as dt
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, overload

from sparkbuild.errors import ConfigError
from sparkbuild.resources import packaged
from sparkbuild.util import yamlsrc
from sparkbuild.util.net import check_address

GIB = 1024**3
# BuildKit's cache across runners (sparkbuild/build/buildcache.py): SPARKBUILD_BUILD_CACHE.
BuildCacheSetting = Literal["auto", "registry", "inline", "off"]
BUILD_CACHE_SETTINGS: tuple[BuildCacheSetting, ...] = get_args(BuildCacheSetting)
# Who signs a published digest (sparkbuild/publish/sign.py): SPARKBUILD_SIGN.
SignSetting = Literal["auto", "key", "keyless", "off"]
SIGN_SETTINGS: tuple[SignSetting, ...] = get_args(SignSetting)
COSIGN_KEY = "SPARKBUILD_COSIGN_KEY"
UNSIGNED = (
    "not signed: no signer configured. Set SPARKBUILD_COSIGN_KEY and COSIGN_PASSWORD (a cosign key pair), "
    "or SPARKBUILD_SIGN=keyless on a GitHub runner with id-token: write; SPARKBUILD_SIGN=off says it is meant"
)


# Every environment variable sparkbuild reads, with what it means: the one declaration. Options.from_env
# reads the run's options; every other read goes through env() below, except in the modules options
# stands on (log) and in code that runs inside images (the patch engine, the image scripts), which
# read their variable themselves. docs/configuration.md lists exactly these (a test holds the two,
# and every read in the code, to this table).
VARIABLES: dict[str, str] = {
    "SPARKBUILD_REGISTRY": "`host:port` of the registry; unset: an embedded Debian `docker-registry` on 127.0.0.1, "
    "data in the cache",
    "SPARKBUILD_REGISTRY_USER": "basic auth user for that registry",
    "SPARKBUILD_REGISTRY_PASSWORD": "basic auth password for that registry",
    "SPARKBUILD_CACHE": "models, build contexts, embedded registry data (default `~/.cache/sparkbuild`)",
    "SPARKBUILD_OUT": "build logs, verify results, `summary.json` (default `./sparkbuild-out`)",
    "SPARKBUILD_DATE": "the date in readable tags (default: today, UTC)",
    "SPARKBUILD_CA_BUNDLE": "CA bundle given to pip in builds as a BuildKit secret, never in a layer",
    "SPARKBUILD_PYPI_SIMPLE": "PEP 503 index for sdists and for the upstream vLLM wheels `resolve` pins "
    "(default `https://pypi.org/simple/`)",
    "SPARKBUILD_TORCH_CPU_INDEX": "PyTorch's CPU index, for `torch_index: auto` on the local profile where no `find-links` "
    "folder holds the wheel (default: `defaults.yaml` `options:`)",
    "SPARKBUILD_MATRIX": "the matrix file (default `./matrix.yaml`)",
    "SPARKBUILD_SIGN": "who signs a published digest: `auto` (default: `key` where `SPARKBUILD_COSIGN_KEY` is set, "
    "else none, said), `key`, `keyless`, `off`",
    "SPARKBUILD_COSIGN_KEY": "the cosign private key (PEM); its password in `COSIGN_PASSWORD`, which cosign reads",
    "SPARKBUILD_COSIGN_PUB": "the public key the signature check uses (default: the private key's public half)",
    "SPARKBUILD_COSIGN_TLOG": "`0`: no transparency log (a registry that stays internal); default `1`",
    "SPARKBUILD_SIGN_IDENTITY": "keyless: the certificate identity the check requires "
    "(default `^https://github.com/$GITHUB_REPOSITORY/`)",
    "SPARKBUILD_DOCKERFILES": "the one folder of profiles to use (default: `dockerfiles/` beside the matrix, "
    "then the packaged one, per profile)",
    "SPARKBUILD_PATCHES": "the patches folder of `sparkbuild patch` (default: `./patches`, then the packaged set); "
    "a matrix names its own with `patches_dir:`",
    "SPARKBUILD_LOCK": "lock file written by `resolve` and read by every command (default: `<matrix>.lock.json`)",
    "SPARKBUILD_DOCKER_CLI": "docker CLI for builds (default: the first with buildx, or a pre-23 client with BuildKit)",
    "SPARKBUILD_BUILD_CACHE": "BuildKit's cache across runners: `auto` (default: registry cache with a buildx builder "
    "that exports one, else inline), `registry`, `inline` or `off`",
    "SPARKBUILD_BUILD_MEMORY_GB": "the memory the compile may use (default: this machine's available memory)",
    "SPARKBUILD_BUILD_CORES": "the cores the compile may use (default: this machine's)",
    "SPARKBUILD_PUSH_STALL_S": "seconds without push progress before a push fails (default: `defaults.yaml` `registry:`)",
    "SPARKBUILD_PUSH_DEADLINE_S": "seconds a whole push may take (default: `defaults.yaml` `registry:`)",
    "SPARKBUILD_TOKEN_REALMS": "token-service hosts (`HOST` or `HOST:PORT`, comma-separated) that may receive "
    "the registry's credentials",
    "SPARKBUILD_CUOBJDUMP": "the cuobjdump that `check-binary` and preflight run (default: the PATH's, "
    "then PyPI's `nvidia-cuda-cuobjdump` in sparkbuild's environment)",
    "SPARKBUILD_BINFMT_MISC": "the binfmt_misc folder `doctor` and the lanes read emulation handlers from (default "
    "`/proc/sys/fs/binfmt_misc`); the tests point it at an empty folder to be a host without a handler",
    "SPARKBUILD_NODES": "the other machines (ssh hosts, comma- or space-separated) a check served across nodes runs its "
    "nodes past the head on (`verify --node`); unset: a Spark target skips such a check, the local profile serves "
    "every node here",
    "SPARKBUILD_NODE_INTERFACE": "the interface of the link those machines share with this one (`--interface`; a "
    "Spark pair's QSFP port)",
    "SPARKBUILD_SSH_CONFIG": "the ssh config that names those machines (`--ssh-config`; default: ssh's own)",
}
# Set by others (the CI, pip, the Hub client, the desktop), read by sparkbuild; also declared once.
READ_FROM_OTHERS: dict[str, str] = {
    "XDG_CACHE_HOME": "the cache's parent folder (default `~/.cache`)",
    "GITHUB_ACTIONS": "`true` on GitHub Actions: log groups and the step summary",
    "GITHUB_STEP_SUMMARY": "the file GitHub Actions shows as the step summary; the lane's table is added to it",
    "GITHUB_SERVER_URL": "GitHub Actions: the run's link in the summary and the provenance",
    "GITHUB_REPOSITORY": "GitHub Actions: the run's link, the provenance, and keyless signing's default identity",
    "GITHUB_RUN_ID": "GitHub Actions: the run's link in the summary and the provenance",
    "GITHUB_RUN_ATTEMPT": "GitHub Actions: the run's attempt in the provenance",
    "GITHUB_SHA": "GitHub Actions: sparkbuild's own commit in the provenance (else `git rev-parse`)",
    "PIP_FIND_LINKS": "pip's find-links folders, where `torch_index: auto` looks for a local torch wheel",
    "PIP_CONFIG_FILE": "pip's configuration file, read for its `find-links` the same way",
    "HF_TOKEN": "the Hub token a check's hub model is fetched with; read by huggingface_hub, never shown",
    "HF_ENDPOINT": "a team's mirror of the Hugging Face Hub",
    "HF_HOME": "the host's Hugging Face cache `sparkbuild run` mounts (default `~/.cache/huggingface`)",
    "DOCKER_HOST": "the Docker engine's address `sparkbuild doctor` reports (default the local socket)",
}


@overload
def env(name: str) -> str | None: ...
@overload
def env(name: str, default: str) -> str: ...
def env(name: str, default: str | None = None) -> str | None:
    """A declared variable's value (``os.environ.get``); an undeclared name is a bug in sparkbuild."""
    if name not in VARIABLES and name not in READ_FROM_OTHERS:
        raise KeyError(f"{name} is read but not declared in sparkbuild/config/options.py VARIABLES")
    return os.environ.get(name, default)


@cache
def defaults() -> dict[str, Any]:
    text = packaged.resource("defaults.yaml").read_text(encoding="utf-8")
    data: dict[str, Any] = yamlsrc.load_shipped(text)
    return data


def default_cache() -> Path:
    base = env("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparkbuild"


def today() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d")


@dataclass(frozen=True, kw_only=True)
class Limits:
    """How hard to try against a registry (``defaults.yaml`` ``registry:``; the push limits also from the environment)."""

    attempts: int
    backoff_initial_s: float
    backoff_max_s: float
    retry_after_max_s: float
    give_up_after_s: float
    timeout_s: float
    push_attempts: int
    push_stall_s: float
    push_deadline_s: float

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], **overrides: Any) -> Limits:
        values = {**{k: data[k] for k in cls.__dataclass_fields__}, **overrides}
        return cls(**values)


def default_limits() -> Limits:
    return Limits.from_mapping(defaults()["registry"])


@dataclass(frozen=True, kw_only=True)
class Signer:
    """Who signs a published digest with cosign (``SPARKBUILD_SIGN``); sparkbuild/publish/sign.py signs and checks."""

    mode: Literal["key", "keyless", "none"]
    # Why there is none ("off" asked for, or nothing configured): said with every image.
    why: str = ""
    tlog: bool = True
    identity: str = ""

    @classmethod
    def from_env(cls, setting: str, env: Mapping[str, str]) -> Signer:
        if setting not in SIGN_SETTINGS:
            raise ConfigError(f"SPARKBUILD_SIGN={setting!r}: expected one of {', '.join(SIGN_SETTINGS)}")
        tlog = _flag("SPARKBUILD_COSIGN_TLOG", env.get("SPARKBUILD_COSIGN_TLOG", "1"))
        if setting == "off":
            return cls(mode="none", why="not signed (SPARKBUILD_SIGN=off)")
        if setting == "keyless":
            repository = env.get("GITHUB_REPOSITORY", "")
            identity = env.get("SPARKBUILD_SIGN_IDENTITY") or (f"^https://github.com/{repository}/" if repository else "")
            if not identity:
                raise ConfigError("SPARKBUILD_SIGN=keyless: set SPARKBUILD_SIGN_IDENTITY (the signer's identity, a regex)")
            return cls(mode="keyless", identity=identity)
        if env.get("SPARKBUILD_COSIGN_KEY"):
            return cls(mode="key", tlog=tlog)
        if setting == "key":
            raise ConfigError(f"SPARKBUILD_SIGN=key: set {COSIGN_KEY} (a cosign private key) and COSIGN_PASSWORD")
        return cls(mode="none", why=UNSIGNED)

    def describe(self) -> str:
        """The summary row's word for what was done."""
        return {"key": "cosign (key)", "keyless": "cosign (keyless)", "none": "unsigned"}[self.mode]


def _no_signer() -> Signer:
    return Signer(mode="none", why="not signed (SPARKBUILD_SIGN=off)")


def host_resources() -> tuple[int, int]:
    """(available memory in bytes, usable cores) of this machine, where BuildKit runs the compile."""
    meminfo = Path("/proc/meminfo")
    lines = meminfo.read_text(encoding="ascii").splitlines() if meminfo.is_file() else []
    found = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    available = found[0] if found else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available, len(os.sched_getaffinity(0))


@dataclass(frozen=True, kw_only=True)
class Options:
    matrix: Path
    # SPARKBUILD_DOCKERFILES: the one folder of profiles; None: beside the matrix, then the packaged ones.
    dockerfiles: Path | None = None
    cache: Path
    out: Path
    date: str
    only: tuple[str, ...] = ()
    profile: str | None = None
    # The lock file; None: <matrix>.lock.json beside the matrix, when it exists.
    lock: Path | None = None
    # None: start an embedded registry for the run.
    registry: str | None = None
    torch_cpu_index: str = ""
    ca_bundle: Path | None = None
    # What the compile may use: available memory (bytes) and cores where BuildKit runs.
    build_memory: int = 0
    build_cores: int = 1
    # How hard to try against the registry (defaults.yaml `registry:`, push limits from the environment).
    registry_limits: Limits = field(default_factory=default_limits)
    # Token services on other hosts that may receive the registry's credentials.
    token_realms: tuple[str, ...] = ()
    # Wait for another run holding the cache's run lock (False: --no-wait).
    wait: bool = True
    # BuildKit's cache across runners (sparkbuild/build/buildcache.py): auto, registry, inline or off.
    build_cache: BuildCacheSetting = "auto"
    # Who signs a published digest before its readable tags move (sparkbuild/publish/sign.py: SPARKBUILD_SIGN).
    signer: Signer = field(default_factory=_no_signer)
    # The other machines a check served across nodes runs on, reached with ssh (SPARKBUILD_NODES, verify
    # --node), the interface of the link they share with this one, and the ssh config that names them.
    nodes: tuple[str, ...] = ()
    node_interface: str = ""
    ssh_config: Path | None = None

    @classmethod
    def from_env(cls, **overrides: Any) -> Options:
        """Defaults, then SPARKBUILD_* variables, then ``overrides`` (the command line) where not None.

        Every value is checked here; a bad one is a ConfigError naming the variable or option.
        """
        d = defaults()["options"]
        env = os.environ
        ca = env.get("SPARKBUILD_CA_BUNDLE", d["ca_bundle"])
        memory, cores = host_resources()
        if env.get("SPARKBUILD_BUILD_MEMORY_GB"):
            memory = int(_positive_number("SPARKBUILD_BUILD_MEMORY_GB", env["SPARKBUILD_BUILD_MEMORY_GB"], "GB") * GIB)
        if env.get("SPARKBUILD_BUILD_CORES"):
            cores = _positive_int("SPARKBUILD_BUILD_CORES", env["SPARKBUILD_BUILD_CORES"])
        pushes = {"push_stall_s": env.get("SPARKBUILD_PUSH_STALL_S"), "push_deadline_s": env.get("SPARKBUILD_PUSH_DEADLINE_S")}
        limits = {key: _positive_number(f"SPARKBUILD_{key.upper()}", text, "seconds") for key, text in pushes.items() if text}
        values: dict[str, Any] = {
            # Like cibuildwheel's pyproject.toml: the project's own file, where the command runs.
            "matrix": _path("SPARKBUILD_MATRIX", env.get("SPARKBUILD_MATRIX"), Path.cwd() / "matrix.yaml"),
            "dockerfiles": _path("SPARKBUILD_DOCKERFILES", env.get("SPARKBUILD_DOCKERFILES"), None),
            "cache": _path("SPARKBUILD_CACHE", env.get("SPARKBUILD_CACHE"), default_cache()),
            "out": _path("SPARKBUILD_OUT", env.get("SPARKBUILD_OUT"), Path.cwd() / "sparkbuild-out"),
            "date": env.get("SPARKBUILD_DATE") or today(),
            "registry": env.get("SPARKBUILD_REGISTRY") or None,
            "lock": Path(env["SPARKBUILD_LOCK"]) if env.get("SPARKBUILD_LOCK") else None,
            "torch_cpu_index": env.get("SPARKBUILD_TORCH_CPU_INDEX", d["torch_cpu_index"]),
            "ca_bundle": Path(ca) if ca else None,
            "build_memory": memory,
            "build_cores": cores,
            "registry_limits": Limits.from_mapping(defaults()["registry"], **limits),
            "token_realms": _hosts("SPARKBUILD_TOKEN_REALMS", env.get("SPARKBUILD_TOKEN_REALMS", "")),
            "build_cache": _build_cache("SPARKBUILD_BUILD_CACHE", env.get("SPARKBUILD_BUILD_CACHE") or "auto"),
            "signer": Signer.from_env(env.get("SPARKBUILD_SIGN") or "auto", env),
            "nodes": _ssh_hosts("SPARKBUILD_NODES", env.get("SPARKBUILD_NODES", "")),
            "node_interface": env.get("SPARKBUILD_NODE_INTERFACE", "").strip(),
            "ssh_config": _path("SPARKBUILD_SSH_CONFIG", env.get("SPARKBUILD_SSH_CONFIG"), None),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        _check_nodes(values["nodes"], values["node_interface"])
        _check_date(values["date"])
        if values["registry"] is not None:
            values["registry"] = check_address(values["registry"])
        if not re.fullmatch(r"https?://[^\s\"'\\]+", values["torch_cpu_index"]):
            raise ConfigError(f"SPARKBUILD_TORCH_CPU_INDEX={values['torch_cpu_index']!r}: expected an http(s) URL without spaces")
        return cls(**values)


def _positive_number(name: str, text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={text!r}: expected a positive number of {unit}, like 8; or unset it")
    return value


def _positive_int(name: str, text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1 or int(text) > 4096:
        raise ConfigError(f"{name}={text!r}: expected a whole number from 1 to 4096; or unset it to use this machine's")
    return int(text)


def _path(name: str, text: str | None, default: Path | None) -> Path | None:
    if text is None:
        return default
    if not text.strip() or "\0" in text:
        raise ConfigError(
            f"{name}={text!r}: expected a path; or unset it for the default ({default or 'see docs/configuration.md'})"
        )
    return Path(text)


def _ssh_hosts(name: str, text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.replace(",", " ").split() if h.strip())
    for found in hosts:
        if not re.fullmatch(r"[\w.-]+@?[\w.-]*", found) or found.startswith("-"):
            raise ConfigError(f"{name}: '{found}' is not an ssh host (HOST, USER@HOST or a Host of the ssh config)")
    return hosts


def _check_nodes(nodes: tuple[str, ...], interface: str) -> None:
    """Other machines need the link they share with this one, named; an interface needs machines to share it with."""
    if nodes and not re.fullmatch(r"[\w.:-]{1,15}", interface):
        why = "unset" if not interface else f"{interface!r} is not an interface name"
        raise ConfigError(
            f"SPARKBUILD_NODES (--node) names {', '.join(nodes)} and SPARKBUILD_NODE_INTERFACE (--interface) is {why}: "
            "name the interface of the link between the nodes (on a Spark pair, the QSFP port's; `ip -4 addr` lists them)"
        )
    if interface and not nodes:
        raise ConfigError(
            f"SPARKBUILD_NODE_INTERFACE (--interface) is {interface!r} and no other machine is named: give them with "
            "SPARKBUILD_NODES (--node HOST), or unset it"
        )


def _hosts(name: str, text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    for host in hosts:
        if not re.fullmatch(r"[A-Za-z0-9.-]+(:\d{1,5})?", host):
            raise ConfigError(f"{name}: '{host}' is not a host name (HOST or HOST:PORT, separated by commas)")
    return hosts


def _check_date(date: str) -> None:
    """The date in readable tags: YYYYMMDD, a real day."""
    try:
        valid = bool(re.fullmatch(r"\d{8}", date)) and bool(dt.datetime.strptime(date, "%Y%m%d"))
    except ValueError:
        valid = False
    if not valid:
        raise ConfigError(f"date {date!r} (--date or SPARKBUILD_DATE): expected YYYYMMDD, like {today()}")


def _build_cache(name: str, text: str) -> BuildCacheSetting:
    """``SPARKBUILD_BUILD_CACHE``'s value, or a ConfigError naming it."""
    for setting in BUILD_CACHE_SETTINGS:
        if text.strip().lower() == setting:
            return setting
    raise ConfigError(f"{name}={text!r}: expected one of {', '.join(BUILD_CACHE_SETTINGS)}; or unset it (auto)")


def _flag(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ConfigError(f"{name}={text!r}: expected 1 or 0")
    return text == "1"
