"""Shared fixtures for reward tests: sandbox instance and a leftover-process check."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import psutil
import pytest

from megatron_cascade.rewards.sandbox import CodeSandbox


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions ``marker``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture(name="processes_with")
def processes_with_fixture():
    """The :func:`processes_with` helper (test modules cannot import conftest)."""
    return processes_with


@pytest.fixture(scope="session")
def sandbox() -> CodeSandbox:
    return CodeSandbox()


@pytest.fixture
def marker() -> str:
    """A unique string embedded in attack programs' command lines."""
    return f"mcmarker{uuid.uuid4().hex}"


@pytest.fixture(scope="session", autouse=True)
def private_sandbox_root():
    """This session's sandboxes make their folders (mc-sandbox-*) in a private temporary folder, so
    that the leftover check sees (and kills) only this session's, never another run's on the machine."""
    before, folder = tempfile.tempdir, tempfile.mkdtemp(prefix="mc-reward-tests-")
    os.chmod(folder, 0o711)  # traversable (not listable) for the unsafe mode's dropped uid, as /tmp is
    tempfile.tempdir = folder
    yield folder
    tempfile.tempdir = before
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def no_leftovers(private_sandbox_root):
    """After the test: no process of this session's sandbox runs (their command lines name their
    mc-sandbox-* folder) is alive."""
    yield
    leftovers = processes_with(os.path.join(private_sandbox_root, "mc-sandbox-"))
    for p in leftovers:  # clean up before failing, so one failure does not cascade
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not leftovers, [p.info for p in leftovers]
