"""`python -m bpt.bench.gpu_wheels [--dest .whl] [--unsloth]`: the wheels a bare GPU machine lacks for the GPU check.

The lent GPU machines (Python 3.12, torch 2.11 + CUDA 13, transformers 5.17, accelerate, peft, Triton; no network)
have no bitsandbytes (the 4-bit row, the CUDA tier's QLoRA run), no Liger-Kernel (the peer's speed rows) and no
datasets (train.qlora). This downloads them for that machine (pip download, no dependencies: the rest is there),
into a folder kept out of git (.gitignore has .whl/), and prints their size beside the working tree's:
what travels to the machine must stay under 64 MiB. `--unsloth` adds Unsloth for the check's Unsloth row: unsloth,
unsloth_zoo and the trl it imports (<= 1.15), unsloth's wheel repacked without its web UI (studio/, 26 of its 27
MiB, which the unsloth package never imports). On the machine, before the check:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# name -> version: what the check was prepared with (datasets 5.2 wants huggingface-hub >= 1.31: the image has 1.33)
WHEELS = {"bitsandbytes": "0.50.2", "liger-kernel": "0.8.5", "datasets": "5.2.0", "dill": "0.4.1",
          "multiprocess": "0.70.19"}
UNSLOTH_WHEELS = {"unsloth": "2026.10.9", "unsloth_zoo": "2026.10.9", "trl": "1.15.0"}
UNSLOTH_UI = "studio/"  # the web UI in unsloth's wheel: the unsloth package never imports it (its CLI does)
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
LIMIT = 64 << 20  # what one call may carry: the working tree and the wheels together
MIB = 1 << 20


def download(dest: Path, wheels: dict) -> list[Path]:
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               PYTHON, "--implementation", "cp", *platforms, "-d", str(dest),
               *(f"{name}=={version}" for name, version in wheels.items())]
    subprocess.run(command, check=True)
    return sorted(dest.glob("*.whl"))


def without_folder(wheel: Path, folder: str) -> None:
    """The wheel rewritten in place without the files under `folder` (a top-level folder, with its slash) and
    their lines in the wheel's RECORD, which pip checks against the files it installs."""
    import zipfile

    kept = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as old, zipfile.ZipFile(kept, "w", zipfile.ZIP_DEFLATED) as new:
        for item in old.infolist():
            if item.filename.startswith(folder):
                continue
            data = old.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(folder)).encode()
            new.writestr(item, data)
    kept.replace(wheel)


def tree_bytes(root: Path) -> int:
    """Bytes of what travels besides the wheels: tracked and untracked files that git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sum((root / name).stat().st_size for name in out.decode().split("\0")
               if name and (root / name).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bpt.bench.gpu_wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"), help="folder for the wheels (keep it ignored)")
    parser.add_argument("--unsloth", action="store_true",
                        help="also Unsloth (unsloth, unsloth_zoo, trl 1.15) for the check's Unsloth row")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    wheels = download(args.dest, {**WHEELS, **(UNSLOTH_WHEELS if args.unsloth else {})})
    for wheel in args.dest.glob(f"unsloth-{UNSLOTH_WHEELS['unsloth']}-*.whl"):
        without_folder(wheel, UNSLOTH_UI)
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    root = Path(__file__).resolve().parents[2]
    tree = tree_bytes(root)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / MIB:8.1f} MiB  {wheel.name}")
    total = wheel_bytes + tree
    print(f"wheels {wheel_bytes / MIB:.1f} MiB + working tree {tree / MIB:.1f} MiB = {total / MIB:.1f} MiB "
          f"({'under' if total < LIMIT else 'OVER'} the {LIMIT / MIB:.0f} MiB a call carries)")
    return 0 if total < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
