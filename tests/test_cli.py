"""Errors reach the user as one line and exit code 1, not a traceback."""
import pytest

from jobs import cli


def test_missing_google_credentials_are_one_clear_line(monkeypatch, capsys):
    from google.auth.exceptions import DefaultCredentialsError

    def dispatch(args, beam_args):
        raise DefaultCredentialsError("Your default credentials were not found.")

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    assert cli.main(["collect", "--out", "gs://bucket/run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("promptmill collect: error: no usable Google Cloud credentials")
    assert "credentials were not found" in err and "gcloud auth application-default login" in err


def test_other_unexpected_errors_are_not_hidden(monkeypatch):
    def dispatch(args, beam_args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    with pytest.raises(KeyError):
        cli.main(["collect", "--out", "out"])
