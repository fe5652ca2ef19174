"""The AgentSpec structure automaton (drafters/common/structure.py) on nasty inputs."""

from __future__ import annotations

import dataclasses
import random
import re

import numpy as np
import pytest

from agentspec_sim.drafters.common.structure import (
    ROOT,
    StructureAutomaton,
    block_labels,
    segment,
    segment_fed,
    segment_many,
)

FENCE_PY = ("```python", "```")
TOOL = ("<tool_call>", "</tool_call>")
CODE_TOOL = ((FENCE_PY, TOOL),)  # group 0: (0, 0) = python fence, (0, 1) = tool call
MATH = ((("\\[", "\\]"), ("$$", "$$"), ("$", "$")),)  # (0, 0) \[ \], (0, 1) $$, (0, 2) $
PY, TC = (0, 0), (0, 1)
DISPLAY, INLINE = (0, 1), (0, 2)


def labels_of(pieces: list[str | bytes], structure) -> list[tuple[int, int]]:
    """segment() of a token sequence given as its pieces (token i = pieces[i])."""
    table = [p.encode() if isinstance(p, str) else p for p in pieces]
    index = segment(np.arange(len(table), dtype=np.int32), table, structure)
    labels = block_labels(structure)
    return [labels[i] for i in index]


def feed_all(structure, pieces) -> list[tuple[int, int]]:
    """The block reported after each piece, fed incrementally."""
    pda = StructureAutomaton(structure)
    return [pda.feed(p.encode() if isinstance(p, str) else p) for p in pieces]


def test_block_labels_and_root() -> None:
    assert block_labels(CODE_TOOL) == [ROOT, PY, TC]
    assert block_labels(()) == [ROOT]
    assert StructureAutomaton(CODE_TOOL).block == ROOT
    # lists (as JSON gives them) are accepted too
    assert block_labels([[list(FENCE_PY), list(TOOL)]]) == [ROOT, PY, TC]


def test_delimiter_split_across_tokens() -> None:
    pda = StructureAutomaton(CODE_TOOL)
    assert pda.feed(b"Here:\n``") == ROOT
    assert pda.pending == b"``"
    assert pda.feed(b"`python\n") == PY
    assert pda.pending == b""
    assert pda.feed(b"x = 1\n`") == PY
    assert pda.feed(b"``") == ROOT  # innermost closer: at once, nothing pending
    assert pda.pending == b""
    # and one byte per token
    pda = StructureAutomaton(CODE_TOOL)
    for b in b"<tool_call>":
        pda.feed(bytes([b]))
    assert pda.block == TC


def test_nested_fence_inside_tool_call() -> None:
    pieces = ["I will run it.", "<tool_call>", '{"code": "', "```", "python", "\n", "print(1)", "\n", "```",
              '"}', "</tool_call>", " done"]
    got = labels_of(pieces, CODE_TOOL)
    # each token is labelled with the block active when it starts
    assert got == [ROOT, ROOT, TC, TC, TC, PY, PY, PY, PY, TC, TC, ROOT]
    pda = StructureAutomaton(CODE_TOOL)
    pda.feed("".join(pieces[:7]).encode())
    assert pda.stack == (TC, PY)
    assert pda.block == PY  # the innermost pair, not the path


def test_unclosed_blocks_stay_open() -> None:
    pda = StructureAutomaton(CODE_TOOL)
    assert pda.feed(b"<tool_call>```python\nprint(1)\n") == PY
    assert pda.flush() == PY
    assert pda.stack == (TC, PY)
    assert labels_of(["<tool_call>", "```python", "\n", "x"], CODE_TOOL) == [ROOT, TC, PY, PY]


def test_closer_of_outer_block_pops_to_it() -> None:
    # the fence is never closed; </tool_call> closes it too
    pda = StructureAutomaton(CODE_TOOL)
    pda.feed(b"<tool_call>```python\nprint(1)\n</tool_call>after")
    assert pda.stack == ()
    assert pda.block == ROOT


def test_closers_without_opener_are_text() -> None:
    assert feed_all(CODE_TOOL, ["```", "\n", "</tool_call>", "x", "```python", "\n"]) == [
        ROOT, ROOT, ROOT, ROOT, PY, PY,
    ]
    # a closer of nothing open never waits either
    pda = StructureAutomaton(CODE_TOOL)
    pda.feed(b"</tool_call>")
    assert pda.pending == b"" and pda.block == ROOT


def test_innermost_closer_beats_longer_opener() -> None:
    structure = ((FENCE_PY, ("```bash", "```")),)
    pda = StructureAutomaton(structure)
    pda.feed(b"```python\nx\n")
    assert pda.block == (0, 0)
    pda.feed(b"```")
    assert pda.block == ROOT and pda.pending == b""  # no wait for a possible ```bash
    pda.feed(b"bash\n")
    assert pda.block == ROOT  # "bash" after a closer is text


def test_dollar_and_double_dollar() -> None:
    pda = StructureAutomaton(MATH)
    assert pda.feed(b"cost $") == ROOT and pda.pending == b"$"  # `$` or `$$`? wait
    assert pda.feed(b"$") == DISPLAY  # `$$`: nothing can be longer, open at once
    assert pda.feed(b"x^2$") == DISPLAY and pda.pending == b"$"  # could be the `$$` closer
    assert pda.feed(b"$") == ROOT
    assert pda.feed(b" and $") == ROOT
    assert pda.feed(b"y") == INLINE  # the next byte shows it was `$`
    assert pda.feed(b"$") == ROOT  # innermost closer `$`: closes at once
    assert pda.feed(b"\\[a\\]") == ROOT
    assert pda.stack == ()
    # `$` inside `$$` is not its closer: it opens an inline block (open == close rule)
    pda = StructureAutomaton(MATH)
    pda.feed(b"$$a$b")
    assert pda.stack == (DISPLAY, INLINE)


def test_dollar_split_and_flush() -> None:
    assert feed_all(MATH, ["$", "$", "x", "$", "$"]) == [ROOT, DISPLAY, DISPLAY, DISPLAY, ROOT]
    assert feed_all(MATH, ["$", "x", "$"]) == [ROOT, INLINE, ROOT]
    pda = StructureAutomaton(MATH)
    assert pda.feed(b"pay $") == ROOT
    assert pda.flush() == INLINE  # end of input: the longest complete match is `$`
    assert pda.pending == b""
    # segment: the token after a pending `$` starts before it is resolved
    assert labels_of(["$", "x", "$", "y"], MATH) == [ROOT, ROOT, INLINE, ROOT]
    assert labels_of(["$$", "x", "$$", "y"], MATH) == [ROOT, DISPLAY, DISPLAY, ROOT]


def test_open_equals_close_group_pair() -> None:
    structure = ((("```", "```"), FENCE_PY),)
    # ``` + newline opens the generic fence; ```python is the longer opener
    assert feed_all(structure, ["```", "\n", "a", "```", "\n"]) == [ROOT, (0, 0), (0, 0), ROOT, ROOT]
    assert feed_all(structure, ["```", "python", "\n", "```"]) == [ROOT, (0, 1), (0, 1), ROOT]


def test_multibyte_characters_split_across_tokens() -> None:
    you = "你".encode()
    assert len(you) == 3
    structure = ((("你", "好"),),)
    pieces = [you[:1], you[1:2], you[2:], b"abc", "好".encode()[:2], "好".encode()[2:], b"z"]
    assert feed_all(structure, pieces) == [ROOT, ROOT, (0, 0), (0, 0), (0, 0), ROOT, ROOT]
    # a multi-byte character sharing a lead byte with the delimiter is text
    assert feed_all(structure, ["佢", "x"]) == [ROOT, ROOT]  # 佢 = e4 bd a2, 你 = e4 bd a0
    # multi-byte text around ASCII delimiters, split mid-character
    text = "代码：```python\n打印()\n```完".encode()
    pieces = [text[i : i + 2] for i in range(0, len(text), 2)]
    pda = StructureAutomaton(CODE_TOOL)
    seen = [pda.feed(p) for p in pieces]
    assert PY in seen and seen[-1] == ROOT


def test_empty_structure_and_empty_input() -> None:
    assert StructureAutomaton(()).feed(b"```python\n") == ROOT
    assert segment(np.zeros(0, dtype=np.int32), [b"a"], CODE_TOOL).shape == (0,)
    assert segment(np.array([0, 0]), [b"```python\n"], ()).tolist() == [0, 0]


RANDOM_CASES = [
    (
        ((FENCE_PY, TOOL, ("```bash", "```")), (("\\[", "\\]"), ("$$", "$$"), ("$", "$"))),
        ["`", "``", "```", "python", "bash", "\n", "<tool", "_call>", "</tool_call>", "<", "/", "$", "$$",
         "\\", "[", "]", "x", " ", "é".encode()[:1], "é".encode()[1:], "tool_call>", "```python\n"],
    ),
    (
        ((("```", "```"), FENCE_PY), (("<a>", "</a>"), ("<", ">"), ("<ab", "b>"))),
        ["`", "```", "```python", "py", "thon", "<", "a", ">", "</a>", "b", "<ab", "b>", "/", "x"],
    ),
]


@pytest.mark.parametrize(("structure", "alphabet"), RANDOM_CASES)
def test_segment_matches_incremental_feed(structure, alphabet) -> None:
    """segment()[i] == the block after feeding tokens 0..i-1, on random token soups (segment_fed also
    leaves the fed automaton's state), and both agree with a reference that puts every byte through
    the pending buffer."""
    table = [a.encode() if isinstance(a, str) else a for a in alphabet]
    rng = random.Random(7)
    for _ in range(400):
        ids = [rng.randrange(len(table)) for _ in range(rng.randrange(1, 60))]
        fast = segment(np.array(ids, dtype=np.int32), table, structure)
        pda = StructureAutomaton(structure)
        slow = []
        for i in ids:
            slow.append(pda.block_index)
            pda.feed(table[i])
        assert fast.tolist() == slow
        labels, fed = segment_fed(np.array(ids, dtype=np.int32), table, structure)  # and the state it leaves
        assert labels.tolist() == slow and fed.stack == pda.stack and fed.pending == pda.pending
        # reference: no regex skipping or jumping, one byte at a time
        ref = StructureAutomaton(structure)
        ref._t = dataclasses.replace(ref._t, candidate=re.compile(b".", re.DOTALL))
        ref_blocks = []
        for i in ids:
            ref_blocks.append(ref.block_index)
            for b in table[i]:
                ref.feed(bytes([b]))
        assert ref_blocks == slow
        assert ref.stack == pda.stack and ref.pending == pda.pending
        assert ref.flush() == pda.flush()


def test_segment_many_starts_each_call_fresh() -> None:
    table = [b"<tool_call>", b"x", b"$", b"```python\n", b"", b"</tool_call>"]
    calls = [np.array(c, dtype=np.int32) for c in ([0, 1, 3, 1], [1, 1], [], [2], [1, 2, 1, 2], [4, 1], [5, 1])]
    got = segment_many(calls, table, CODE_TOOL + MATH)
    assert got.tolist() == np.concatenate([segment(c, table, CODE_TOOL + MATH) for c in calls]).tolist()
    assert got[4:6].tolist() == [0, 0]  # the second call starts at the root, not in the open fence
    rng = random.Random(3)
    for _ in range(100):
        calls = [np.array([rng.randrange(len(table)) for _ in range(rng.randrange(0, 8))], dtype=np.int32)
                 for _ in range(rng.randrange(1, 6))]
        expect = [segment(c, table, CODE_TOOL + MATH) for c in calls]
        assert segment_many(calls, table, CODE_TOOL + MATH).tolist() == np.concatenate(expect).tolist()


def test_empty_delimiter_rejected() -> None:
    with pytest.raises(ValueError):
        StructureAutomaton(((("", "x"),),))


@pytest.fixture(scope="module")
def qwen3():
    tokenizers = pytest.importorskip("tokenizers")
    del tokenizers
    from agentspec_sim.trace.tokenizer import load_tokenizer

    return load_tokenizer("qwen3")


def test_token_bytes_round_trip(qwen3) -> None:
    table = qwen3.token_bytes()
    assert table is qwen3.token_bytes()  # cached
    assert len(table) == qwen3.vocab_size
    text = "Hi 你好 — `x` ```bash\nls -la\n```<|im_end|>"
    ids = qwen3.encode_batch([text])[0]
    assert b"".join(table[i] for i in ids) == text.encode()
    assert table[qwen3.eot_id] == b"<|im_end|>"
    assert "你好".encode() in [table[i] for i in ids]  # CJK inside a byte-level token: raw UTF-8
    # some tokens hold part of a multi-byte character: raw bytes, not valid UTF-8 on their own
    partial = [b for b in table if b and b[0] >= 0x80]
    with pytest.raises(UnicodeDecodeError):
        for b in partial:
            b.decode("utf-8")


def test_token_bytes_of_reads_the_map_back_from_the_disk_cache(qwen3, tmp_path, monkeypatch) -> None:
    # What drafters use instead of loading the tokenizer: the same map, made once, then read from the disk
    # cache (a damaged entry is made again); equal to `token_bytes()` byte for byte, empty tokens included.
    from agentspec_sim.drafters.common.structure import token_bytes_of

    monkeypatch.setenv("AGENTSPEC_SIM_CACHE", str(tmp_path))
    want = qwen3.token_bytes()
    for attempt in ("made", "read", "damaged"):
        token_bytes_of.cache_clear()
        if attempt == "damaged":
            (entry,) = (tmp_path / "token-bytes").glob("*.npz")
            entry.write_bytes(entry.read_bytes()[:1000])
        got = token_bytes_of("qwen3")
        assert got == want, attempt
        assert got is token_bytes_of("qwen3")  # one list per process
        assert len(list((tmp_path / "token-bytes").glob("*.npz"))) == 1
    token_bytes_of.cache_clear()


def test_qwen3_markdown_bash_fence(qwen3) -> None:
    text = (
        "To list the files, run:\n\n```bash\nls -la /tmp\necho \"done\"\n```\n\n"
        "Then check the output.<|im_end|>"
    )
    ids = qwen3.encode_batch([text])[0]
    table = qwen3.token_bytes()
    structure = ((("```bash", "```"), ("```python", "```")),)
    index = segment(ids, table, structure)
    labels = block_labels(structure)
    got = [labels[i] for i in index]
    pieces = [table[i] for i in ids]
    # byte offset where each token starts
    starts = np.concatenate([[0], np.cumsum([len(p) for p in pieces])[:-1]])
    raw = text.encode()
    body_start = raw.index(b"```bash") + len(b"```bash")  # the block opens after the opener
    body_end = raw.index(b"```", body_start) + 3  # Qwen3 splits this closer as "``" + "`\n\n"
    assert b"``" in pieces  # so the test covers a closer split across tokens
    for s, lab, piece in zip(starts, got, pieces, strict=True):
        inside = body_start <= s < body_end  # tokens starting before the closer completes
        assert lab == ((0, 0) if inside else ROOT), (piece, s, lab)
    assert (0, 0) in got and got[-1] == ROOT
    # the incremental automaton agrees, token by token
    pda = StructureAutomaton(structure)
    for i, lab in zip(ids, got, strict=True):
        assert pda.block == lab
        pda.feed(table[i])


def test_token_bytes_sentencepiece_and_other_vocabs() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from agentspec_sim.trace.tokenizer import TraceTokenizer

    bpe = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={"<0x0A>": 0, "\u2581hi": 1, "a": 2, "<0xE4>": 3}, merges=[], byte_fallback=True)
    )
    bpe.decoder = tokenizers.decoders.Sequence(
        [tokenizers.decoders.Replace("\u2581", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()]
    )
    bpe.add_special_tokens([tokenizers.AddedToken("<eot>", special=True)])
    sp = TraceTokenizer(name="sp", backend=bpe, chat_template=None, eot_text="<eot>")
    assert sp.token_bytes() == [b"\n", b" hi", b"a", b"\xe4", b"<eot>"]
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab={"hello": 0, "world": 1}, unk_token="hello"))
    assert TraceTokenizer(name="w", backend=words, chat_template=None, eot_text=None).token_bytes() == [
        b"hello", b"world",
    ]


def test_invalid_utf8_nul_bytes_and_deep_nesting() -> None:
    """Bytes that are not UTF-8 (a lone 0xff, NUL, a truncated multibyte char) are text; 5,000 nested
    tool calls open and close without recursion, ending at ROOT with nothing pending."""
    structure = ((TOOL,),)
    pda = StructureAutomaton(structure)
    assert pda.feed(b"\xff\x00\xe2\x82") == ROOT
    assert pda.feed(b"<tool_call>\xff") == (0, 0)
    for _ in range(5_000):
        pda.feed(b"<tool_call>")
    assert len(pda.stack) == 5_001
    for _ in range(5_001):
        pda.feed(b"\x00</tool_call>")
    assert pda.block == ROOT and not pda.stack and not pda.pending
    ids = np.array([0, 1, 2, 1, 0], dtype=np.int32)
    assert segment(ids, [b"\xff", b"<tool_call>", b"</tool_call>"], structure).tolist() == [0, 0, 1, 0, 1]
