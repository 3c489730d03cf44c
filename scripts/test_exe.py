#!/usr/bin/env python3
"""Prints the path of a test binary from `cargo test --no-run --message-format=json` on stdin.

    cargo test --no-run --message-format=json ARGS | python3 scripts/test_exe.py TARGET [PACKAGE]

TARGET is the test target's name (e.g. cuda_tests); PACKAGE, when given, the package that owns
it (a workspace build has a `cuda_tests` in two packages). Prints the last match, or nothing.
Used by .ci/run and scripts/build-gpu-bins.sh.
"""
import json
import sys


def package_name(package_id):
    """The name in a cargo package id: `path+file:///dir#name@1.0`, `path+file:///dir/name#1.0`
    (the name is the folder's) or the older `name 1.0 (source)`."""
    if "#" not in package_id:
        return package_id.split()[0]
    url, fragment = package_id.rsplit("#", 1)
    return fragment.split("@")[0] if "@" in fragment else url.rstrip("/").rsplit("/", 1)[-1]


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    target, package = sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None
    found = None
    for line in sys.stdin:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if (m.get("reason") == "compiler-artifact" and m.get("executable")
                and m["target"]["name"] == target
                and (package is None or package_name(m["package_id"]) == package)):
            found = m["executable"]
    if found:
        print(found)


if __name__ == "__main__":
    main()
