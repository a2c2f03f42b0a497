"""Real git repositories for the tests: ``git`` with a fixed identity, and the package's own daemon."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sparkbuild.upstream import gitrepo

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Upstream Dev",
    "GIT_AUTHOR_EMAIL": "dev@example.invalid",
    "GIT_COMMITTER_NAME": "Upstream Dev",
    "GIT_COMMITTER_EMAIL": "dev@example.invalid",
    "PATH": "/usr/bin:/bin",
}


def git(*args: str | Path, cwd: Path) -> str:
    result = subprocess.run(["git", *map(str, args)], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True)
    return result.stdout.strip()


# One daemon for the tests and `sparkbuild rehearse --offline`: the package's own.
git_daemon = gitrepo.daemon
