#!/bin/sh
# git-at-commit REPO COMMIT DEST [--submodules [--no-recursive] [PATH...]]: fetch exactly one commit
# and prove it is that one. A commit id is a hash over the whole tree, so checking it is the checksum
# of what was fetched; a submodule is pinned by the commit its superproject records.
# --submodules initializes the submodules CMake would (ExternalProject's GIT_SUBMODULES): the PATHs
# given, or every one when none is given; recursively unless --no-recursive (GIT_SUBMODULES_RECURSE).
set -eu
repo=$1 commit=$2 dest=$3
# Where the commits are fetched from may differ from the name the plan hashes (the offline
# rehearsal's git daemon, on a port of its own each run): "NEW=OLD" in the BuildKit secret
# git-insteadof rewrites URLs git's own way. A secret, not a build argument: BuildKit keys no step by
# a secret, so a fetch of the same commit from another port is the same step (the commit id checks it).
# Set for this script's git commands alone (git's GIT_CONFIG_* variables): a --global setting would
# stay in the layer, and a later fetch, reusing it, would add a second rewrite beside it.
insteadof=/run/secrets/git-insteadof
if [ -s "$insteadof" ]; then
    rewrite=$(cat "$insteadof")
    export GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0="url.${rewrite%%=*}.insteadOf" GIT_CONFIG_VALUE_0="${rewrite#*=}"
fi
git init --quiet "$dest"
git -C "$dest" fetch --quiet --depth 1 "$repo" "$commit"
git -C "$dest" -c advice.detachedHead=false checkout --quiet FETCH_HEAD
got=$(git -C "$dest" rev-parse HEAD)
if [ "$got" != "$commit" ]; then
    echo "git-at-commit: $repo gave $got, the plan pinned $commit" >&2
    exit 1
fi
# The record of what was fetched (the source stage: /src/sources.txt).
record=${SPARKBUILD_SOURCES_RECORD:-/src/sources.txt}
echo "$repo $commit" >> "$record"
if [ "${4:-}" = "--submodules" ]; then
    shift 4
    recursive=--recursive
    if [ "${1:-}" = "--no-recursive" ]; then
        recursive=
        shift
    fi
    git -C "$dest" submodule update --quiet --init $recursive --depth 1 -- "$@"
    # Each submodule with the commit it was checked out at, below its superproject's line.
    git -C "$dest" submodule --quiet foreach $recursive 'echo "  $displaypath $sha1"' >> "$record"
fi
