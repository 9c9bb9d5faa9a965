"""Choices scored by log-likelihood (`lm.inference.choices`): equal to transformers' own computation on small
GPT-2 and Llama checkpoints made offline (400-id tokenizers trained on Macbeth: the items' text comes out in many
short tokens, so contexts are long and BoolQ's are cut), the same accuracies, chance for random weights, and the
same sums whichever way the items are split over ranks."""

import json
import math
import shutil

import pytest
import torch

from lm.checkpoint.loading import load_for_inference
from lm.data.tasks import TASKS, Item, TaskScore, load_items
from lm.inference.choices import encode_items, loglikelihoods, model_logits_at, score_items
from lm.models.gpt.config import GPTConfig
from lm.models.registry import family_of
from lm.tokenizer import model_tokenizer

CPU = torch.device("cpu")
ITEMS = 200
"""Of each task, for the comparison with transformers"""
POSITIONS = 256
"""The checkpoints' context: BoolQ's passages run past it, so the left cut is exercised too"""


def hf_checkpoint(kind: str, out, tokenizer_json):
    """A small random GPT-2 or Llama with a 400-id tokenizer.json beside it (a 50k head would make the
    comparison a minute of log-softmax), saved."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=400, n_layer=2, n_head=2, n_embd=32, n_positions=POSITIONS,
                                           bos_token_id=0, eos_token_id=0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=POSITIONS, bos_token_id=0, eos_token_id=1))
    shutil.copy(tokenizer_json, out / "tokenizer.json")
    with torch.no_grad():  # a random model scores near-ties everywhere; spread its logits so choices differ
        model.get_output_embeddings().weight.mul_(30)
    model.save_pretrained(out)
    return model.eval()


def transformers_loglikelihoods(model, pairs, batch_size: int = 32) -> list[float]:
    """Each pair's continuation log-probability from transformers' modules: the base model's last hidden states
    of right-padded batches (causal: the padding after a pair changes none of its positions), its output
    embedding at the continuation's positions, a log-softmax. The batches take the pairs by length, so that
    little of them is padding (a third of the positions in the items' order)."""
    out = [0.0] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            batch = order[start:start + batch_size]
            windows = [(pairs[i][0] + pairs[i][1])[-(POSITIONS + 1):] for i in batch]
            counts = [min(len(pairs[i][1]), len(w) - 1) for i, w in zip(batch, windows)]
            x = torch.zeros(len(windows), max(map(len, windows)) - 1, dtype=torch.long)
            for row, ids in enumerate(windows):
                x[row, :len(ids) - 1] = torch.tensor(ids[:-1])
            h = model.base_model(x).last_hidden_state  # (B, T, C)
            for row, (i, ids, n) in enumerate(zip(batch, windows, counts)):
                logp = model.get_output_embeddings()(h[row, len(ids) - 1 - n:len(ids) - 1]).float().log_softmax(-1)
                out[i] = logp[torch.arange(n), torch.tensor(ids[-n:])].sum().item()  # (n, V) -> the ids' sum
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_loglikelihoods_and_accuracies_equal_transformers(kind, tokenizer_jsons, tmp_path):
    # GPT-2's tokenizer has only an end-of-text token, Llama's a BOS that leads every context
    hf = hf_checkpoint(kind, tmp_path, tokenizer_jsons["eot" if kind == "gpt2" else "bos"])
    model, cfg, _ = load_for_inference(tmp_path, CPU)
    tokenizer = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    assert (kind == "llama") == (getattr(tokenizer, "bos_token", None) == 0)
    for name in TASKS:
        items = load_items(name, ITEMS)
        pairs = encode_items(tokenizer, items)
        if kind == "llama":
            assert all(context[0] == 0 for item in pairs for context, _ in item)
        flat = [p for item in pairs for p in item]
        ours = loglikelihoods(model_logits_at(model, model), flat, cfg.model.block_size, tokenizer.n_vocab, 32, CPU)
        theirs = transformers_loglikelihoods(hf, flat)
        worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(ours, theirs))
        assert worst < 1e-4, (name, worst)
        ours_score, their_score, at = TaskScore(), TaskScore(), 0
        for item, item_pairs in zip(items, pairs):
            n = len(item_pairs)
            ours_score.add(item, ours[at:at + n])
            their_score.add(item, theirs[at:at + n])
            at += n
        assert ours_score == their_score, name


@pytest.mark.slow
def test_random_weights_score_chance_on_hellaswag(tokenizer_jsons):
    # the 400-id tokenizer: a 50k head would make this 60,000 continuation positions x 50k logits
    tokenizer = model_tokenizer(str(tokenizer_jsons["eot"]), 400)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=256, vocab_size=400)
    model = family_of(cfg).build(cfg)
    model.init_weights()
    model.eval()
    items = load_items("hellaswag", 1000)
    score = score_items(model_logits_at(model, model), encode_items(tokenizer, items), items, cfg.block_size,
                        tokenizer.n_vocab, 32, CPU)
    assert score.items == 1000
    assert abs(score.metrics()["acc"] - 0.25) <= 0.03, score.metrics()


def test_every_split_over_ranks_adds_up_to_one_rank():
    """Ranks take items i mod n and run as many forwards as the busiest rank (the others on a filler)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=64)
    model = family_of(cfg).build(cfg)
    model.init_weights()
    model.eval()
    tokenizer = model_tokenizer("gpt2", cfg.vocab_size)
    items = load_items("arc_easy", 13)  # 3 to 5 choices each: the ranks' shares differ in size
    pairs = encode_items(tokenizer, items)
    forwards = []

    def logits_at(x, index):
        forwards.append(x.shape)
        return model_logits_at(model, model)(x, index)

    whole = score_items(logits_at, pairs, items, cfg.block_size, tokenizer.n_vocab, 4, CPU)
    for ranks in (2, 3):
        forwards.clear()
        parts = [score_items(logits_at, pairs, items, cfg.block_size, tokenizer.n_vocab, 4, CPU, r, ranks)
                 for r in range(ranks)]
        assert TaskScore.from_list([sum(v) for v in zip(*(p.as_list() for p in parts))]) == whole
        per_rank = len(forwards) // ranks
        assert len(forwards) == per_rank * ranks and (1, 1) in forwards  # equal counts, fillers where short


def test_a_pair_longer_than_the_context_keeps_its_end():
    """The window keeps the last block_size + 1 ids: a continuation as long as the context is scored whole but
    for its first id, which has nothing before it in the window."""
    seen = []

    def logits_at(x, index):
        seen.append((x.tolist(), index.tolist()))
        logits = torch.zeros(len(index), 12)  # uniform over the 10 ids: each scored id costs log 10
        logits[:, 10:] = 20.0  # the head's padding rows, past vocab_size: never in the softmax
        return logits

    lls = loglikelihoods(logits_at, [([1, 2, 3], [4, 5]), ([1], [2, 3, 4, 5, 6])], block_size=4, vocab_size=10,
                         batch_size=2, device=CPU)
    # the first pair whole (5 ids: 4 inputs, its 2 continuation ids scored at positions 2-3); the second cut to
    # [2, 3, 4, 5, 6], scored at all 4 positions of row 1
    assert seen == [([[1, 2, 3, 4], [2, 3, 4, 5]], [2, 3, 4, 5, 6, 7])]
    assert lls == pytest.approx([2 * -torch.log(torch.tensor(10.0)).item(), 4 * -torch.log(torch.tensor(10.0)).item()])


def test_the_right_choice_of_an_item_with_a_clear_answer_wins():
    """A model that knows only the continuation ' b' (every logit of its id high) picks it, by sum and per char."""
    item = Item(("x",) * 3, (" a", " b", " c"), 1)
    tokenizer = model_tokenizer("gpt2", 50257)
    b = tokenizer.encode_ordinary(" b")[0]

    def logits_at(x, index):
        logits = torch.zeros(len(index), 50257)
        logits[:, b] = 5.0
        return logits

    score = score_items(logits_at, encode_items(tokenizer, [item]), [item], 32, 50257, 8, CPU)
    assert (score.correct, score.correct_norm) == (1, 1)


def test_a_continuation_is_encoded_inside_its_text_as_the_harness_does(tokenizer_jsons, tmp_path):
    # Llama 2's SentencePiece form puts "▁" before every text: " yes" alone is a lone "▁" then "▁yes"
    definition = json.loads(tokenizer_jsons["metaspace"].read_text())
    definition["pre_tokenizer"]["prepend_scheme"] = "always"
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    shutil.copy(tokenizer_jsons["metaspace"].with_name("tokenizer_config.json"), tmp_path)
    tokenizer = model_tokenizer(str(tmp_path / "tokenizer.json"), 400)
    alone = tokenizer.encode_ordinary(" the king")
    context, whole = tokenizer.encode_ordinary("Who is it? "), tokenizer.encode_ordinary("Who is it? the king")
    assert alone != whole[len(context):]  # the case the harness's encoding exists for
    item = Item(("Who is it? ", "Who is it?"), ("the king", " the king"), 0)  # a trailing space moves over
    [[first, second]] = encode_items(tokenizer, [item])
    prompt = tokenizer.encode_ordinary("Who is it?")
    assert first == second == ([tokenizer.bos_token, *prompt], tokenizer.encode_ordinary("Who is it? the king")[
        len(prompt):])
    # GPT-2's tokens carry their space: either way gives the same ids
    gpt2 = model_tokenizer("gpt2", 50257)
    assert encode_items(gpt2, [item]) == [[(gpt2.encode_ordinary("Who is it?"), gpt2.encode_ordinary(" the king"))] * 2]


def test_loglikelihoods_by_hand_come_back_in_the_pairs_order():
    """A head that gives id 3 half the probability and each of the 9 other ids 1/18, at every position: a
    continuation's log-likelihood counts its 3s and its other ids. The pairs are batched longest first over two
    batches; the results must still be in the pairs' order, each continuation id scored once."""
    def logits_at(x, index):
        logits = torch.zeros(len(index), 10)
        logits[:, 3] = math.log(9.0)
        return logits

    half, other = math.log(0.5), math.log(1 / 18)
    pairs = [([1], [3]), ([1, 2, 2], [4, 4]), ([5], [3, 4]), ([7, 7], [3, 3, 3])]
    lls = loglikelihoods(logits_at, pairs, block_size=16, vocab_size=10, batch_size=2, device=CPU)
    assert lls == pytest.approx([half, 2 * other, half + other, 3 * half], rel=1e-5)


def test_acc_norm_divides_by_characters_not_by_words_or_tokens():
    """Sums favour the short choice, per character the long one (one word either way)."""
    item = Item(("Q:", "Q:"), (" a", " abcdefgh"), 1)
    score = TaskScore()
    score.add(item, [-2.0, -3.0])  # per char: -2 / 1 and -3 / 8
    assert (score.correct, score.correct_norm) == (0, 1)
    assert item.chars == (1, 8)


def test_a_continuation_without_a_leading_space_is_encoded_inside_its_text(tokenizer_jsons, tmp_path):
    """A SentencePiece tokenizer that puts "▁" before every text encodes "?" alone as "▁?" (or "▁" and "?"), but
    after "Who is it" as a bare "?": the continuation's ids are those of the whole text after the context's."""
    import json
    import shutil

    from lm.inference.choices import encode_items
    from lm.tokenizer import model_tokenizer

    definition = json.loads(tokenizer_jsons["metaspace"].read_text())
    definition["pre_tokenizer"]["prepend_scheme"] = "always"
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    shutil.copy(tokenizer_jsons["metaspace"].with_name("tokenizer_config.json"), tmp_path)
    tokenizer = model_tokenizer(str(tmp_path / "tokenizer.json"), 400)
    context, whole = tokenizer.encode_ordinary("Who is it"), tokenizer.encode_ordinary("Who is it?")
    assert whole[:len(context)] == context and tokenizer.encode_ordinary("?") != whole[len(context):]
    [[pair]] = encode_items(tokenizer, [Item(("Who is it",), ("?",), 0)])
    assert pair == ([tokenizer.bos_token, *context], whole[len(context):])
