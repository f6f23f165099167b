"""Where a measurement was made: package versions, the git commit (and whether the tree was dirty), the driver,
the GPU's results folder, and the fields every result file's provenance starts with (:func:`run_context`)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from ..roofline import gpu_key_from_name

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def package_version(package: str) -> str | None:
    """The installed version of ``package``, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git(*command: str) -> str | None:
    """``git <command>`` in the repository, its stdout stripped; None when git fails or is missing."""
    try:
        done = subprocess.run(["git", *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> str | None:
    return git("rev-parse", "HEAD")


def git_dirty() -> bool | None:
    """Whether tracked or untracked-not-ignored files differ from HEAD (results folders left out)."""
    status = git("status", "--porcelain", "--", ".", ":(exclude)data/results")
    return None if status is None else bool(status)


def git_status_lines(limit: int = 10) -> list[str] | None:
    """The first ``limit`` lines of ``git status --porcelain`` (results folders left out): what makes a tree dirty."""
    status = git("status", "--porcelain", "--", ".", ":(exclude)data/results")
    return None if status is None else status.splitlines()[:limit]


def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it; None without one."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def recorded_commit() -> str | None:
    """The commit a run records: ``GIT_COMMIT`` when set (a copy of the tree may carry a .git whose HEAD is
    not what runs), else HEAD."""
    return os.environ.get("GIT_COMMIT") or git_commit()


def gpu_key(device: torch.device) -> str:
    """The results folder of ``device``: its GPU's key (``H200``, ``H100-SXM``, ...), or ``cpu``."""
    return gpu_key_from_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"


def run_context(device: torch.device, started, module: str) -> dict:
    """The provenance fields every run records: GPU and driver, versions, commit, date (``started``, a
    datetime), host, and the command line as ``python -m <module> <arguments>``."""
    on_cuda = device.type == "cuda"
    return dict(
        gpu_name=torch.cuda.get_device_name(device) if on_cuda else None,
        gpu_key=gpu_key(device),
        driver_version=driver_version() if on_cuda else None,
        torch=torch.__version__,
        triton=package_version("triton"),
        cuda=torch.version.cuda,
        python=sys.version.split()[0],
        git_commit=recorded_commit(),
        date_utc=started.isoformat(timespec="seconds"),
        hostname=socket.gethostname(),
        command=shlex.join([sys.executable, "-m", module, *sys.argv[1:]]),
    )
