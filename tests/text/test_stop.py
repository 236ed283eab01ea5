"""StopMatcher against a whole-text reference, over random texts, stop strings and chunkings."""

from __future__ import annotations

import random

import pytest

from edgeserve.text.stop import StopMatcher


def reference(text: str, stop: list[str]) -> tuple[str, bool]:
    """The full text cut before the stop string occurrence that is complete first, and whether there was one.

    "Complete first" (earliest end, then longest) rather than "starts first": generation halts the moment
    a stop string appears, so an overlapping longer one that would have started earlier never gets to finish.
    """
    ends = [(i + len(s), -len(s)) for s in stop if s and (i := text.find(s)) >= 0]
    if not ends:
        return text, False
    end, minus_len = min(ends)
    return text[: end + minus_len], True


def run(chunks: list[str], stop: list[str]) -> tuple[str, bool]:
    """Stream `chunks` through a StopMatcher, checking after every step that nothing is retracted."""
    expected, expect_stop = reference("".join(chunks), stop)
    matcher = StopMatcher(stop)
    shown = ""
    for chunk in chunks:
        emit, stopped = matcher.push(chunk)
        shown += emit
        assert expected.startswith(shown), (chunks, stop, shown)
        if stopped:
            break
    else:
        shown += matcher.flush()
        stopped = False
    assert (shown, stopped) == (expected, expect_stop), (chunks, stop)
    return shown, stopped


def random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # generation can yield empty text (a partial character); sprinkle some in
    for _ in range(rng.randint(0, 2)):
        chunks.insert(rng.randint(0, len(chunks)), "")
    return chunks


def test_random_against_reference():
    rng = random.Random(0)
    stopped = 0
    for _ in range(5000):
        alphabet = "abc"[: rng.randint(2, 3)]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        stopped += run(random_chunks(rng, text), stop)[1]
    assert 1000 < stopped < 4900  # both outcomes are well covered


@pytest.mark.parametrize(
    "chunks, stop, expected",
    [
        (["Hello ST", "OP there"], ["STOP"], "Hello "),  # split across 2 chunks
        (["x<", "/e", "nd>y"], ["</end>"], "x"),  # split across 3 chunks
        (["S", "T", "O", "P", "..."], ["STOP"], ""),  # at the very start, one char at a time
        (["STOP"], ["STOP"], ""),
        (["abab", "abc"], ["ababc"], "ab"),  # the partial match restarts inside itself
        (["xaab", "x"], ["aabx", "abx"], "x"),  # overlapping stop strings: the earliest start wins
        (["xab", "cd"], ["bcd", "abcz"], "xa"),  # held for the longer one, matched by the shorter
        (["abc", "de"], ["cde", "bcdef"], "ab"),
        (["ba", "ba"], ["a", "baba"], "b"),  # "a" completes before "baba" could
        (["xbab", "a"], ["baba", "aba"], "x"),  # both complete at once: the longer one is cut
        (["no stop", " here"], ["STOP"], "no stop here"),
        (["ST", "OOP"], ["STOP"], "STOOP"),  # a false start is released
        (["tail S"], ["STOP"], "tail S"),  # held back, then flushed at the end
    ],
)
def test_cases(chunks, stop, expected):
    assert run(chunks, stop)[0] == expected


def test_partial_text_is_held_then_released():
    m = StopMatcher(["</s>"])
    assert m.push("a</") == ("a", False)
    assert m.push("x") == ("</x", False)
    assert m.push("</s") == ("", False)
    assert m.push(">b") == ("", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_no_stop_strings_pass_everything():
    m = StopMatcher(["", ""])
    assert m.push("abc") == ("abc", False)
    assert m.flush() == ""


class _Letters:
    """A tokenizer stand-in: token i is the letter chr(ord('a') + i)."""

    byte_fallback_ids = frozenset()

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_stop_string_inside_a_speculative_run_counts_only_the_tokens_kept():
    """Speculation hands over several tokens at once; when a stop string ends inside them, the tokens after it are
    dropped and usage (num_output_tokens) counts only the ones kept."""
    from edgeserve.engine.outputs import TokenOutput
    from edgeserve.engine.sched.output_processor import OutputProcessor
    from edgeserve.sampling_params import SamplingParams

    proc = OutputProcessor("r", [0], SamplingParams(max_tokens=50, stop=["cd"]), _Letters())
    first = proc.process(TokenOutput("r", [0, 1], None, num_output_tokens=2))  # "ab"
    assert first.num_output_tokens == 2 and first.finish_reason is None
    # a run of 4 accepted tokens "cdef": the stop string "cd" ends at the 2nd; "ef" overshoot
    out = proc.process(TokenOutput("r", [2, 3, 4, 5], None, num_output_tokens=6))
    assert out.finish_reason == "stop" and out.stop_reason == "cd"
    assert out.token_ids == [2, 3]
    assert first.text + out.text == "ab"
    assert out.num_output_tokens == 4
