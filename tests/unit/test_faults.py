from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from shared import faults

pytestmark = pytest.mark.unit


def test_arming_an_unknown_fault_point_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.arm("receiver.after_comit")


def test_an_unarmed_fault_point_does_nothing() -> None:
    faults.arm(None)
    faults.fault_point("receiver.after_commit")


def test_reaching_the_armed_fault_point_kills_the_process_with_sigkill() -> None:
    code = (
        "from shared import faults\n"
        "faults.arm('relay.after_publish')\n"
        "faults.fault_point('receiver.after_commit')\n"
        "print('passed the other point', flush=True)\n"
        "faults.fault_point('relay.after_publish')\n"
        "print('survived')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == -signal.SIGKILL
    assert "passed the other point" in result.stdout
    assert "survived" not in result.stdout
    assert "FAULT POINT relay.after_publish" in result.stderr
