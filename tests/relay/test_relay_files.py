"""Files at rest: the run dir, checkpoint dir, weight store and key files are owner-only, and a key
file or run dir that another user owns is refused with an error naming the path and the owner."""

import os
import re

import pytest

from laminar_jax.net import auth
from laminar_jax.relay.store import WeightStore

OTHER_UID = 54321  # no such user here: the error names the bare uid


def _mode(path):
    return os.stat(path).st_mode & 0o777


def test_the_run_dir_checkpoints_weights_and_keys_are_created_owner_only(tmp_path):
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.runtime.parts import resolve

    run_dir = str(tmp_path / "run")
    cfg, resuming = resolve(finalize(repo_config("demo", "short")), run_dir)
    assert not resuming
    assert _mode(run_dir) == 0o700 and _mode(cfg.learner.checkpoint_dir) == 0o700
    auth.run_keys(run_dir)
    for name in (auth.KEY_FILE, auth.LEARNER_KEY_FILE):
        assert _mode(os.path.join(run_dir, name)) == 0o600
    WeightStore(os.path.join(run_dir, "weights"))
    assert _mode(os.path.join(run_dir, "weights")) == 0o700


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@needs_root
@pytest.mark.parametrize("name", [auth.KEY_FILE, auth.LEARNER_KEY_FILE])
def test_a_key_file_another_user_owns_is_refused_naming_it_and_its_owner(tmp_path, name):
    auth.run_keys(str(tmp_path))
    path = str(tmp_path / name)
    os.chown(path, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=rf"{re.escape(path)}: .* owned by uid {OTHER_UID}"):
        auth.run_keys(str(tmp_path))


@needs_root
def test_a_run_dir_another_user_owns_is_refused_naming_it_and_its_owner(tmp_path):
    from laminar_jax.config import finalize, repo_config
    from laminar_jax.runtime.parts import resolve

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chown(run_dir, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=rf"{re.escape(str(run_dir))}: run dir is owned by uid {OTHER_UID}"):
        resolve(finalize(repo_config("demo", "short")), str(run_dir))
    with pytest.raises(PermissionError, match=rf"{re.escape(str(run_dir))}: run dir is owned by uid {OTHER_UID}"):
        auth.run_keys(str(run_dir))
    assert not (run_dir / auth.KEY_FILE).exists()  # refused before any key is written into it


def test_the_owner_check_compares_with_this_process_user(tmp_path, monkeypatch):
    """Without root: this process pretends to be another user, so the files it made are foreign."""
    auth.run_keys(str(tmp_path))
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    key_file = re.escape(str(tmp_path / auth.KEY_FILE))
    with pytest.raises(PermissionError, match=rf"{key_file}: relay key is owned by .*uid {me}"):
        auth.load_key(str(tmp_path / auth.KEY_FILE))
    with pytest.raises(PermissionError, match="learner public key is owned by"):
        auth.load_public_key(str(tmp_path / auth.LEARNER_PUB_FILE))
    with pytest.raises(PermissionError, match=rf"{re.escape(str(tmp_path))}: run dir is owned by"):
        auth.private_dir(str(tmp_path))


def test_a_key_file_others_may_read_is_refused(tmp_path):
    auth.run_keys(str(tmp_path))
    os.chmod(tmp_path / auth.LEARNER_KEY_FILE, 0o640)
    with pytest.raises(PermissionError, match="owner-only"):
        auth.run_keys(str(tmp_path))
