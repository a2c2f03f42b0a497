"""The check models' making and proof on aarch64, under emulation on an x86_64 host (issue 42; docs/check-models.md).

Reproduce with:  .venv/bin/python bench/check_models_arm64.py [--steps 2] [--out bench/results/check-models-arm64.json]

Needs an aarch64 binfmt_misc handler with the F flag (QEMU 8 or newer: bookworm's 7.2 segfaults in torch 2.13's
aarch64 kernels) and the engine of ``scripts/setup``. It makes a Debian bookworm arm64 base with sparkbuild's own
debootstrap base (its Python 3.11), installs the model tools at this venv's versions for aarch64 with the host's
pip (``--platform``: nothing runs emulated to install them), and then, emulated, in a container started with
``--init`` (a crashed emulated PID 1 never exits):

1. the making cut to ``--steps`` steps under each emulated CPU given (QEMU's Neoverse-N1 and -N2: no SVE and
   SVE2), with the making's aarch64 pins (tests/data/short_making.py): that the aarch64 making runs at all, its
   digests, and the seconds a step takes (a whole making is 1000 to 2000 steps);
2. the proof of this machine's cached ``gptoss-mxfp4`` (the pinned x86_64 bytes) run again with aarch64's
   arithmetic (``mxfp4.prove``): whether every fault still flips an answer there, and the tolerance it derives.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkbuild.build import base_image  # noqa: E402
from sparkbuild.config import options  # noqa: E402
from sparkbuild.models import arithmetic, model  # noqa: E402
from sparkbuild.oci.engine import Engine  # noqa: E402
from sparkbuild.plan import matrix  # noqa: E402
from sparkbuild.util import host  # noqa: E402

PLATFORM = "linux/arm64"
TOOLS = ("torch", "transformers", "tokenizers", "safetensors", "compressed-tensors", "llmcompressor", "accelerate")
PROVE = """
import json, sys
from pathlib import Path
from sparkbuild.models import making
from sparkbuild.models.moe import mxfp4, recipe
making.pin_torch()
proof = mxfp4.prove(recipe.RECIPES["gptoss-mxfp4"], Path("/model"))
print(json.dumps({
    "faults": {k: [v["flipped_tokens"], round(v["min_margin"], 3)] for k, v in proof["faults"].items()},
    "tolerance": {k: proof["tolerance"][k] for k in ("logprob_abs", "margin_fraction", "variants")},
}))
"""


def base(engine: Engine, cache: Path) -> str:
    loaded = matrix.load(ROOT / "matrix.yaml")
    return base_image.ensure(engine, loaded.bases["debian-bookworm"], PLATFORM, cache / "rootfs")


def site(cache: Path) -> Path:
    """The model tools at this venv's versions, installed for aarch64 and Python 3.11 by the host's pip."""
    pins = [f"{t}=={importlib.metadata.version(t).split('+')[0]}" for t in TOOLS]
    folder = cache / "arm64-model-tools" / "-".join(p.replace("==", "") for p in pins[:2])
    if not (folder / "torch").is_dir():
        tags = [f"--platform={t}" for t in base_image.platform_tags(PLATFORM)]
        args = [sys.executable, "-m", "pip", "install", "--quiet", "--only-binary=:all:", *tags, "--python-version", "3.11"]
        subprocess.run([*args, "--implementation", "cp", "--target", str(folder), *pins], check=True)
    return folder


def emulated(image: str, tools: Path, env: dict[str, str], command: list[str], mounts: dict[Path, str]) -> tuple[str, float]:
    args = ["/usr/bin/docker", "run", "--rm", "--init", "--ulimit", "core=0", "--network", "none", "--pull=never"]
    for folder, inside in {tools: "/site", ROOT: "/src", **mounts}.items():
        args += ["-v", f"{folder}:{inside}:ro"]
    for key, value in {"PYTHONPATH": "/site:/src", **env}.items():
        args += ["-e", f"{key}={value}"]
    start = time.monotonic()
    print("+", " ".join([*args, image, *command]), file=sys.stderr, flush=True)
    done = subprocess.run([*args, image, *command], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"emulated run failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1], time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpu", action="append", default=None, help="QEMU_CPU models (default: neoverse-n1, neoverse-n2)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "check-models-arm64.json")
    args = parser.parse_args()
    ok, why = host.can_run(PLATFORM)
    if not ok:
        raise SystemExit(why)
    engine, cache = Engine(), options.default_cache()
    image, tools = base(engine, cache), site(cache)
    pins = dict(arithmetic.PINS["aarch64"])
    results: dict[str, Any] = {"host": host.read_cpu().model, "qemu": _qemu(), "steps": args.steps, "making": {}}
    for cpu in args.cpu or ["neoverse-n1", "neoverse-n2"]:
        line, seconds = emulated(
            image, tools, {**pins, "QEMU_CPU": cpu}, ["python3", "/src/tests/data/short_making.py", str(args.steps), "pinned"], {}
        )
        results["making"][cpu] = {"digests": json.loads(line), "seconds": round(seconds, 1)}
    folder = model.ensure(cache, "gptoss-mxfp4")  # this machine's pinned bytes
    line, seconds = emulated(image, tools, {**pins, "QEMU_CPU": "neoverse-n1"}, ["python3", "-c", PROVE], {folder: "/model"})
    here = json.loads((folder / "sparkbuild-model.json").read_text())
    results["proof_on_aarch64"] = {
        "model": folder.name,
        "aarch64": json.loads(line),
        "x86_64": {k: [v["flipped_tokens"], v["min_margin"]] for k, v in here["faults"].items()},
        "seconds": round(seconds, 1),
    }
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def _qemu() -> str:
    done = subprocess.run(["qemu-aarch64-static", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else "unknown"


if __name__ == "__main__":
    main()
