"""Install, on the device machine (no network), the carried wheels the image lacks.

Run by scripts/device_check.sh's deps stage: ``python3 scripts/device_deps.py WHEELS
TARGET``. ``make device-wheels`` filled WHEELS (one pinned wheel per distribution,
``--no-deps``: mk/cuda.mk's DEVICE_WHEELS is the whole list, their dependencies
included). A wheel is installed when its distribution is absent from this
interpreter; then what kvseal imports (``CHECK``) is imported with the result, and
if that fails, grpcio and protobuf are installed from WHEELS too (the image's are too
old for the generated stubs' gencode version guards) and it is tried again;
everything else comes from the image. The install goes into TARGET (first on
PYTHONPATH, never the system site-packages) with ``--no-index --no-deps``, isolated
from the image's pip configuration (``--isolated``: no PIP_* variables, no user
config; ``PIP_CONFIG_FILE=/dev/null``: no config file at all), so an image that
points pip at an unreachable mirror, or sets ``user = true`` or
``require-virtualenv``, changes nothing.

Prints one line per wheel (``install NAME VERSION (why)`` or ``keep NAME (the
image's VERSION)``) and pip's output. Exit status: 0 done (also when nothing was
needed); 1 pip failed; 2 WHEELS holds two versions of one distribution, or none.

Imports nothing from kvseal (it runs before kvseal's dependencies are there).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

# Taken from WHEELS even when the image has them, if CHECK fails with the image's.
STUB_DISTS = ("grpcio", "protobuf")
CHECK = (
    "import kvseal.v1.kvseal_pb2, kvseal.v1.kvseal_pb2_grpc, grpc_health.v1.health_pb2, "
    "grpc_reflection.v1alpha.reflection, cryptography.hazmat.primitives.ciphers.aead, "
    "opentelemetry.sdk.metrics"
)


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name (``grpcio_health_checking`` ->
    ``grpcio-health-checking``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_dist(path: Path) -> tuple[str, str]:
    """(canonical name, version) from a wheel's file name."""
    parts = path.name.split("-")
    if not path.name.endswith(".whl") or len(parts) < 5:
        raise ValueError(f"not a wheel file name: {path.name}")
    return canonical(parts[0]), parts[1]


def installed_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def imports_ok(target: Path) -> str | None:
    """None if ``CHECK`` imports with ``target`` first on the path, else the error's
    last line."""
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                       timeout=120, check=False, env=env)  # fmt: skip
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def select(
    wheels: list[Path], have: Callable[[str], str | None] = installed_version
) -> tuple[list[Path], list[Path], list[str]]:
    """(the wheels to install, the grpcio/protobuf wheels kept back because the image
    has those distributions, one line per wheel). ValueError if two wheels are of one
    distribution (pip would refuse both)."""
    seen: dict[str, Path] = {}
    for w in wheels:
        dist, _ = wheel_dist(w)
        if dist in seen:
            raise ValueError(f"two wheels of {dist}: {seen[dist].name} and {w.name}")
        seen[dist] = w
    chosen: list[Path] = []
    held: list[Path] = []
    lines: list[str] = []
    for dist, w in sorted(seen.items()):
        version = wheel_dist(w)[1]
        theirs = have(dist)
        if theirs is None:
            chosen.append(w)
            lines.append(f"install {dist} {version} (not in the image)")
        else:
            if dist in STUB_DISTS:
                held.append(w)
            lines.append(f"keep {dist} (the image's {theirs})")
    return chosen, held, lines


def pip_command(wheels: list[Path], target: Path) -> tuple[list[str], dict[str, str]]:
    """The pip call and its environment: offline, no dependency resolution, into
    ``target``, blind to the image's pip configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--quiet",
           "--upgrade", "--target", str(target), *map(str, wheels)]  # fmt: skip
    return cmd, env


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: device_deps.py WHEELS_DIR TARGET_DIR", file=sys.stderr)
        return 64
    wheel_dir, target = Path(argv[0]), Path(argv[1])
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        print(f"device-deps: no wheels in {wheel_dir}: run 'make device-wheels' and carry it")
        return 2
    try:
        chosen, held, lines = select(wheels)
    except ValueError as e:
        print(f"device-deps: {e}: empty {wheel_dir} and run 'make device-wheels' again")
        return 2
    for line in lines:
        print(f"device-deps: {line}")
    rc = install(chosen, target)
    if rc:
        return rc
    err = imports_ok(target)
    if err is not None and held:
        print(f"device-deps: kvseal's imports fail with the image's grpcio/protobuf ({err}):")
        print(f"device-deps: installing {', '.join(w.name for w in held)} too")
        rc = install(held, target)
        if rc:
            return rc
        err = imports_ok(target)
    print(f"device-deps: imports {'OK' if err is None else 'FAIL: ' + err}")
    return 0  # the caller's check of the modules says what is missing


def install(wheels: list[Path], target: Path) -> int:
    """Install ``wheels`` into ``target`` (pip as :func:`pip_command` says, or, for an
    interpreter without pip, by unpacking them). 0, or 1 when pip failed for one
    (the others are installed one at a time)."""
    if not wheels:
        return 0
    target.mkdir(parents=True, exist_ok=True)
    cmd, env = pip_command(wheels, target)
    probe = subprocess.run([*cmd[:3], "--version"], env=env, capture_output=True, check=False)
    if probe.returncode != 0:  # an image without pip: a wheel is a zip of site-packages
        print(f"device-deps: no pip for {sys.executable}: unpacking the wheels instead")
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(target)
        return 0
    if subprocess.run(cmd, env=env, check=False, timeout=300).returncode == 0:
        print(f"device-deps: installed {len(wheels)} wheels into {target}")
        return 0
    # One broken wheel must not cost the others: one at a time, the failures named.
    failed = []
    for w in wheels:
        one, _ = pip_command([w], target)
        if subprocess.run(one, env=env, check=False, timeout=120).returncode != 0:
            failed.append(w.name)
    print(f"device-deps: pip failed for {', '.join(failed) or 'all of them at once'}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
