"""Packing convention: document boundaries via position ids, -100 labels across documents."""

import numpy as np
import pytest
import torch

from dsa_train.data.packing import (IGNORE_INDEX, concat_documents, cu_seqlens_from_position_ids,
                                    doc_starts_from_position_ids, num_rows, pack_documents,
                                    position_ids_from_cu_seqlens)

BOS, EOS = 0, 1


def random_documents(seed: int, n_docs: int, max_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 4096, size=int(rng.integers(1, max_len))).tolist()
            for _ in range(n_docs)]


def reference_rows(docs, seq_len, add_bos, add_eos):
    """Naive per-token reference of the convention in packing.py."""
    stream, doc_id = [], []
    for d, doc in enumerate(docs):
        framed = ([BOS] if add_bos else []) + doc + ([EOS] if add_eos else [])
        stream += framed
        doc_id += [d] * len(framed)
    rows = []
    for r in range((len(stream) - 1) // seq_len):
        s = r * seq_len
        inputs, labels, positions = [], [], []
        for t in range(seq_len):
            inputs.append(stream[s + t])
            labels.append(stream[s + t + 1] if doc_id[s + t + 1] == doc_id[s + t] else IGNORE_INDEX)
            new_segment = t == 0 or doc_id[s + t] != doc_id[s + t - 1]
            positions.append(0 if new_segment else positions[-1] + 1)
        rows.append((inputs, labels, positions))
    return rows


@pytest.mark.parametrize("add_bos,add_eos", [(True, True), (False, True), (True, False),
                                             (False, False)])
@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_packing_matches_naive_reference(add_bos, add_eos, seq_len):
    docs = random_documents(seed=seq_len, n_docs=40, max_len=50)
    rows = pack_documents(docs, seq_len, BOS, EOS, add_bos, add_eos)
    expected = reference_rows(docs, seq_len, add_bos, add_eos)
    assert len(rows) == len(expected) > 0
    for row, (inputs, labels, positions) in zip(rows, expected):
        for key in ("input_ids", "labels", "position_ids"):
            assert row[key].dtype == torch.int64 and row[key].shape == (seq_len,)
        assert row["input_ids"].tolist() == inputs
        assert row["labels"].tolist() == labels
        assert row["position_ids"].tolist() == positions


def test_position_ids_restart_exactly_at_document_starts():
    docs = [[5] * 10, [6] * 3, [7] * 20, [8] * 2, [9] * 30]
    seq_len = 16
    rows = pack_documents(docs, seq_len, BOS, EOS)
    stream, doc_offsets = concat_documents(docs, BOS, EOS)
    for r, row in enumerate(rows):
        pos = row["position_ids"]
        starts = {0} | {int(o) - r * seq_len for o in doc_offsets[:-1]
                        if r * seq_len <= o < (r + 1) * seq_len}
        detected = {0} | {t for t in range(1, seq_len) if pos[t] != pos[t - 1] + 1}
        assert detected == starts
        # Every document start in this row is a BOS token; its previous token is EOS with label -100.
        for t in starts - {0}:
            assert row["input_ids"][t] == BOS
            assert row["input_ids"][t - 1] == EOS and row["labels"][t - 1] == IGNORE_INDEX
        # Labels are -100 exactly at the last token of a document.
        ignored = {t for t in range(seq_len) if row["labels"][t] == IGNORE_INDEX}
        assert ignored == {t for t in range(seq_len) if stream[r * seq_len + t] == EOS}


def test_document_crossing_row_boundary_continues_from_position_zero():
    docs = [list(range(10, 40))]  # one 32-token framed document, rows of 8
    rows = pack_documents(docs, 8, BOS, EOS)
    assert len(rows) == num_rows(32, 8) == 3
    assert rows[1]["input_ids"].tolist() == list(range(17, 25))
    assert rows[1]["position_ids"].tolist() == list(range(8))
    assert rows[0]["labels"][-1] == 17  # label of a row's last token is the next row's first
    assert (rows[1]["labels"] != IGNORE_INDEX).all()


def test_doc_starts_from_position_ids():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1],
                                 [5, 6, 7, 8, 0, 1, 2, 3]])  # row 2 starts mid-document
    expected = torch.tensor([[0, 0, 0, 3, 3, 5, 6, 6],
                             [0, 0, 0, 0, 4, 4, 4, 4]])
    assert torch.equal(doc_starts_from_position_ids(position_ids), expected)
    assert torch.equal(doc_starts_from_position_ids(position_ids[0]), expected[0])


def test_doc_starts_agree_with_packed_rows():
    docs = random_documents(seed=3, n_docs=30, max_len=20)
    rows = pack_documents(docs, 32, BOS, EOS)
    position_ids = torch.stack([r["position_ids"] for r in rows])  # [B, T]
    starts = doc_starts_from_position_ids(position_ids)
    t = torch.arange(32)
    assert torch.equal(t - starts, position_ids)  # contiguous positions within each segment


def test_cu_seqlens_roundtrip():
    cu_seqlens = torch.tensor([0, 3, 4, 10, 16], dtype=torch.int32)
    position_ids = position_ids_from_cu_seqlens(cu_seqlens, 16)
    assert position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    assert torch.equal(cu_seqlens_from_position_ids(position_ids), cu_seqlens)
    # Padding past the last document continues its positions.
    assert position_ids_from_cu_seqlens(torch.tensor([0, 2]), 4).tolist() == [0, 1, 2, 3]
