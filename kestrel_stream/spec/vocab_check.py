"""A draft must speak the target's tokens: the vocabularies are compared once, where the draft is loaded."""
from __future__ import annotations

from kestrel_stream.errors import KestrelError

SAMPLED_TOKENS = 4096          # token strings compared, spread over the vocabulary (and every special one)


class DraftMismatchError(KestrelError, ValueError):
    """A draft model whose tokenizer differs from the target's; the message names both and the first difference."""
    code = "draft_mismatch"


def first_difference(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> str | None:
    """What first differs between the two models' token sets, or None where they agree: the tokenizers'
    vocabulary sizes, end-of-generation and special ids, BOS/EOS, then a sample of token strings."""
    if (target_tok is None) != (draft_tok is None):
        which = "the target" if target_tok is None else "the draft"
        return f"{which} has no tokenizer and the other has one"
    if target_tok is None:
        if target_vocab != draft_vocab:
            return f"vocabulary of {target_vocab} vs {draft_vocab} tokens (neither model has a tokenizer)"
        return None
    checks = [("tokenizer vocabulary size", target_tok.vocab_size, draft_tok.vocab_size),
              ("end-of-generation ids", sorted(target_tok.eos_ids), sorted(draft_tok.eos_ids)),
              ("special token ids", sorted(target_tok.special_ids), sorted(draft_tok.special_ids)),
              ("BOS token", target_tok.bos_token, draft_tok.bos_token),
              ("EOS token", target_tok.eos_token, draft_tok.eos_token)]
    for what, mine, theirs in checks:
        if mine != theirs:
            return f"{what}: {_short(mine)} vs {_short(theirs)}"
    size = target_tok.vocab_size
    ids = sorted(set(range(0, size, max(1, size // SAMPLED_TOKENS))) | set(target_tok.special_ids)
                 | set(target_tok.eos_ids))
    for i in ids:
        mine, theirs = target_tok.token_text(i), draft_tok.token_text(i)
        if mine != theirs:
            return f"token {i} is {mine!r} vs {theirs!r}"
    return None


def check_same_vocabulary(target_tok, draft_tok, target_vocab: int, draft_vocab: int, target_path,
                          draft_path) -> None:
    """DraftMismatchError unless the draft's tokenizer (None: the model has none) agrees with the target's."""
    diff = first_difference(target_tok, draft_tok, target_vocab, draft_vocab)
    if diff is not None:
        raise DraftMismatchError(f"draft model {draft_path} does not share the tokenizer of {target_path}: "
                                 f"{diff} (target vs draft); a draft must come from the target's family")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
