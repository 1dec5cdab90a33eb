"""Start-up checks of ``megarl-train`` that run before any model is read or anything written."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest

from megarl.train import StartupError, check_dump_dirs, check_engine_installed, check_run_dir


def test_vllm_missing_is_one_line_before_any_model_is_loaded(vllm_not_installed):
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


def test_a_dump_folder_below_a_file_is_refused_at_start_up(tmp_path):
    """``trainer.rollout_data_dir`` under a regular file: refused before the run, not at step
    1's dump."""
    from megarl.config.schema import build_run_config

    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    cfg = build_run_config(
        {"trainer": {"run_dir": str(tmp_path / "run"), "rollout_data_dir": str(file / "gens")}}
    )
    with pytest.raises(StartupError) as refused:
        check_dump_dirs(cfg)
    assert str(refused.value) == (
        f"trainer.rollout_data_dir={file / 'gens'}: {file} is a file, not a folder"
    )
    assert file.read_text() == "keep me"


def test_a_new_or_existing_run_dir_passes_and_nothing_is_created(tmp_path):
    check_run_dir(str(tmp_path / "a" / "b"))
    check_run_dir(str(tmp_path))
    assert not (tmp_path / "a").exists()


def _cfg_for_logs(run_dir, debug: bool = False):
    from megarl.config.schema import RunConfig
    from megarl.config.trainer import TrainerConfig

    return RunConfig(trainer=TrainerConfig(run_dir=str(run_dir), debug=debug))


def test_an_unexpected_error_is_one_line_and_its_traceback_goes_to_the_log(tmp_path, capsys):
    from megarl.distributed.launcher import WorkerFailed
    from megarl.train import _tracebacks_to_log

    with pytest.raises(WorkerFailed) as failed, _tracebacks_to_log(_cfg_for_logs(tmp_path)):
        raise RuntimeError("boom\nsecond line")
    log = tmp_path / "logs" / "error-rank0.txt"
    host = socket.gethostname()
    expected = f"actor+rollout rank 0 on node {host} failed: RuntimeError: boom (traceback: {log})"
    assert str(failed.value).splitlines() == [expected]
    assert "Traceback" in log.read_text() and "boom" in log.read_text()
    assert "Traceback" not in capsys.readouterr().err


def test_a_ranks_traceback_is_logged_and_printed_only_in_debug(tmp_path, capsys):
    from megarl.distributed.launcher import WorkerFailed
    from megarl.train import _tracebacks_to_log

    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nKeyError: 3\n'
    with (
        pytest.raises(WorkerFailed) as failed,
        _tracebacks_to_log(_cfg_for_logs(tmp_path, debug=True)),
    ):
        raise WorkerFailed(1, 1, "KeyError: 3 during update_actor of step 2", traceback=trace)
    log = tmp_path / "logs" / "error-rank1.txt"
    assert log.read_text() == trace
    assert str(failed.value).endswith(f"during update_actor of step 2 (traceback: {log})")
    assert capsys.readouterr().err == trace


def test_an_earlier_init_model_is_kept_if_equal_and_set_aside_otherwise(tmp_path, capsys):
    from megarl.train import place_model_dir

    cfg = _cfg_for_logs(tmp_path / "run")
    for content in (b"weights", b"weights", b"other weights"):
        staging = tmp_path / "staging"
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(content)
        assert place_model_dir(cfg, str(staging), staging) == str(tmp_path / "run" / "init_model")
        assert not staging.exists()
    assert (tmp_path / "run" / "init_model" / "model.safetensors").read_bytes() == b"other weights"
    [aside] = (tmp_path / "run").glob("replaced-*-init_model")
    assert (aside / "model.safetensors").read_bytes() == b"weights"
    assert capsys.readouterr().err.count("renamed") == 1


def test_wandb_missing_is_one_line_exit_2_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from megarl.train import EXIT_BAD_INPUT, check_loggers_installed, main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args),
    )
    check_loggers_installed(("console", "jsonl", "tensorboard"))  # wandb is not asked for
    run_dir = tmp_path / "run"
    code = main([f"trainer.run_dir={run_dir}", "trainer.logger=[console,wandb]"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert err == (
        "megarl-train: error: trainer.logger names wandb, which is not installed: pip install "
        "wandb (or leave wandb out of trainer.logger)\n"
    )
    assert not run_dir.exists()


def test_the_rollout_actors_traceback_is_logged_under_its_own_name(tmp_path):
    """The split rollout actor (rank -1 in reports): ``logs/error-rollout.txt``."""
    from megarl.distributed.launcher import WorkerFailed
    from megarl.train import _tracebacks_to_log

    trace = 'Traceback (most recent call last):\n  File "loops.py", line 9\nKeyError: x\n'
    with pytest.raises(WorkerFailed) as failed, _tracebacks_to_log(_cfg_for_logs(tmp_path)):
        raise WorkerFailed(-1, None, "KeyError: 'x' during rollout", where="rollout actor on n")
    assert "(traceback:" not in str(failed.value)  # nothing to keep without a traceback
    with pytest.raises(WorkerFailed) as failed, _tracebacks_to_log(_cfg_for_logs(tmp_path)):
        raise WorkerFailed(-1, None, "KeyError: 'x'", where="rollout actor on n", traceback=trace)
    log = tmp_path / "logs" / "error-rollout.txt"
    assert log.read_text() == trace and str(failed.value).endswith(f"(traceback: {log})")
