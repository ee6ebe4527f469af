"""`merge_tokens`: what a stream behind its replica sends as one chunk (pure, no processes)."""

from __future__ import annotations

from afd.serve.output import Piece, merge_tokens


def test_consecutive_tokens_become_one_piece_and_the_end_stays_apart() -> None:
    stamps = {"sent": 1.0}
    pieces = [Piece("Hel", 5, -0.1, stamps=stamps), Piece("", 6, -0.2, stamps=stamps), Piece("lo", 7, -0.3),
              Piece("!", finish_reason="length", engine_ttft_s=0.5)]  # fmt: skip
    merged = merge_tokens(pieces)
    assert [(p.text, p.token_id, p.tokens, p.finish_reason) for p in merged] == [
        ("Hello", 7, 3, None),
        ("!", None, 1, "length"),
    ]
    assert merged[0].stamps is stamps and merged[0].logprob == -0.3
    assert "".join(p.text for p in merged) == "".join(p.text for p in pieces)


def test_nothing_to_merge_is_left_as_it_came() -> None:
    one = [Piece("a", 1)]
    assert merge_tokens(one) == one
    assert merge_tokens([]) == []
    end_only = [Piece("", finish_reason="stop")]
    assert merge_tokens(end_only) == end_only
