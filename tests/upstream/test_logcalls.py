"""Reading log statements from Python source without running it (sparkbuild/upstream/logcalls.py): the message
forms vLLM's kernel choices use, each written here as vLLM writes it (the forms, in small modules;
the real files of every release are read in tests/upstream/test_kernel_logs.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from sparkbuild.upstream import logcalls

SOURCE = """
import logging
logger = init_logger(__name__)
_logger = logging.getLogger(__name__)


class Backend(Enum):
    CUTLASS = "vLLM CUTLASS"


def select(selected_backend, backend, experts_cls, name):
    logger.info("Using %s attention backend out of potential backends: %s.", selected_backend.name, [1])
    logger.info_once(f"Using {backend.value!r} NvFp4 MoE backend")
    logger.info_once("Using %s MoE backend", experts_cls.__name__)
    _logger.warning_once("Falling back to Marlin FP4 MoE kernel.")
    logger.info("100%% of %s" % name)
    logger.info("literal %s without arguments")
    logger.debug("Using " + ("FlashInfer" if name else "Triton") + " kernels")

    def _make_log_backend(backend_name: str):
        return f"Using {backend_name} backend for FP8 MoE"

    logger.info_once(_make_log_backend("DeepGEMM"), scope="local")
    logger.info_once(_make_log_backend(backend.value))
    message = f"Using {name}"
    logger.info(message)  # a message in a variable: not read
    print("Using this is not a log")
"""


def read(tmp_path: Path) -> list[logcalls.Statement]:
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "oracle.py").write_text(textwrap.dedent(SOURCE))
    return logcalls.tree_statements(root, [root / "vllm" / "oracle.py"])


def test_each_message_form_vllm_logs_a_choice_in_is_read_with_its_holes(tmp_path: Path) -> None:
    found = read(tmp_path)
    assert [s.text(default="{}") for s in found] == [
        "Using {} attention backend out of potential backends: {}.",
        "Using '{}' NvFp4 MoE backend",
        "Using {} MoE backend",
        "Falling back to Marlin FP4 MoE kernel.",
        "100% of {}",
        "literal %s without arguments",
        "Using FlashInfer kernels",
        "Using Triton kernels",
        "Using DeepGEMM backend for FP8 MoE",
        "Using {} backend for FP8 MoE",
    ]
    assert {s.file for s in found} == {"vllm/oracle.py"}
    attention, _, experts = found[:3]
    assert (attention.level, attention.line) == ("info", 12)
    assert [h.expression for h in attention.holes] == ["selected_backend.name", "[1]"]
    assert experts.holes == (logcalls.Hole("experts_cls.__name__"),)
    assert found[3].level == "warning_once"


def test_a_message_is_filled_as_the_log_shows_it(tmp_path: Path) -> None:
    attention, nvfp4 = read(tmp_path)[:2]
    filled = attention.text("FLASHINFER", "['FLASHINFER']")
    assert filled == "Using FLASHINFER attention backend out of potential backends: ['FLASHINFER']."
    # !r (and %r) show a string's repr: quoted, as vLLM's log has it.
    assert nvfp4.text("MARLIN") == "Using 'MARLIN' NvFp4 MoE backend"
    assert nvfp4.text() == f"Using '{logcalls.SENTINEL}' NvFp4 MoE backend"
    assert str(nvfp4) == "vllm/oracle.py:13 info_once: \"Using '{}' NvFp4 MoE backend\""
