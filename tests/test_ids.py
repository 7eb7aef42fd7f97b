"""Request and future ids: random hex from the kernel's source, cut from pages of random bytes, never
repeated across threads or pages."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from loraplex import ids


def test_ids_are_hex_of_the_asked_length_and_never_repeat_across_threads_and_pages() -> None:
    def draw(_: int) -> list[str]:
        return [ids.random_hex() for _ in range(2000)]  # 16 bytes each: 256 a page, so many pages

    with ThreadPoolExecutor(4) as pool:
        drawn = [value for values in pool.map(draw, range(4)) for value in values]
    assert len(set(drawn)) == len(drawn) == 8000
    assert all(re.fullmatch(r"[0-9a-f]{32}", value) for value in drawn)
    assert re.fullmatch(r"[0-9a-f]{16}", ids.random_hex(8))


def test_a_new_page_is_read_only_when_the_current_one_is_used_up(monkeypatch) -> None:
    reads: list[int] = []
    real = ids.os.urandom

    def counted(size: int) -> bytes:
        reads.append(size)
        return real(size)

    monkeypatch.setattr(ids.os, "urandom", counted)
    monkeypatch.setattr(ids, "_page", b"")
    for _ in range(512):
        ids.random_hex()
    assert reads == [4096, 4096]  # 512 ids of 16 bytes: two pages, two system calls


def test_a_forked_child_draws_from_a_page_of_its_own() -> None:
    ids.random_hex()  # the parent holds a partly used page
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        os.write(write, ids.random_hex().encode())
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 64).decode() != ids.random_hex()  # the parent's next id is not the child's
