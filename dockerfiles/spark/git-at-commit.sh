#!/bin/sh
# git-at-commit REPO COMMIT DEST [--submodules]: fetch exactly one commit and prove it is that one.
# A commit id is a hash over the whole tree, so checking it is the checksum of what was fetched.
set -eu
repo=$1 commit=$2 dest=$3
# Where the commits are fetched from may differ from the name the plan hashes (a local mirror, the
# offline rehearsal's git daemon): SPARKBUILD_GIT_INSTEADOF="NEW=OLD" rewrites URLs git's own way.
if [ -n "${SPARKBUILD_GIT_INSTEADOF:-}" ]; then
    git config --global url."${SPARKBUILD_GIT_INSTEADOF%%=*}".insteadOf "${SPARKBUILD_GIT_INSTEADOF#*=}"
fi
git init --quiet "$dest"
git -C "$dest" fetch --quiet --depth 1 "$repo" "$commit"
git -C "$dest" -c advice.detachedHead=false checkout --quiet FETCH_HEAD
got=$(git -C "$dest" rev-parse HEAD)
if [ "$got" != "$commit" ]; then
    echo "git-at-commit: $repo gave $got, the plan pinned $commit" >&2
    exit 1
fi
if [ "${4:-}" = "--submodules" ]; then
    git -C "$dest" submodule update --quiet --init --recursive --depth 1
fi
echo "$repo $commit" >> /src/sources.txt
