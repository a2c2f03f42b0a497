"""Which checks an image can run on this host, decided before any server starts.

vLLM's CPU image (the local profile) serves what its CPU kernels cover, and those depend on the
host's CPU: without Intel AMX it refuses FP8-block and MXFP4 models at startup, with AMX it starts
them and (like a bfloat16 MoE) its worker dies on the first request; it has no NVFP4 kernel at all.
A check the host cannot run is SKIPPED with the reason from ``resources/cpu-serving.yaml``: never
served, never a pass, never a crash. Everything else is served, and its result says what happened.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from sparkbuild.errors import ConfigError
from sparkbuild.plan.matrix import Check
from sparkbuild.util import host, yamlsrc

DATA = "cpu-serving.yaml"
# The format of each model sparkbuild makes: "moe" is an unquantized MoE (its dtype decides the path).
RECIPE_FORMATS = {
    "alphabet": "dense",
    "alphabet-reversed": "dense",
    "moe-alphabet": "moe",
    "moe-nvfp4": "nvfp4",
    # W4A16: the same format to the CPU table (folder_format reads both as nvfp4).
    "moe-nvfp4a16": "nvfp4",
    "moe-fp8": "fp8-block",
    "gptoss-mxfp4": "mxfp4",
}
CPU_KINDS = ("amx", "no-amx", "any")
# The image labels verify reads (sparkbuild/plan/render.py writes them).
CUDA_LABEL = "io.sparkbuild.cuda"
VERSION_LABEL = "io.sparkbuild.vllm.version"


@dataclass(frozen=True, kw_only=True)
class Rule:
    format: str
    cpu: str
    reason: str

    def applies(self, fmt: str, cpu: host.Cpu) -> bool:
        return self.format == fmt and (self.cpu == "any" or (self.cpu == "amx") == cpu.amx)


@dataclass(frozen=True, kw_only=True)
class Range:
    vllm: SpecifierSet
    rules: tuple[Rule, ...]


@dataclass(frozen=True, kw_only=True)
class Serving:
    """Where a check would be served: on the CPU (a CPU image) or a GPU, which vLLM, which CPU."""

    cpu_image: bool
    vllm_version: str | None
    cpu: host.Cpu

    @classmethod
    def of(cls, labels: Mapping[str, str], cpu: host.Cpu) -> Serving:
        """From the image's labels: a sparkbuild CPU image says ``io.sparkbuild.cuda=none``."""
        return cls(cpu_image=labels.get(CUDA_LABEL) == "none", vllm_version=labels.get(VERSION_LABEL), cpu=cpu)


def skip_reason(check: Check, serving: Serving) -> str | None:
    """Why ``check`` cannot run where ``serving`` says (None: it can, as far as anyone knows)."""
    if not serving.cpu_image or serving.vllm_version is None:
        return None
    fmt = model_format(check)
    if fmt is None:
        return None
    version = _version(serving.vllm_version)
    for found in ranges():
        if version is not None and found.vllm.contains(version, prereleases=True):
            for rule in found.rules:
                if rule.applies(fmt, serving.cpu):
                    return f"{rule.reason} [{describe(serving.cpu)}]"
    return None


def cluster_reason(check: Check, *, gpus: bool, other_machines: int) -> str | None:
    """Why a check served across nodes cannot run here (None: it can). On a GPU every node is a machine
    of its own (a second Spark: one GPU cannot hold two nodes' ranks as two Sparks do), and fewer other
    machines were given than it needs; on the CPU (the rehearsal) every node can be a container here."""
    settings = check.kinds.multi_node
    if settings is None or not gpus or other_machines >= settings.nodes - 1:
        return None
    wanted = settings.nodes - 1
    return (
        f"served across {settings.nodes} nodes, each a Spark of its own, and {other_machines} other machine(s) given: "
        f"name {wanted} with --node HOST (SPARKBUILD_NODES) and the link they share with --interface "
        "(SPARKBUILD_NODE_INTERFACE); docs/multi-node.md"
    )


def describe(cpu: host.Cpu) -> str:
    amx = "with AMX" if cpu.amx else "without AMX"
    return f"{cpu.model or 'this CPU'}, {amx}"


def model_format(check: Check) -> str | None:
    """The format of the check's model, as the rules name it; None where it cannot be told before
    the model is there (a Hub model)."""
    if check.hub is not None:
        return None
    fmt = folder_format(check.path) if check.path is not None else RECIPE_FORMATS.get(check.model)
    if fmt == "moe":
        return f"moe-{served_dtype(check) or 'bfloat16'}"
    return fmt


def folder_format(folder: Path) -> str | None:
    """A model folder's format from its config.json: quantized (nvfp4, fp8-block, mxfp4), an
    unquantized MoE ("moe"), dense, or None where config.json cannot be read."""
    try:
        config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "mxfp4":
        return "mxfp4"
    if method == "fp8" and quant.get("weight_block_size"):
        return "fp8-block"
    text = json.dumps(quant).lower()
    if method == "compressed-tensors" and "nvfp4" in text:
        return "nvfp4"
    if method == "compressed-tensors" and '"block_structure"' in text and '"float"' in text:
        return "fp8-block"
    if method:
        return method
    experts = any(k in config for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    return "moe" if experts else "dense"


def served_dtype(check: Check) -> str | None:
    """The ``--dtype`` of the check's serve arguments (either spelling), else None (the model's own)."""
    args = list(check.serve_args)
    for i, arg in enumerate(args):
        if arg == "--dtype" and i + 1 < len(args):
            return _dtype(args[i + 1])
        if arg.startswith("--dtype="):
            return _dtype(arg.split("=", 1)[1])
    return None


def _dtype(value: str) -> str:
    return {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "half": "float16", "fp16": "float16"}.get(value, value)


def _version(text: str) -> Version | None:
    try:
        return Version(text.split("+")[0])
    except InvalidVersion:
        return None


@cache
def ranges() -> tuple[Range, ...]:
    raw = yamlsrc.load_shipped((resources.files("sparkbuild") / "resources" / DATA).read_text())
    found = []
    for i, entry in enumerate(raw["ranges"]):
        rules = []
        for j, rule in enumerate(entry["rules"]):
            if rule["cpu"] not in CPU_KINDS:
                raise ConfigError(
                    f"sparkbuild/resources/{DATA}: ranges[{i}].rules[{j}].cpu: '{rule['cpu']}' is none of {CPU_KINDS}"
                )
            rules.append(Rule(format=rule["format"], cpu=rule["cpu"], reason=" ".join(rule["reason"].split())))
        found.append(Range(vllm=SpecifierSet(entry["vllm"]), rules=tuple(rules)))
    return tuple(found)
