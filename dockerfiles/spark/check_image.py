"""Run inside the Spark image at build time: fail the build unless it holds what the plan asked for.

torch must be the CUDA build asked for (a CPU wheel swapped in by pip is the classic failure);
vLLM must report the version asked for and come from the pinned commit.
"""

import argparse
import importlib.metadata
import json
import pathlib
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--vllm-version", required=True)
parser.add_argument("--vllm-commit", required=True)
parser.add_argument("--torch", required=True)
parser.add_argument("--cuda", required=True)
args = parser.parse_args()

import torch  # noqa: E402

problems = []
if torch.__version__ != args.torch:
    problems.append(f"torch {torch.__version__} is installed, the plan asked for {args.torch}")
if torch.version.cuda is None:
    problems.append(f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)")
elif not torch.version.cuda.startswith(args.cuda):
    problems.append(f"torch is built for CUDA {torch.version.cuda}, the plan asked for {args.cuda}")
installed = importlib.metadata.version("vllm")
if installed.split("+")[0] != args.vllm_version:
    problems.append(f"vLLM {installed} is installed, the plan asked for {args.vllm_version}")
record = pathlib.Path("/opt/sparkbuild/sources.txt")
sources = record.read_text().split() if record.is_file() else []
if not sources:
    problems.append(f"{record} is missing: the source stage did not record the commits it fetched")
elif args.vllm_commit not in sources:
    problems.append(f"vLLM was not built from commit {args.vllm_commit}; sources: {' '.join(sources)}")
if problems:
    sys.exit("image check failed:\n  " + "\n  ".join(problems))
import vllm  # noqa: E402

found = {
    "vllm_path": str(pathlib.Path(vllm.__file__).parent),
    "vllm": installed,
    "vllm_commit": args.vllm_commit,
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
}
pathlib.Path("/opt/sparkbuild/installed.json").write_text(json.dumps(found, indent=2) + "\n")
print(json.dumps(found))
