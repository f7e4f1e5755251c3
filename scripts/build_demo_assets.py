#!/usr/bin/env python
"""Rebuild the bundled demo corpus and tokenizer (``dsa_train/assets/{corpus,tokenizer}``).

Everything here is public domain and comes from ordinary package registries, pinned by
version and SHA-256, so the output is byte-for-byte reproducible:

* King James Bible (1611; public domain) from the Debian packages ``bible-kjv`` and
  ``bible-kjv-text`` 4.38 (the ``bible`` program decodes its compressed text).
* "Alice's Adventures in Wonderland" (Lewis Carroll, 1865), "As You Like It" (Shakespeare,
  1623 folio) and "Paradise Lost" (Milton, 1667) as shipped in the Canterbury compression
  corpus (``alice29.txt``, ``asyoulik.txt``, ``plrabn12.txt``) inside the PyPI source
  distribution ``brotli==1.2.1`` (``tests/testdata/``). Project Gutenberg headers are removed.

One document per chapter / scene / book, so document boundaries are real and document lengths
vary from a few hundred bytes (Psalm 117) to ~40 KB (a book of Paradise Lost).

Then a byte-level BPE tokenizer (vocab 4096, ``<|bos|>`` = 0, ``<|eos|>`` = 1,
``<|pad|>`` = 2) is trained on the corpus with the ``tokenizers`` library.

Usage::

    python scripts/build_demo_assets.py                   # downloads into /tmp, writes assets
    python scripts/build_demo_assets.py --inputs DIR      # DIR already holds the .deb / .tar.gz

Needs ``apt-get`` (Debian/Ubuntu, amd64: the ``bible`` decoder is a compiled program), ``pip``,
``dpkg-deb`` and ``tar``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS_DIR = REPO_ROOT / "dsa_train" / "assets" / "corpus"
TOKENIZER_DIR = REPO_ROOT / "dsa_train" / "assets" / "tokenizer"
CORPUS_FILE = "demo_corpus.jsonl"

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2

DEBS = {
    "bible-kjv_4.38_amd64.deb": "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d",
    "bible-kjv-text_4.38_all.deb": "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a",
}
BROTLI_SDIST = ("brotli-1.2.1.tar.gz", "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de")
# SHA-256 of the decoded / extracted texts, checked before use.
TEXT_SHA256 = {
    "kjv.txt": "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d",
    "alice29.txt": "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0",
    "asyoulik.txt": "eaa3526fe53859f34ecdf255712f9ecf0b2c903451d4755b2edaa2e2599cb0fc",
    "plrabn12.txt": "07e2e0b461af78c7c647cb53dab39de560198e16f799b4516eccf0fbd69f764c",
}

# The KJV books kept (abbreviation used by the `bible` program -> full name); ~1.4 MB of text.
KJV_BOOKS = {
    "Ge": "Genesis", "Ruth": "Ruth", "Est": "Esther", "Job": "Job", "Psa": "Psalms",
    "Prv": "Proverbs", "Eccl": "Ecclesiastes", "SSol": "Song of Solomon", "Jonah": "Jonah",
    "Mat": "Matthew", "Mark": "Mark", "John": "John", "Rom": "Romans", "Jas": "James",
    "Rev": "Revelation",
}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_sha256(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise SystemExit(f"{path}: SHA-256 {actual} != pinned {expected}; the input changed.")


# ----------------------------------------------------------------------------------------
# inputs


def fetch_inputs(inputs_dir: Path) -> None:
    """Download the pinned .deb files and the brotli sdist into ``inputs_dir`` if absent."""
    inputs_dir.mkdir(parents=True, exist_ok=True)
    missing_debs = [name for name in DEBS if not (inputs_dir / name).exists()]
    if missing_debs:
        subprocess.run(["apt-get", "download", "bible-kjv=4.38", "bible-kjv-text=4.38"],
                       cwd=inputs_dir, check=True)
    if not (inputs_dir / BROTLI_SDIST[0]).exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "brotli==1.2.1", "--no-binary",
                        ":all:", "--no-deps", "-d", str(inputs_dir)], check=True)
    for name, digest in DEBS.items():
        check_sha256(inputs_dir / name, digest)
    check_sha256(inputs_dir / BROTLI_SDIST[0], BROTLI_SDIST[1])


def extract_texts(inputs_dir: Path) -> dict[str, Path]:
    """Decode the KJV with the packaged ``bible`` program; extract the Canterbury texts."""
    root = inputs_dir / "extracted"
    for name in DEBS:
        subprocess.run(["dpkg-deb", "-x", str(inputs_dir / name), str(root)], check=True)
    kjv = inputs_dir / "kjv.txt"
    with open(kjv, "wb") as out:
        # `-f` turns pretty-printing off: one "Abbr<chapter>:<verse> text" line per verse.
        subprocess.run([str(root / "usr/bin/bible"), "-f", "Gen1:1-Rev22:21"],
                       cwd=root / "usr/lib", stdout=out, check=True)
    paths = {"kjv.txt": kjv}
    with tarfile.open(inputs_dir / BROTLI_SDIST[0]) as tar:
        for name in ("alice29.txt", "asyoulik.txt", "plrabn12.txt"):
            member = tar.getmember(f"brotli-1.2.1/tests/testdata/{name}")
            (inputs_dir / name).write_bytes(tar.extractfile(member).read())
            paths[name] = inputs_dir / name
    for name, path in paths.items():
        check_sha256(path, TEXT_SHA256[name])
    return paths


# ----------------------------------------------------------------------------------------
# documents


def reflow_paragraphs(text: str) -> str:
    """Join hard-wrapped prose lines into one line per paragraph (blank line between)."""
    paragraphs = [" ".join(line.strip() for line in block.splitlines() if line.strip())
                  for block in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


def kjv_documents(path: Path) -> list[dict]:
    """One document per chapter: "Genesis 1" heading, then one verse per line (no numbers)."""
    verse_line = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in path.read_text(encoding="ascii").splitlines():
        match = verse_line.match(line)
        if match is None:
            raise SystemExit(f"unexpected KJV line: {line!r}")
        book, chapter, _verse, text = match.groups()
        if book in KJV_BOOKS:
            chapters.setdefault((book, int(chapter)), []).append(text.strip())
    return [{"text": f"{KJV_BOOKS[book]} {chapter}\n\n" + "\n".join(verses),
             "source": "kjv", "title": f"{KJV_BOOKS[book]} {chapter}"}
            for (book, chapter), verses in chapters.items()]


def alice_documents(path: Path) -> list[dict]:
    """One document per chapter, paragraphs reflowed."""
    text = path.read_text(encoding="ascii")
    parts = re.split(r"^\s*(CHAPTER [IVXL]+)\s*$", text, flags=re.M)
    docs = []
    for heading, body in zip(parts[1::2], parts[2::2]):
        body = body.replace("THE END", "").strip()
        title, _, rest = body.partition("\n\n")
        docs.append({"text": f"{heading}. {title.strip()}\n\n{reflow_paragraphs(rest)}",
                     "source": "alice", "title": f"Alice's Adventures in Wonderland, {heading}"})
    return docs


def as_you_like_it_documents(path: Path) -> list[dict]:
    """One document per scene; speaker tabs become "NAME: line", indentation removed."""
    text = path.read_text(encoding="ascii")
    parts = re.split(r"^(ACT [IV]+)\s*\n\s*\n\s*\n\s*\n(SCENE [IVX]+)\t(.*)$", text, flags=re.M)
    docs = []
    for act, scene, place, body in zip(parts[1::4], parts[2::4], parts[3::4], parts[4::4]):
        lines = []
        for line in body.splitlines():
            line = line.rstrip()
            if line.strip() == "AS YOU LIKE IT":  # running page header of the source file
                continue
            if "\t" in line and not line.startswith("\t"):
                speaker, _, speech = line.partition("\t")
                line = f"{speaker.strip()}: {speech.strip()}"
            lines.append(line.strip())
        body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
        docs.append({"text": f"AS YOU LIKE IT. {act}, {scene}. {place.strip()}\n\n{body}",
                     "source": "as_you_like_it", "title": f"As You Like It, {act}, {scene}"})
    return docs


def paradise_lost_documents(path: Path) -> list[dict]:
    """One document per book of the poem; the Project Gutenberg preface is dropped."""
    text = path.read_text(encoding="ascii")
    parts = re.split(r"^(Book [IVX]+)\s*$", text, flags=re.M)
    docs = []
    for heading, body in zip(parts[1::2], parts[2::2]):
        body = body.replace("[The End]", "")
        body = "\n".join(line.rstrip() for line in body.splitlines())
        body = re.sub(r"\n{3,}", "\n\n", body).strip()
        docs.append({"text": f"Paradise Lost, {heading}\n\n{body}",
                     "source": "paradise_lost", "title": f"Paradise Lost, {heading}"})
    return docs


def build_corpus(texts: dict[str, Path]) -> list[dict]:
    docs = (kjv_documents(texts["kjv.txt"]) + alice_documents(texts["alice29.txt"])
            + as_you_like_it_documents(texts["asyoulik.txt"])
            + paradise_lost_documents(texts["plrabn12.txt"]))
    assert all(d["text"].strip() for d in docs)
    return docs


# ----------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(docs: list[dict]):
    """Byte-level BPE, vocab 4096, special tokens <|bos|>=0, <|eos|>=1, <|pad|>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((d["text"] for d in docs), trainer=trainer, length=len(docs))
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, token
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    return tokenizer


def write_assets(docs: list[dict], tokenizer) -> None:
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    with open(CORPUS_DIR / CORPUS_FILE, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(TOKENIZER_DIR / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": 1_000_000,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (TOKENIZER_DIR / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=Path, default=Path("/tmp/dsa_train_demo_assets"),
                        help="folder for the downloaded packages (reused when present)")
    args = parser.parse_args(argv)
    # The BPE trainer is deterministic for a fixed input order; pin its thread pool anyway.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    fetch_inputs(args.inputs)
    texts = extract_texts(args.inputs)
    docs = build_corpus(texts)
    tokenizer = train_tokenizer(docs)
    write_assets(docs, tokenizer)
    n_bytes = (CORPUS_DIR / CORPUS_FILE).stat().st_size
    print(f"corpus: {len(docs)} documents, {n_bytes / 1e6:.2f} MB -> {CORPUS_DIR / CORPUS_FILE}")
    print(f"tokenizer: vocab {tokenizer.get_vocab_size()} -> {TOKENIZER_DIR / 'tokenizer.json'}")
    for path in sorted(CORPUS_DIR.glob("*.jsonl")) + sorted(TOKENIZER_DIR.glob("*.json")):
        print(f"  sha256 {sha256_file(path)}  {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
