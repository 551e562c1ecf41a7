"""Builds the FlashInfer bundle that scripts/device_check.sh carries to the GPU machine.

The GPU machine reaches no package registry and takes at most 64 MiB of carried files per
run. flashinfer-python 0.7.4 is a 101 MB wheel (715 MB unpacked: 126 MB of Python for every
kernel family, 389 MB of kernel sources in data/csrc, vendored CUTLASS and CCCL), and its
required packages add ~150 MB (nvidia-cutlass-dsl-libs-cu13 alone is 92 MB). What the
benchmarks call (sampling_from_probs, top_k_top_p_sampling_from_logits,
chain_speculative_sampling) needs far less, and this script keeps only that, changing no
FlashInfer file:

* every Python file of the package (``flashinfer/__init__`` imports nearly all of them) and
  its small data files (json, jinja, ...);
* the headers its JIT build puts on the include path: data/include, data/cccl (the vendored
  CCCL, put ahead of the toolkit's), data/spdlog;
* of data/csrc and data/cutlass, only the JIT "sampling" module's sources (sampling.cu,
  renorm.cu, flashinfer_sampling_binding.cu) and the files they include, transitively;
* of the required packages, only apache-tvm-ffi: importing ``flashinfer.sampling`` and
  building the sampling module need it, and the machine lacks it. The rest is on the machine
  (torch, numpy, ninja, requests, ...) or is not imported on this path (cuda-tile, nccl4py,
  nccl-extensions, nvidia-cudnn-frontend, nvidia-cutlass-dsl: checked by importing
  ``flashinfer.sampling`` with each of them blocked).

Run it here, where pip reaches PyPI; it writes ``.whl/flashinfer-<version>-sampling.tar.xz``
and the apache-tvm-ffi wheel (CPython 3.12, manylinux x86_64, as the GPU image's python3) and
prints the sizes. ``--check`` then unpacks the bundle into a temporary folder and imports
``flashinfer.sampling`` with this machine's python (with a tvm-ffi wheel for it, and
PYTHONPATH for what the GPU image has and this python may lack: requests, tqdm, ...): that shows
the trimming kept every module the import needs; compiling the kernels needs nvcc, which only
the GPU machine has (device_check.sh's flashinfer-jit step times it).

    python scripts/flashinfer_carry.py [--version 0.7.4] [--check]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20  # the device tool's limit on the working tree plus carried paths
# The GPU image: CPython 3.12 on x86-64 (see the device README's notes on carrying wheels).
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
SAMPLING_SOURCES = ["sampling.cu", "renorm.cu", "flashinfer_sampling_binding.cu"]
KERNEL_SOURCE = {".cu", ".cuh", ".h", ".hpp", ".inl", ".inc", ".cpp", ".cc", ".c", ".ptx"}
WHOLE_DIRS = ("flashinfer/data/include/", "flashinfer/data/cccl/", "flashinfer/data/spdlog/")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def download(spec: str, folder: Path, python: str | None) -> Path:
    """One wheel, no dependencies; for CPython ``python`` (e.g. "3.12") on manylinux x86_64,
    or for this interpreter when ``python`` is None."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--disable-pip-version-check", "-d", str(folder)]
    if python:
        command += ["--python-version", python, "--implementation", "cp"]
        command += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    before = set(folder.glob("*.whl"))
    subprocess.run([*command, spec], check=True)
    name = re.split(r"[<>=!~ ;]", spec)[0].replace("-", "_").lower()
    found = [w for w in folder.glob("*.whl") if w.name.lower().startswith(name + "-")]
    new = [w for w in found if w not in before] or found
    return max(new, key=lambda w: w.stat().st_mtime)


def requirement(wheel: zipfile.ZipFile, name: str) -> str:
    """The Requires-Dist line of ``name`` in the wheel's METADATA, as a pip spec."""
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            spec = line.split(":", 1)[1].strip()
            if re.split(r"[<>=!~ ;(]", spec)[0].lower() == name:
                return spec.replace(" ", "")
    raise SystemExit(f"{name} is not a requirement of this flashinfer wheel")


def sampling_sources(names: set[str], read) -> set[str]:
    """data/csrc and data/cutlass files the sampling module's sources include, transitively.
    Every ``#include`` is followed whatever the preprocessor conditions: keeping a header too
    many is harmless, one too few breaks the build on the GPU machine."""
    data = "flashinfer/data/"
    roots = [data + "include/", data + "csrc/", data + "cutlass/include/",
             data + "cutlass/tools/util/include/", data + "spdlog/include/"]
    todo = [data + "csrc/" + source for source in SAMPLING_SOURCES]
    kept: set[str] = set()
    while todo:
        path = todo.pop()
        if path in kept:
            continue
        kept.add(path)
        here = path.rsplit("/", 1)[0] + "/"
        for target in INCLUDE.findall(read(path).decode(errors="replace")):
            for base in (here, *roots):
                candidate = _normalize(base + target)
                if candidate in names:
                    todo.append(candidate)
                    break
    return {p for p in kept if p.startswith((data + "csrc/", data + "cutlass/"))}


def _normalize(path: str) -> str:
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)


def keep(name: str, closure: set[str]) -> bool:
    if name.endswith("/"):
        return False
    if ".dist-info/" in name:
        return not name.endswith("/RECORD")  # RECORD would list the files left out
    if name.startswith(WHOLE_DIRS) or name in closure:
        return True
    if name.startswith(("flashinfer/data/csrc/", "flashinfer/data/cutlass/")):
        return False
    return Path(name).suffix not in KERNEL_SOURCE  # other kernel families' sources


def bundle(wheel_path: Path, target: Path) -> tuple[int, int]:
    """Writes the trimmed package as a tar.xz; returns (files kept, bytes unpacked)."""
    with zipfile.ZipFile(wheel_path) as wheel:
        names = set(wheel.namelist())
        closure = sampling_sources(names, wheel.read)
        members = sorted(n for n in names if keep(n, closure))
        unpacked = 0
        with tarfile.open(target, "w:xz") as tar:
            for name in members:
                info = wheel.getinfo(name)
                entry = tarfile.TarInfo(name)
                entry.size, entry.mode, entry.mtime = info.file_size, 0o644, 0
                with wheel.open(name) as handle:
                    tar.addfile(entry, handle)
                unpacked += info.file_size
    return len(members), unpacked


def working_tree_bytes() -> int:
    """What else travels with every device call: the tracked and untracked-unignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")
    paths = [ROOT / name.decode() for name in listed if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def check(bundle_path: Path, tvm_spec: str) -> None:
    """Unpacks the bundle with a tvm-ffi wheel for this interpreter and imports
    ``flashinfer.sampling`` in a fresh python; raises if it fails."""
    with tempfile.TemporaryDirectory() as folder:
        site = Path(folder) / "site"
        wheel = download(tvm_spec, Path(folder), None)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                        "--no-deps", "--disable-pip-version-check", "--target", str(site),
                        str(wheel)], check=True)
        with tarfile.open(bundle_path) as tar:
            tar.extractall(site, filter="data")
        code = ("import flashinfer.sampling as s; print('imported', *(f.__name__ for f in ("
                "s.sampling_from_probs, s.top_k_top_p_sampling_from_logits, "
                "s.chain_speculative_sampling)))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={"PYTHONPATH": os.pathsep.join(filter(None, (
                                  str(site), os.environ.get("PYTHONPATH")))),
                                   "PATH": "/usr/bin:/bin", "HOME": folder})
        print(done.stdout.strip() or done.stderr[-3000:])
        if done.returncode:
            raise SystemExit("the trimmed flashinfer does not import here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.7.4", help="flashinfer-python release")
    parser.add_argument("--out", type=Path, default=ROOT / ".whl", help="the carried folder")
    parser.add_argument("--check", action="store_true",
                        help="then import the trimmed flashinfer.sampling here")
    args = parser.parse_args(argv)
    args.out.mkdir(exist_ok=True)
    for old in [*args.out.glob("flashinfer-*-sampling.tar.xz"), *args.out.glob("apache_tvm_ffi-*")]:
        old.unlink()
    with tempfile.TemporaryDirectory() as folder:
        wheel = download(f"flashinfer-python=={args.version}", Path(folder), None)
        with zipfile.ZipFile(wheel) as opened:
            tvm_spec = requirement(opened, "apache-tvm-ffi")
        target = args.out / f"flashinfer-{args.version}-sampling.tar.xz"
        count, unpacked = bundle(wheel, target)
        print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB as published")
    download(tvm_spec, args.out, "3.12")
    carried = sorted(p for p in args.out.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in carried)
    tree = working_tree_bytes()
    print(f"{target.name}: {count} files, {unpacked / 2**20:.1f} MiB unpacked")
    for path in carried:
        print(f"  {path.stat().st_size / 2**20:7.1f} MiB  {path.relative_to(ROOT)}")
    print(f"carried {total / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB = "
          f"{(total + tree) / 2**20:.1f} MiB of the {CARRY_LIMIT / 2**20:.0f} MiB limit")
    if total + tree > CARRY_LIMIT:
        print("over the limit: device_check.sh will measure without FlashInfer")
        return 1
    if args.check:
        check(target, tvm_spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
