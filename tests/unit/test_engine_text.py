"""Incremental detokenisation: the same deltas as a full decode at every token, for the byte
tokenizer and for Hugging Face tokenizers of the three common decoder families."""

from __future__ import annotations

import pathlib
import random
from collections.abc import Sequence

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from moe_runtime.engine import text
from moe_runtime.model import tokenizer
from tests.support import text_oracle

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld: café, naïve, señor, Ærøskøbing.",
    "price 5€ or 7£; emoji 😀🚀 and 中文字符 with 日本語 and 한국어.",
    "don't stop, it's fine! isn't it? we've seen they're here.",
]


def _byte_level_bpe(path: pathlib.Path) -> tokenizer.HFTokenizer:
    """GPT-2 / Llama-3 style: byte-level BPE, ByteLevel decoder (multi-byte characters split
    over tokens decode to U+FFFD until complete)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(path / "bytelevel.json"))
    return tokenizer.HFTokenizer(path / "bytelevel.json")


def _sentencepiece_byte_fallback(path: pathlib.Path) -> tokenizer.HFTokenizer:
    """Llama-2 / Mistral / Mixtral style: "▁" word pieces, <0xNN> byte-fallback tokens, and a
    decoder that strips the leading space of the first token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    pieces = ["▁", "▁hello", "▁world", "▁the", "▁a", "h", "e", "l", "o", ",", ".", "!", "é"]
    pieces += ["中", "文", "▁don", "'", "t", "▁it", "s", "€", "▁▁", "ll", "▁é"]
    vocab.update({p: len(vocab) + i for i, p in enumerate(pieces)})
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "sentencepiece.json"))
    return tokenizer.HFTokenizer(path / "sentencepiece.json")


def _wordpiece_cleanup(path: pathlib.Path) -> tokenizer.HFTokenizer:
    """BERT style: "##" continuations, and the clean-up that turns " ." into "."."""
    words = ["[UNK]", "[CLS]", "[SEP]", "hello", "world", "do", "not", "it", "'", "s", "."]
    words += [",", "!", "?", "n", "##t", "##s", "##lo", "he", "##l", "'s", "re", "ve", "m"]
    tok = tokenizers.Tokenizer(
        models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    tok.save(str(path / "wordpiece.json"))
    return tokenizer.HFTokenizer(path / "wordpiece.json")


BUILDERS = {
    "byte": lambda _path: tokenizer.ByteTokenizer(),
    "hf-bytelevel-bpe": _byte_level_bpe,
    "hf-sentencepiece-byte-fallback": _sentencepiece_byte_fallback,
    "hf-wordpiece-cleanup": _wordpiece_cleanup,
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def _run(decoder: text.Decoder, ids: list[int], stop: Sequence[str]) -> list[str]:
    inc = text.IncrementalText(decoder, stop=stop)
    out = [inc.append(i) for i in ids]
    return [*out, inc.flush()]


def _oracle(decoder: text.Decoder, ids: list[int], stop: Sequence[str]) -> list[str]:
    ref = text_oracle.FullDecodeText(decoder, stop=stop)
    out = [ref.append(i) for i in ids]
    return [*out, ref.flush()]


# --------------------------------------------------------------------------- byte tokenizer


@pytest.mark.parametrize(
    ("chars", "deltas"),
    [
        pytest.param("é", ["", "é"], id="2-byte"),
        pytest.param("a€b", ["a", "", "", "€", "b"], id="3-byte-between-ascii"),
        pytest.param("😀", ["", "", "", "😀"], id="4-byte"),
        pytest.param("中文", ["", "", "中", "", "", "文"], id="two-3-byte-in-a-row"),
    ],
)
def test_multi_byte_character_split_over_tokens_comes_out_whole(chars: str, deltas: list[str]):
    byte_tok = tokenizer.ByteTokenizer()
    ids = byte_tok.encode(chars, add_special_tokens=False)
    inc = text.IncrementalText(byte_tok)
    assert [inc.append(i) for i in ids] == deltas
    assert inc.text == chars


def test_invalid_bytes_are_released_as_replacement_once_followed():
    byte_tok = tokenizer.ByteTokenizer()
    ids = [0x61, 0xE2, 0x82, 0x62, 0xFF, 0x63]  # "a", truncated "€", "b", stray 0xFF, "c"
    assert _run(byte_tok, ids, ()) == _oracle(byte_tok, ids, ())
    assert "".join(_run(byte_tok, ids, ())) == byte_tok.decode(ids) == "a\ufffdb\ufffdc"


@pytest.mark.parametrize(
    ("answer", "stop", "want"),
    [
        pytest.param("say STOP now", ("STOP",), "say ", id="ascii-stop-over-4-tokens"),
        pytest.param("prix: 5€ fin", ("€ f",), "prix: 5", id="stop-starts-with-split-char"),
        pytest.param("ok 😀😀 done", ("😀 d",), "ok 😀", id="stop-after-split-emoji"),
        pytest.param("no stop here", ("STOP", "xyz"), "no stop here", id="no-hit"),
        pytest.param("abcabd", ("abd",), "abc", id="partial-match-then-hit"),
    ],
)
def test_stop_string_spanning_tokens(answer: str, stop: tuple[str, ...], want: str):
    byte_tok = tokenizer.ByteTokenizer()
    ids = byte_tok.encode(answer, add_special_tokens=False)
    inc = text.IncrementalText(byte_tok, stop=stop)
    deltas = []
    for i in ids:
        deltas.append(inc.append(i))
        assert not any(s in "".join(deltas) for s in stop)
        if inc.stopped:
            break
    deltas.append(inc.flush())
    assert "".join(deltas) == want
    assert inc.stopped == (want != answer)
    assert deltas == _oracle(byte_tok, ids, stop)[: len(deltas) - 1] + [deltas[-1]]


def test_eos_skip_token_is_left_out_of_the_text():
    byte_tok = tokenizer.ByteTokenizer()
    inc = text.IncrementalText(byte_tok, skip_token_id=tokenizer.BYTE_EOS_ID)
    out = [inc.append(i) for i in [0x68, tokenizer.BYTE_EOS_ID, 0x69]]
    assert out == ["h", "", "i"]


def test_byte_fallback_run_made_invalid_by_a_later_byte_matches_full_decode(tmp_path):
    """<0x41> <0x20> <0xD2>: "A " until 0xD2 makes the run invalid UTF-8 and the full decode
    turns all three bytes into U+FFFD; a window of one token (text "" once the decoder strips
    its leading space) would not see the change."""
    tok = _sentencepiece_byte_fallback(tmp_path)
    ids = [3 + 0x41, 3 + 0x20, 3 + 0xD2]
    assert tok.decode(ids) == "\ufffd" * 3
    assert _run(tok, ids, ()) == _oracle(tok, ids, ()) == ["A", " ", "", "\ufffd"]


# ------------------------------------------------------------------- every tokenizer, random


def _random_ids(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


@pytest.mark.parametrize("seed", range(4))
def test_deltas_equal_full_decode_on_random_tokens(tok: tokenizer.Tokenizer, seed: int):
    rng = random.Random(seed)
    for _ in range(30):
        ids = _random_ids(rng, tok.vocab_size, rng.randrange(1, 60))
        deltas = _run(tok, ids, ())
        assert deltas == _oracle(tok, ids, ()), ids
        if not isinstance(tok, tokenizer.HFTokenizer) or "bytelevel" in tok.path:
            # Byte-level UTF-8 never rewrites released text, so the deltas add up to the
            # final decode. Byte fallback can: bytes that decoded to "é" turn into three
            # U+FFFD when a stray byte follows them (today's deltas, matched above, too).
            assert "".join(deltas) == tok.decode(ids), ids


@pytest.mark.parametrize("seed", range(4))
def test_deltas_equal_full_decode_on_encoded_text_with_stops(tok: tokenizer.Tokenizer, seed: int):
    """Real text (multi-byte characters split over byte tokens) with stop strings taken from it."""
    rng = random.Random(seed)
    for line in CORPUS:
        ids = tok.encode(line, add_special_tokens=False)
        decoded = tok.decode(ids)
        start = rng.randrange(max(1, len(decoded) - 3))
        stops = (decoded[start : start + rng.randrange(1, 4)], "never-there")
        assert _run(tok, ids, stops) == _oracle(tok, ids, stops), (line, stops)


@pytest.mark.parametrize("seed", range(3))
def test_deltas_equal_full_decode_on_mixed_text_and_random_tokens(
    tok: tokenizer.Tokenizer, seed: int
):
    """Encoded text interleaved with random ids (specials, stray bytes) and random stops."""
    rng = random.Random(100 + seed)
    for _ in range(20):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 5)):
            ids += tok.encode(rng.choice(CORPUS)[: rng.randrange(1, 30)], add_special_tokens=False)
            ids += _random_ids(rng, tok.vocab_size, rng.randrange(0, 4))
        full = tok.decode(ids)
        stops = tuple(
            full[i : i + rng.randrange(1, 5)] for i in rng.sample(range(len(full) + 1), 2)
        )
        assert _run(tok, ids, stops) == _oracle(tok, ids, stops), (ids, stops)
