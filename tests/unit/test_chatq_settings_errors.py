"""``chatq`` refuses an invalid setting the way it refuses a wrong option: one line naming
the setting, exit status 2, no traceback, and never the value (it may be a secret)."""

from __future__ import annotations

import pytest

from chatq.cli import main


def test_an_invalid_setting_makes_chatq_exit_2_with_the_settings_name_and_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHATQ_HTTP_PORT", "not-a-port-s3cr3t")
    code = main(["stats"])
    err = capsys.readouterr().err
    assert code == 2
    assert "CHATQ_HTTP_PORT" in err
    assert "Traceback" not in err
    assert "s3cr3t" not in err
