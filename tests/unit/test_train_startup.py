"""Start-up checks of ``megarl-train`` that run before any model is read or anything written."""

from __future__ import annotations

import importlib.util
import os

import pytest

from megarl.train import StartupError, check_engine_installed, check_run_dir


def test_vllm_missing_is_one_line_before_any_model_is_loaded(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "vllm" else real_find_spec(name, *args),
    )
    with pytest.raises(StartupError) as info:
        check_engine_installed("vllm")
    message = str(info.value)
    assert message.startswith("rollout.engine=vllm needs vLLM, which is not installed")
    assert "rollout.engine=hf" in message and "\n" not in message
    check_engine_installed("hf")  # needs nothing beyond megarl


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    with pytest.raises(StartupError, match=r"trainer.run_dir=.*notes.txt: exists and is not a"):
        check_run_dir(str(file))
    with pytest.raises(StartupError, match=r"notes.txt is a file, not a folder"):
        check_run_dir(str(file / "run"))
    assert file.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_parent_is_refused(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        with pytest.raises(StartupError, match=r"ro is not writable"):
            check_run_dir(str(parent / "run"))
    finally:
        parent.chmod(0o700)


def test_a_new_or_existing_run_dir_passes_and_nothing_is_created(tmp_path):
    check_run_dir(str(tmp_path / "a" / "b"))
    check_run_dir(str(tmp_path))
    assert not (tmp_path / "a").exists()
