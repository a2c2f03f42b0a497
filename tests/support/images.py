"""Images a test derives from another: one layer away, built for real (an input broken on purpose)."""

from __future__ import annotations

from pathlib import Path

from sparkbuild.oci.engine import Engine
from tests.support.matrix import LOCAL_PLATFORM


def derived_image(engine: Engine, image: str, tag: str, steps: str, folder: Path, files: dict[str, str] | None = None) -> str:
    """An image one layer away from ``image`` (``steps``: Dockerfile lines after its FROM; ``files``:
    written into the build context), built for real: an input broken on purpose in one known way."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    (folder / "Dockerfile").write_text(f"FROM {image}\n{steps}\n")
    engine.build(
        context=folder,
        tag=tag,
        platform=LOCAL_PLATFORM,
        labels={},
        build_args={},
        secrets={},
        log_file=folder / "build.log",
    )
    return tag
