"""Short embedding / rerank inputs are tokenized on the event loop (no thread hand-over for a lone request); long
ones in a worker thread."""

from __future__ import annotations

import threading

import anyio

from edgeserve.server.api import embeddings
from edgeserve.server.api.embeddings import OFF_LOOP_CHARS, text_chars, tokenize_off_loop_if_large


def _thread_of(chars: int) -> threading.Thread:
    async def main() -> threading.Thread:
        return await tokenize_off_loop_if_large(threading.current_thread, chars)

    return anyio.run(main)


def test_short_inputs_tokenize_on_the_loop_and_long_ones_off_it():
    assert _thread_of(text_chars(["a short text", [1, 2, 3]])) is threading.current_thread()
    assert _thread_of(OFF_LOOP_CHARS) is not threading.current_thread()


def test_text_chars_counts_strings_and_ids():
    assert text_chars(["abc", [5, 6]]) == 5
    assert embeddings.OFF_LOOP_CHARS > text_chars(["word " * 400])  # a 512-token text stays on the loop
