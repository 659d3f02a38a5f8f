"""The abort waits until the launcher has read the rank's report: MPICH's
mpiexec prints only what its proxy forwarded before the abort reached it."""

import os
import threading
import time

import pytest

from commlib import abort

REPORT = b"commlib: uncaught RuntimeError on rank 1 of 3\n" * 100


@pytest.fixture
def pipe():
    read_end, write_end = os.pipe()
    yield read_end, write_end
    os.close(read_end)
    os.close(write_end)


def drain(fd: int, size: int) -> None:
    taken = 0
    while taken < size:
        taken += len(os.read(fd, size - taken))


def test_unread_bytes_counts_what_the_reader_has_not_taken(pipe):
    read_end, write_end = pipe
    assert abort.unread_bytes(write_end) == 0
    os.write(write_end, REPORT)
    assert abort.unread_bytes(write_end) == len(REPORT)
    os.read(read_end, 100)
    assert abort.unread_bytes(write_end) == len(REPORT) - 100


def test_unread_bytes_is_zero_for_what_is_not_a_pipe(tmp_path):
    with open(tmp_path / "log", "wb") as log:
        log.write(REPORT)
        log.flush()
        assert abort.unread_bytes(log.fileno()) == 0
    assert abort.unread_bytes(10_000) == 0      # not open: nothing to wait for


def test_waits_until_the_reader_has_taken_everything(pipe, monkeypatch):
    read_end, write_end = pipe
    os.write(write_end, REPORT)
    # the reader starts only once the abort is waiting: an abort that did not
    # wait would find the report still unread
    waiting = threading.Event()
    real_sleep = time.sleep

    def sleep_and_note(seconds):
        waiting.set()
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep_and_note)
    reader = threading.Thread(target=lambda: (waiting.wait(), drain(read_end, len(REPORT))))
    reader.start()
    try:
        assert abort.wait_for_output_forwarded(limit_s=60, fds=(write_end,)) is True
        assert abort.unread_bytes(write_end) == 0
    finally:
        waiting.set()
        reader.join()


def test_gives_up_at_the_limit_when_nobody_reads(pipe):
    _, write_end = pipe
    os.write(write_end, REPORT)
    assert abort.wait_for_output_forwarded(limit_s=0.05, fds=(write_end,)) is False
    assert abort.unread_bytes(write_end) == len(REPORT)
