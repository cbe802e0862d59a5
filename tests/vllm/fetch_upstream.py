"""Fetch vLLM 0.33.0's own KV-connector lifecycle tests from its sdist (not committed here).

    python -m tests.vllm.fetch_upstream [DEST]      (default: build/vllm-upstream)

Downloads the sdist from PyPI once (sha256-checked; `KVFSM_VLLM_SDIST`
names a local copy instead) and extracts only the test files the kvfsm
connector is run against, with vLLM's `tests` package renamed
`vllm_upstream_tests` (this repository has a `tests` package of its own).
The files are otherwise unchanged; `tests/vllm/upstream_plugin.py` holds
every adaptation. vLLM is Apache-2.0; its LICENSE is extracted alongside.
Prints the directory holding the test files.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.33.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/f7/25/"
    "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz"
)
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
PACKAGE = "vllm_upstream_tests"
UNIT = "v1/kv_connector/unit"
#: The lifecycle suites of issue 14, and what they import.
TEST_FILES = (
    "test_remote_prefill_lifecycle.py",
    "test_remote_decode_lifecycle.py",
    "test_kv_load_failure_recovery.py",
    "test_invalid_blocks_correctness.py",
)
SUPPORT_FILES = (
    "__init__.py",
    "v1/__init__.py",
    "v1/kv_connector/__init__.py",
    *(f"{UNIT}/{name}" for name in ("__init__.py", "conftest.py", "utils.py")),
)


def _sdist(workdir: Path) -> Path:
    local = os.environ.get("KVFSM_VLLM_SDIST")
    path = Path(local) if local else workdir / f"vllm-{VERSION}.tar.gz"
    if not local:
        with urllib.request.urlopen(SDIST_URL, timeout=120) as response, path.open("wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {SDIST_SHA256} (vllm {VERSION} sdist)")
    return path


def fetch(dest: Path) -> Path:
    """Extract the suites into `dest`; returns the directory of the test files."""
    unit = dest / PACKAGE / UNIT
    if all((unit / name).is_file() for name in TEST_FILES):
        return unit
    with tempfile.TemporaryDirectory() as tmp:
        sdist = _sdist(Path(tmp))
        prefix = f"vllm-{VERSION}/"
        wanted = {f"{prefix}tests/{name}": dest / PACKAGE / name for name in SUPPORT_FILES}
        wanted.update({f"{prefix}tests/{UNIT}/{name}": unit / name for name in TEST_FILES})
        wanted[f"{prefix}LICENSE"] = dest / PACKAGE / "LICENSE"
        with tarfile.open(sdist) as archive:
            for member, target in wanted.items():
                source = archive.extractfile(member)
                if source is None:
                    raise SystemExit(f"{member} is missing from the vllm {VERSION} sdist")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read())
    return unit


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1] if len(sys.argv) > 1 else "build/vllm-upstream").resolve()))
