"""Base images: pinned by digest, or made here and cached by content.

- ``debootstrap``: a Debian root file system made with debootstrap, its tar added to ``FROM scratch`` by BuildKit.
- ``cuda_wheels``: a CUDA toolkit from NVIDIA's PyPI wheels (``cuda-toolkit[...]==X``, resolved
  by pip) laid out as ``/usr/local/cuda-X.Y`` (``bin``, ``include``, ``lib64``, ``nvvm``) on a
  debootstrap base: a devel or runtime base like NVIDIA's images, with no Docker Hub.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from sparkbuild.errors import BuildError, ToolMissingError
from sparkbuild.image import cuda_layout
from sparkbuild.oci.engine import Engine
from sparkbuild.plan.base_recipe import reference
from sparkbuild.plan.matrix import Base, CudaWheels
from sparkbuild.util import cmd, log

ARCH = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}
DEBIAN_ARCH = {"linux/amd64": "amd64", "linux/arm64": "arm64"}
# The newest glibc a made base may assume (Debian bookworm has 2.36, trixie 2.41; NVIDIA's
# images, Ubuntu 24.04, 2.39): wheels tagged for it or anything older are accepted.
GLIBC_MINOR = 28


def platform_tags(platform: str) -> list[str]:
    """Every manylinux tag a wheel for ``platform`` may carry, newest first. pip's ``--platform``
    matches exactly the tags it is given, so an installer that knows its glibc lists them all."""
    arch = ARCH[platform]
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(GLIBC_MINOR, 4, -1)]
    return [*tags, f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def ensure(engine: Engine, base: Base, platform: str, work: Path) -> str:
    """Make the base image unless the engine has it; returns its reference."""
    ref, _ = reference(base, platform)
    if base.image is not None or engine.image_exists(ref):
        log.info(f"base {ref}: present")
        return ref
    if base.cuda_wheels is not None:
        _make_cuda(engine, base.cuda_wheels, ref, platform, work)
    else:
        _debootstrap(engine, base, ref, platform, work)
    return ref


def _log_file(work: Path, ref: str) -> Path:
    """Where the build that makes base ``ref`` logs."""
    return work / "logs" / f"{ref.replace('/', '_').replace(':', '_')}.log"


def _debootstrap(engine: Engine, base: Base, ref: str, platform: str, work: Path) -> None:
    spec = base.debootstrap
    assert spec is not None
    if shutil.which("debootstrap") is None:
        raise ToolMissingError("making a base image needs debootstrap: apt-get install debootstrap")
    arch = DEBIAN_ARCH[platform]
    with log.step(f"Making base image {ref} with debootstrap ({spec.suite}, {arch})"):
        work.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work, prefix="rootfs-") as tmp:
            root = Path(tmp) / "root"
            args = ["debootstrap", f"--variant={spec.variant}", f"--arch={arch}"]
            if spec.include:
                args.append(f"--include={','.join(spec.include)}")
            result = cmd.run([*args, spec.suite, root, spec.mirror], check=False)
            if result.returncode != 0:
                raise BuildError(
                    f"debootstrap of {spec.suite} from {spec.mirror} failed (exit {result.returncode}); see its output above"
                )
            # Package caches and lists make the image bigger and its content vary from run to run.
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (root / junk).glob("*"):
                    if path.is_file():
                        path.unlink()
            engine.import_rootfs(root, ref, platform, _log_file(work, ref))


# --- a CUDA toolkit from PyPI wheels ------------------------------------------------------------


def requirement(cuda: CudaWheels) -> str:
    """The one pip requirement that pins the whole toolkit: ``cuda-toolkit[nvcc,...]==13.0.3.0``."""
    return f"cuda-toolkit[{','.join(sorted(cuda.components))}]=={cuda.toolkit}"


def _make_cuda(engine: Engine, cuda: CudaWheels, ref: str, platform: str, work: Path) -> None:
    on = ensure(engine, cuda.base, platform, work)
    with log.step(f"Making base image {ref}: CUDA {cuda.toolkit} ({cuda.flavor}) from PyPI wheels on {on}"):
        wheels = download_wheels(cuda, platform, work / "cuda-wheels" / f"{cuda.toolkit}-{ARCH[platform]}")
        with tempfile.TemporaryDirectory(dir=work, prefix="cuda-") as tmp:
            context = Path(tmp)
            # One tree copied to /: the symlink inside it is copied as a link, not followed.
            local = context / "root" / "usr" / "local"
            local.mkdir(parents=True)
            unpack_toolkit(wheels, local / f"cuda-{cuda.cuda}")
            _require_compiler(cuda, local / f"cuda-{cuda.cuda}")
            (local / "cuda").symlink_to(f"cuda-{cuda.cuda}")
            conf = context / "root" / "etc" / "ld.so.conf.d" / "000-sparkbuild-cuda.conf"
            conf.parent.mkdir(parents=True)
            conf.write_text("/usr/local/cuda/lib64\n", encoding="utf-8")
            (context / "Dockerfile").write_text(_cuda_dockerfile(on, cuda, wheels), encoding="utf-8")
            engine.build(
                context=context,
                tag=ref,
                platform=platform,
                labels={"io.sparkbuild.base": ref, "io.sparkbuild.cuda-wheels": requirement(cuda)},
                build_args={},
                secrets={},
                log_file=_log_file(work, ref),
            )


def _require_compiler(cuda: CudaWheels, toolkit: Path) -> None:
    """A devel base compiles: NVIDIA's PyPI wheels carry the nvcc driver from CUDA 13 on only."""
    if cuda.flavor == "devel" and not (toolkit / "bin" / "nvcc").is_file():
        found = sorted(p.name for p in (toolkit / "bin").iterdir()) if (toolkit / "bin").is_dir() else []
        raise BuildError(
            f"cuda-toolkit {cuda.toolkit} on PyPI has no nvcc (its bin/ holds {', '.join(found) or 'nothing'}): "
            "NVIDIA's wheels carry the compiler driver from CUDA 13.0 on. Make a devel base for CUDA >= 13.0 "
            "from wheels, or use NVIDIA's devel image for this CUDA version"
        )


def download_wheels(cuda: CudaWheels, platform: str, dest: Path) -> tuple[Path, ...]:
    """Every wheel of the toolkit for ``platform``, resolved and downloaded by pip (hashes checked by pip)."""
    dest.mkdir(parents=True, exist_ok=True)
    python = (cuda.base.python or "3").replace(".", "")
    args = [
        sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
        "--only-binary=:all:", *(f"--platform={tag}" for tag in platform_tags(platform)),
        "--python-version", python, "--implementation", "cp", "--dest", str(dest), requirement(cuda),
    ]  # fmt: skip
    result = cmd.run(args, check=False)
    if result.returncode != 0:
        raise BuildError(
            f"pip could not download {requirement(cuda)} for {platform} (exit {result.returncode}; see above): "
            "check the toolkit version against https://pypi.org/simple/cuda-toolkit/ and the components against its extras"
        )
    wanted = _wanted_names(dest, cuda)
    return tuple(sorted(p for p in dest.glob("*.whl") if p.name.split("-")[0].lower() in wanted))


def _wanted_names(dest: Path, cuda: CudaWheels) -> set[str]:
    """Distribution names (wheel-file form) the requirement pulls, read from the meta package's metadata.

    The download folder is shared by flavors; only this requirement's wheels are laid out.
    """
    meta = sorted(dest.glob(f"cuda_toolkit-{cuda.toolkit}-*.whl"))
    if not meta:
        raise BuildError(f"pip downloaded no cuda_toolkit-{cuda.toolkit} wheel into {dest}")
    with zipfile.ZipFile(meta[0]) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(name).decode().splitlines()
    names: set[str] = set()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line.removeprefix("Requires-Dist:").partition(";")
        if any(f"extra == '{c}'" in marker or f'extra == "{c}"' in marker for c in cuda.components):
            project = spec.strip().split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("~")[0].strip()
            names.add(project.replace("-", "_").lower())
    return names


def unpack_toolkit(wheels: tuple[Path, ...], toolkit: Path) -> None:
    """Extract the wheels as pip would install them, then lay them out as one toolkit tree (copies)."""
    with tempfile.TemporaryDirectory(dir=toolkit.parent.parent, prefix="site-") as site:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                members = [m for m in archive.infolist() if m.filename.startswith("nvidia/")]
                for member in members:
                    # zipfile drops absolute and '..' parts of member names: nothing lands outside site.
                    path = Path(archive.extract(member, site))
                    if not member.is_dir():
                        path.chmod(0o755 if (member.external_attr >> 16) & 0o111 else 0o644)
        try:
            cuda_layout.lay_out(Path(site) / "nvidia", toolkit, copy=True)
        except cuda_layout.LayoutError as exc:
            raise BuildError(f"the CUDA wheels do not merge into one toolkit: {exc}") from None


# NVIDIA's devel images link against lib64/stubs/libcuda.so where no driver is installed (CMake's
# CUDA::cuda_driver); the wheels carry no stub, so the devel flavor makes one like it from cuda.h:
# every driver entry point, returning CUDA_ERROR_STUB_LIBRARY (34). The only RUN of a made base.
DRIVER_STUB = (
    "RUN gcc -E -P /usr/local/cuda/include/cuda.h | grep -oE '\\bcu[A-Za-z0-9_]+ *\\(' | tr -d ' (' | sort -u \\\n"
    "    | sed 's/.*/int &(void) { return 34; }/' > /tmp/libcuda-stub.c \\\n"
    "    && mkdir -p /usr/local/cuda/lib64/stubs \\\n"
    "    && gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o /usr/local/cuda/lib64/stubs/libcuda.so /tmp/libcuda-stub.c \\\n"
    "    && rm /tmp/libcuda-stub.c\n"
)


def _cuda_dockerfile(on: str, cuda: CudaWheels, wheels: tuple[Path, ...]) -> str:
    path = "/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    listed = " ".join(w.name for w in wheels)
    return (
        f"# CUDA {cuda.toolkit} ({cuda.flavor}) from PyPI: {requirement(cuda)}\n"
        f"# wheels: {listed}\n"
        f"FROM {on}\n"
        "COPY root/ /\n"
        + (DRIVER_STUB if cuda.flavor == "devel" else "")
        + f"ENV CUDA_HOME=/usr/local/cuda CUDA_VERSION={cuda.toolkit} PATH={path} \\\n"
        "    LD_LIBRARY_PATH=/usr/local/cuda/lib64 \\\n"
        "    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility\n"
    )
