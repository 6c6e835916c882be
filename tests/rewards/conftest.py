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


@pytest.fixture
def no_leftovers():
    """After the test: no process of this test's sandbox runs is alive. The test's sandboxes make
    their folders (mc-sandbox-*, named on their command lines) in a private temporary folder, so the
    check sees (and kills) only theirs, never another run's on the machine; the folder is traversable
    (0711, as /tmp) for the unsafe mode's dropped uid."""
    before, folder = tempfile.tempdir, tempfile.mkdtemp(prefix="mc-reward-test-")
    os.chmod(folder, 0o711)
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = before
    leftovers = processes_with(os.path.join(folder, "mc-sandbox-"))
    for p in leftovers:  # clean up before failing, so one failure does not cascade
        try:
            p.kill()
        except psutil.Error:
            pass
    shutil.rmtree(folder, ignore_errors=True)
    assert not leftovers, [p.info for p in leftovers]
