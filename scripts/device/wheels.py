"""The Python packages a lent GPU machine lacks, as wheels for its Python, carried with the working tree.

    python -m scripts.device.wheels            # here (PyPI reachable): fills .whl/ (git-ignored)

The device machines run their image's Python 3.12 with its own torch and Triton; nothing can be fetched
there. `IMAGE_HAS` names the runtime dependencies (pyproject.toml) that image holds in versions that
serve (its torch and Triton are what the GPU is measured with); `CARRY` pins the rest, for CPython 3.12 on
x86-64 Linux, at the versions the suite runs here. protobuf and grpcio are carried although the image has
them: the generated stubs (services/protocol/ddtree/v1) need protobuf >= 7.35 and grpcio >= 1.85.1, newer
than an image's, typing-extensions (pydantic-core needs >= 4.16) and setuptools, which installs ddtree
there. scripts/device/selftest_gpu.sh installs `.whl/*.whl` ahead of the image's packages.
tests/deploy/test_device_runner.py keeps both lists covering pyproject's dependencies.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

IMAGE_HAS = frozenset(
    {"torch", "numpy", "safetensors", "tokenizers", "jinja2", "prometheus-client", "anyio", "tiktoken",
     "click", "h11"}
)  # fmt: skip
CARRY = {
    "grpcio": "1.85.3",
    "grpcio-health-checking": "1.85.1",
    "grpcio-reflection": "1.85.1",
    "protobuf": "7.36.2",
    "structlog": "26.1.0",
    "starlette": "1.10.0",
    "uvicorn": "0.55.0",  # needs click, h11
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "llguidance": "1.9.1",
    "typing-extensions": "4.16.0",  # pydantic-core needs >= 4.16, newer than an image's may be
    "setuptools": "84.2.1",  # builds ddtree's editable install there (bdist_wheel built in), whatever the image's
}
# the image has glibc 2.39: any of these tags installs there
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 17)) + ("manylinux2014_x86_64",)
WHEEL_DIR = pathlib.Path(__file__).resolve().parents[2] / ".whl"


def download(dest: pathlib.Path = WHEEL_DIR) -> list[pathlib.Path]:
    """Every CARRY wheel for CPython 3.12 on x86-64 Linux into dest (pip skips what is there already)."""
    dest.mkdir(exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pins = [f"{name}=={version}" for name, version in CARRY.items()]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *pins],
        check=True,
    )  # fmt: skip
    return sorted(dest.glob("*.whl"))


if __name__ == "__main__":
    wheels = download()
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {WHEEL_DIR}")
