"""Which signer a run has, and the cosign command lines (the signing itself: tests/publish/test_sign.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkbuild.config.options import Signer
from sparkbuild.errors import ConfigError
from sparkbuild.publish import sign


def test_without_a_key_nothing_signs_and_it_says_how_to() -> None:
    signer = Signer.from_env("auto", {})
    assert signer.mode == "none" and signer.describe() == "unsigned"
    assert "SPARKBUILD_COSIGN_KEY" in signer.why and "SPARKBUILD_SIGN=off" in signer.why
    assert Signer.from_env("off", {"SPARKBUILD_COSIGN_KEY": "k"}).why == "not signed (SPARKBUILD_SIGN=off)"


def test_a_key_signs_and_keyless_needs_an_identity() -> None:
    assert Signer.from_env("auto", {"SPARKBUILD_COSIGN_KEY": "k"}) == Signer(mode="key", tlog=True)
    assert Signer.from_env("key", {"SPARKBUILD_COSIGN_KEY": "k", "SPARKBUILD_COSIGN_TLOG": "0"}).tlog is False
    with pytest.raises(ConfigError, match="SPARKBUILD_SIGN=key: set SPARKBUILD_COSIGN_KEY"):
        Signer.from_env("key", {})
    keyless = Signer.from_env("keyless", {"GITHUB_REPOSITORY": "team/images"})
    assert keyless.identity == "^https://github.com/team/images/"
    with pytest.raises(ConfigError, match="SPARKBUILD_SIGN_IDENTITY"):
        Signer.from_env("keyless", {})
    with pytest.raises(ConfigError, match="SPARKBUILD_SIGN='yes': expected one of auto, key, keyless, off"):
        Signer.from_env("yes", {})
    with pytest.raises(ConfigError, match="SPARKBUILD_COSIGN_TLOG='no': expected 1 or 0"):
        Signer.from_env("key", {"SPARKBUILD_COSIGN_KEY": "k", "SPARKBUILD_COSIGN_TLOG": "no"})


def test_command_lines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sign, "cosign", lambda: "cosign")
    key = Signer(mode="key", tlog=False)
    ref = "127.0.0.1:5000/team/vllm@sha256:" + "a" * 64
    assert sign.sign_args(key, ref, "127.0.0.1:5000") == [
        "cosign", "sign", "--yes", "--key", "env://SPARKBUILD_COSIGN_KEY", "--tlog-upload=false", "--allow-http-registry", ref,
    ]  # fmt: skip
    remote = "registry.example:443/team/vllm@sha256:" + "a" * 64
    assert sign.verify_args(key, remote, "registry.example:443", tmp_path / "k.pub") == [
        "cosign", "verify", "--key", str(tmp_path / "k.pub"), "--insecure-ignore-tlog=true", remote,
    ]  # fmt: skip
    keyless = Signer(mode="keyless", identity="^https://github.com/team/images/")
    assert sign.sign_args(keyless, remote, "registry.example:443") == ["cosign", "sign", "--yes", remote]
    assert sign.verify_args(keyless, remote, "registry.example:443", None)[2:6] == [
        "--certificate-identity-regexp", "^https://github.com/team/images/",
        "--certificate-oidc-issuer", "https://token.actions.githubusercontent.com",
    ]  # fmt: skip
