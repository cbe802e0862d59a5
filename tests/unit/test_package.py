"""The package as a user meets it: public names, a light import, the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvfsm
from kvfsm.tools.cli import main

DESIGN_NAMES = [
    "KVPoll",
    "TERMINAL",
    "FailureKind",
    "FailureReason",
    "KVFSMError",
    "KVTransferError",
    "InvalidTransition",
    "DuplicateRoom",
    "UnknownRoom",
    "Role",
    "Timeouts",
    "TransferManager",
]


@pytest.mark.parametrize("name", DESIGN_NAMES)
def test_public_names_of_the_design_are_exported(name: str) -> None:
    assert name in kvfsm.__all__
    assert getattr(kvfsm, name) is not None


def test_import_is_light() -> None:
    code = (
        "import sys, kvfsm; print(sorted(m for m in ('torch', 'zmq', 'numpy', 'kvfsm.backends') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_manager_handles_each_role_string() -> None:
    assert kvfsm.TransferManager("sender").role is kvfsm.Role.SENDER
    assert kvfsm.TransferManager(kvfsm.Role.RECEIVER).role is kvfsm.Role.RECEIVER


def test_cli_requires_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err
