"""Signing a published digest with cosign, and checking the signature, before readable tags move.

Which signer (``SPARKBUILD_SIGN``):

- ``key``: a cosign key pair from the repository's secrets, for a registry that stays internal:
  ``SPARKBUILD_COSIGN_KEY`` (the encrypted private key, PEM; its password in ``COSIGN_PASSWORD``,
  which cosign reads itself) and, to check with, ``SPARKBUILD_COSIGN_PUB`` (the public key; default:
  derived from the private one). ``SPARKBUILD_COSIGN_TLOG=0`` keeps the signature out of Sigstore's
  transparency log, for a network that cannot reach it.
- ``keyless``: the runner's GitHub OIDC token and Sigstore's public Fulcio and Rekor; checked against
  this repository's workflows (``SPARKBUILD_SIGN_IDENTITY``, a regular expression, to change it).
- ``off``: no signature.
- ``auto`` (the default): ``key`` where ``SPARKBUILD_COSIGN_KEY`` is set, else none.

No signer is never silent: publish says, for each image, that it is not signed and how to sign it,
and the summary row says ``unsigned``. A signature that cannot be made or checked fails the publish
before any readable tag moves.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from sparkbuild.config import options
from sparkbuild.config.options import COSIGN_KEY, Signer
from sparkbuild.errors import PublishError, ToolMissingError
from sparkbuild.util import cmd, log
from sparkbuild.util.net import is_loopback

GITHUB_ISSUER = "https://token.actions.githubusercontent.com"


def cosign() -> str:
    found = shutil.which("cosign")
    if found is None:
        raise ToolMissingError(
            "signing needs cosign on PATH: in a workflow, sigstore/cosign-installer; on Debian trixie, apt-get install cosign"
        )
    return found


def sign_args(signer: Signer, reference: str, host: str) -> list[str]:
    """``cosign sign`` of ``reference`` (``host/repo@sha256:...``), as an argument list."""
    args = [cosign(), "sign", "--yes"]
    if signer.mode == "key":
        args += ["--key", f"env://{COSIGN_KEY}"]
        if not signer.tlog:
            args.append("--tlog-upload=false")
    return [*args, *_http(host), reference]


def verify_args(signer: Signer, reference: str, host: str, public_key: Path | None) -> list[str]:
    args = [cosign(), "verify"]
    if signer.mode == "key":
        assert public_key is not None
        args += ["--key", str(public_key)]
        if not signer.tlog:
            args.append("--insecure-ignore-tlog=true")
    else:
        args += ["--certificate-identity-regexp", signer.identity, "--certificate-oidc-issuer", GITHUB_ISSUER]
    return [*args, *_http(host), reference]


def _http(host: str) -> list[str]:
    """Plain HTTP only to a registry on loopback, as sparkbuild's own client."""
    return ["--allow-http-registry"] if is_loopback(host) else []


def ensure_signed(signer: Signer, reference: str, host: str) -> str:
    """Sign ``reference`` unless a signature the signer's check accepts is there already (a rerun
    that finishes an interrupted publish signs once), then check it; return what was done. Raises
    PublishError, before any readable tag moves, when the signature cannot be made or checked."""
    if signer.mode == "none":
        log.warning(f"{reference}: {signer.why}")
        return signer.describe()
    with tempfile.TemporaryDirectory(prefix="sparkbuild-cosign-") as work:
        public = _public_key(Path(work)) if signer.mode == "key" else None
        check = verify_args(signer, reference, host, public)
        if cmd.run(check, check=False, capture=True).returncode == 0:
            log.info(f"{reference}: already signed ({signer.describe()})")
            return signer.describe()
        _cosign(sign_args(signer, reference, host), reference, "signing")
        _cosign(check, reference, "checking the signature of")
    log.info(f"{reference}: signed and checked ({signer.describe()})")
    return signer.describe()


def _public_key(work: Path) -> Path:
    """``SPARKBUILD_COSIGN_PUB``, or the public half of the private key."""
    path = work / "cosign.pub"
    public = options.env("SPARKBUILD_COSIGN_PUB")
    if public:
        path.write_text(public)
        return path
    derived = _cosign([cosign(), "public-key", "--key", f"env://{COSIGN_KEY}"], "the key", "reading the public key of")
    path.write_text(derived)
    return path


def _cosign(args: list[str], reference: str, doing: str) -> str:
    result = cmd.run(args, check=False, capture=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "").strip()[-800:]
        raise PublishError(f"{doing} {reference} failed (cosign exit {result.returncode}); readable tags were not moved:\n{tail}")
    return result.stdout
