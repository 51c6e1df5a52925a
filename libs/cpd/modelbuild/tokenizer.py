"""A byte-level BPE tokenizer trained deterministically on the committed corpus.

The trainer is our own ~60 lines so the merges (and so ``tokenizer.json``) are the same
bytes on every machine: pair ties break by the pair itself, never by hash order.
"""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CORPUS = Path(__file__).with_name("corpus.txt")
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIALS = (BOS, EOS, PAD)


def _byte_alphabet() -> list[str]:
    # GPT-2's bytes_to_unicode order, as the ByteLevel pre-tokenizer uses.
    return sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_value)


def _byte_value(ch: str) -> int:
    # Printable bytes map to themselves; the rest were shifted to 256 + n in order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def train_bpe(text: str, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE merges for ``text`` up to ``vocab_size`` entries (specials excluded)."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = collections.Counter(w for w, _ in pre.pre_tokenize_str(text))
    seqs = [list(w) for w in words]
    freqs = list(words.values())
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    pair_counts: collections.Counter[tuple[str, str]] = collections.Counter()
    where: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for i, seq in enumerate(seqs):
        for pair in itertools.pairwise(seq):
            pair_counts[pair] += freqs[i]
            where[pair].add(i)
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size and pair_counts:
        best = min(pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        pair, count = best
        if count < 2:
            break
        merges.append(pair)
        merged = pair[0] + pair[1]
        vocab[merged] = len(vocab)
        for i in sorted(where.pop(pair, ())):
            seq, f = seqs[i], freqs[i]
            for p in itertools.pairwise(seq):
                pair_counts[p] -= f
                if pair_counts[p] <= 0:
                    del pair_counts[p]
            out, j = [], 0
            while j < len(seq):
                if j + 1 < len(seq) and seq[j] == pair[0] and seq[j + 1] == pair[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(seq[j])
                    j += 1
            seqs[i] = out
            for p in itertools.pairwise(out):
                pair_counts[p] += f
                where[p].add(i)
        pair_counts.pop(pair, None)
    return vocab, merges


def build_tokenizer(vocab_size: int) -> tuple[str, dict[str, int]]:
    """``tokenizer.json`` text and the special-token ids."""
    vocab, merges = train_bpe(CORPUS.read_text(encoding="utf-8"), vocab_size - len(SPECIALS))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    specials = {s: tok.token_to_id(s) for s in SPECIALS}
    # Round-trip through json with sorted keys: byte-identical output on every machine.
    text = json.dumps(json.loads(tok.to_str()), sort_keys=True, ensure_ascii=False, indent=1)
    return text + "\n", specials
