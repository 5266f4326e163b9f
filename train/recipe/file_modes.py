"""Files a run writes get the permissions the user's umask gives any new file (-rw-r--r-- under umask 022).

Atomic writes go through temporary files, which tempfile and safetensors create -rw------- (their own mode, whatever
the umask); renamed into place they would stay unreadable to a teammate on a shared machine. `as_umask_allows` sets a
file's (or a directory tree's) mode to what a plain open() or mkdir would have given it.
"""
from __future__ import annotations

import os


def current_umask() -> int:
    """This process's umask (Linux: read from /proc, so no other thread sees it changed; elsewhere set and put back)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask_allows(path: str) -> None:
    """Files 0o666 and directories 0o777, less the umask: `path` itself and, for a directory, all it holds."""
    mask = current_umask()
    if not os.path.isdir(path):
        os.chmod(path, 0o666 & ~mask)
        return
    for root, directories, files in os.walk(path):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)
