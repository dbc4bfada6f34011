"""SFT / DPO: losses against hand-computed values, packing, data formats and errors (no torchrun)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from colo_rl import algos
from colo_rl.config import DataConfig, ModelConfig
from colo_rl.data.arithmetic_demos import worked_answer, worked_steps
from colo_rl.data.files import DataError
from colo_rl.train.packing import pack_bins, packed_batch
from colo_rl.data.preference import load_preference_data
from colo_rl.data.sft import SFTExample, load_sft_data
from colo_rl.train.batch import build_batch
from colo_rl.train.offline import sft_micro_batches


@pytest.fixture(scope="module")
def tokenizer():
    from colo_rl.models import load_tokenizer

    return load_tokenizer("embedded")


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------ losses
def test_dpo_sigmoid_loss_matches_hand_computed():
    pc, pr = torch.tensor([-5.0, -8.0]), torch.tensor([-7.0, -6.0])
    rc, rr = torch.tensor([-6.0, -7.0]), torch.tensor([-6.5, -6.5])
    beta = 0.5
    losses, chosen_r, rejected_r = algos.dpo_loss(pc, pr, rc, rr, beta=beta)
    # pair 0: h = (-5 + 6) - (-7 + 6.5) = 1.5; pair 1: h = (-8 + 7) - (-6 + 6.5) = -1.5
    expected = [-math.log(_sig(0.75)), -math.log(_sig(-0.75))]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert chosen_r.tolist() == pytest.approx([0.5, -0.5])
    assert rejected_r.tolist() == pytest.approx([-0.25, 0.25])


def test_dpo_label_smoothing_and_hinge_match_hand_computed():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-5.0, -7.0, -6.0, -6.5))  # h = 1.5
    beta, eps = 0.5, 0.1
    losses, _, _ = algos.dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    expected = -(1 - eps) * math.log(_sig(0.75)) - eps * math.log(_sig(-0.75))
    assert losses.item() == pytest.approx(expected, rel=1e-6)
    hinge, _, _ = algos.dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="hinge")
    assert hinge.item() == pytest.approx(max(0.0, 1 - 0.75))
    hinge_big, _, _ = algos.dpo_loss(pc, pr, rc, rr, beta=2.0, loss_type="hinge")
    assert hinge_big.item() == 0.0  # 1 - 2 * 1.5 < 0


def test_ipo_loss_matches_hand_computed_on_length_normalised_logprobs():
    # chosen: 2 tokens, rejected: 4 tokens; IPO uses mean log-probs per token
    pol = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.5, 0.0, 0.0], [-0.5, -1.0, -1.0, -1.5]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    p = algos.sequence_logprobs(pol, mask, average=True)
    r = algos.sequence_logprobs(ref, mask, average=True)
    assert p.tolist() == pytest.approx([-1.5, -1.0])
    assert r.tolist() == pytest.approx([-2.0, -1.0])
    beta = 0.25
    loss = algos.ipo_loss(p[:1], p[1:], r[:1], r[1:], beta=beta)
    h = (-1.5 + 2.0) - (-1.0 + 1.0)  # 0.5
    assert loss.item() == pytest.approx((h - 1 / (2 * beta)) ** 2)  # (0.5 - 2)^2 = 2.25
    via_dpo, _, _ = algos.dpo_loss(p[:1], p[1:], r[:1], r[1:], beta=beta, loss_type="ipo")
    assert via_dpo.item() == pytest.approx(2.25)
    assert algos.sequence_logprobs(pol, mask).tolist() == pytest.approx([-3.0, -4.0])


def test_sft_masked_loss_matches_hand_computed():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # counted tokens: -2, -3, -0.5 -> mean NLL 5.5 / 3
    assert algos.sft_loss(logp, mask).item() == pytest.approx(5.5 / 3)
    # a global token count (other micro-batches / ranks) replaces the local one
    assert algos.sft_loss(logp, mask, num_tokens=11).item() == pytest.approx(5.5 / 11)


def test_dpo_loss_rejects_bad_options():
    t = torch.zeros(1)
    with pytest.raises(ValueError, match="dpo_loss"):
        algos.dpo_loss(t, t, t, t, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        algos.dpo_loss(t, t, t, t, label_smoothing=0.5)


# ------------------------------------------------------------------ packing
def _tiny_model():
    from colo_rl.models import load_model

    cfg = ModelConfig(path="embedded", random_init=True, hidden_size=64, num_layers=2)
    return load_model(cfg, torch.float32, seed=0).eval()


def _forward_logp(model, batch):
    """What DeepSpeedActor.response_logprobs computes, without DeepSpeed."""
    from colo_rl.train.batch import response_logprobs

    return response_logprobs(model, batch)[0]


def _examples(n: int, seed: int = 0) -> list[SFTExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        n_p, n_c = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        p = torch.randint(10, 5000, (n_p,), generator=g).tolist()
        c = torch.randint(10, 5000, (n_c,), generator=g).tolist()
        mask = [1] * n_c
        if n_c > 2:
            mask[-1] = 0  # a non-trained token inside the completion (e.g. whitespace after end-of-turn)
        out.append(SFTExample(str(i), p, c, mask))
    return out


def _per_example_nll(model, batches, n: int) -> torch.Tensor:
    nll = torch.zeros(n)
    for b in batches:
        logp = _forward_logp(model, b)
        if "example" in b.extras:  # packed: target tokens know their example
            for i in range(n):
                nll[i] += -(logp * b.response_mask * (b.extras["example"] == i)).sum()
    return nll


def test_packing_gives_the_same_per_example_loss_as_unpacked():
    model = _tiny_model()
    examples = _examples(7)
    with torch.no_grad():
        unpacked = build_batch([e.prompt_ids for e in examples], [e.completion_ids for e in examples], 0,
                               response_masks=[e.completion_mask for e in examples])
        ref = -(_forward_logp(model, unpacked) * unpacked.response_mask).sum(-1)
        packed = sft_micro_batches(examples, micro_batch_size=2, pad_id=0, packing=True, max_len=24)
        rows_and_examples = [(len(b), len(set(b.extras["example"][b.extras["example"] >= 0].tolist())))
                             for b in packed]
        assert len(packed) >= 2 and any(n_ex > n_rows for n_rows, n_ex in rows_and_examples), \
            "the test must pack several examples into a row"
        got = _per_example_nll(model, packed, len(examples))
    assert got.tolist() == pytest.approx(ref.tolist(), rel=1e-5, abs=1e-4)
    # the same token counts: no target lost or double-counted at example boundaries
    assert sum(float(b.response_mask.sum()) for b in packed) == float(unpacked.response_mask.sum())


def test_packing_without_the_block_mask_would_contaminate():
    """The check above is sensitive: with a plain causal mask over the row, later examples see
    earlier ones and their losses change."""
    model = _tiny_model()
    examples = _examples(3, seed=1)
    b = packed_batch([[(e.prompt_ids + e.completion_ids, [0] * len(e.prompt_ids) + e.completion_mask)
                       for e in examples]], 0)
    leaky = type(b)(b.input_ids, torch.ones_like(b.input_ids), b.position_ids, b.response_ids, b.response_mask,
                    extras=b.extras)
    with torch.no_grad():
        good = _per_example_nll(model, [b], 3)
        bad = _per_example_nll(model, [leaky], 3)
    assert good[0].item() == pytest.approx(bad[0].item(), rel=1e-5)  # the first example sees nothing earlier
    assert abs(good[2].item() - bad[2].item()) > 1e-3


def test_packed_pairs_give_the_same_sequence_logprobs_as_padded_pairs():
    from colo_rl.data.preference import PreferencePair
    from colo_rl.train.offline import pair_micro_batches, split_pair_logps

    model = _tiny_model()
    exs = _examples(9, seed=2)
    pairs = [PreferencePair(str(i), a.prompt_ids, a.completion_ids, a.completion_mask, b.completion_ids,
                            b.completion_mask) for i, (a, b) in enumerate(zip(exs, exs[1:] + exs[:1]))]
    with torch.no_grad():
        results = {}
        for packing in (False, True):
            chosen, rejected = torch.zeros(len(pairs)), torch.zeros(len(pairs))
            mbs = pair_micro_batches(pairs, 4, 0, packing=packing)
            assert len(mbs) == 3
            for idx, batch in mbs:
                if packing:  # one row per pair, each prompt once (+ one token)
                    assert batch.input_ids.shape[0] == len(idx)
                    assert int(batch.input_ids.ne(0).sum()) == sum(len(pairs[i].prompt_ids) + len(pairs[i].chosen_ids)
                                                                   + 1 + len(pairs[i].rejected_ids) for i in idx)
                c, r = split_pair_logps(_forward_logp(model, batch), batch, average=False)
                chosen[idx], rejected[idx] = c, r
            results[packing] = (chosen, rejected)
    for a, b in zip(results[False], results[True]):
        assert b.tolist() == pytest.approx(a.tolist(), rel=1e-5, abs=1e-4)


def test_pack_bins_first_fit_decreasing():
    bins = pack_bins([5, 3, 8, 2, 4], 10)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    assert all(sum([5, 3, 8, 2, 4][i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 22 tokens need at least 3 rows of 10
    assert pack_bins([12], 10) == [[0]]  # an over-long item travels alone


# ------------------------------------------------------------------ data: formats, masks, errors
def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_malformed_jsonl_line_names_file_line_and_key(tmp_path, tokenizer):
    f = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b"}] * 3
                     + [{"prompt": "What is 2 + 2?"}] + [{"prompt": "a", "completion": "b"}] * 3)
    with pytest.raises(DataError) as e:
        load_sft_data(tokenizer, DataConfig(path=str(f), eval_size=2))
    assert f"{f}:4" in str(e.value) and "'completion'" in str(e.value)

    g = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 4
                     + [{"prompt": "p", "chosen": "a"}])
    with pytest.raises(DataError) as e:
        load_preference_data(tokenizer, DataConfig(path=str(g), eval_size=1))
    assert f"{g}:5" in str(e.value) and "'rejected'" in str(e.value)

    h = _write_jsonl(tmp_path / "broken.jsonl", [{"prompt": "a", "completion": "b"}, '{"prompt": "a", "compl'])
    with pytest.raises(DataError, match=rf"{h}:2: invalid JSON"):
        load_sft_data(tokenizer, DataConfig(path=str(h), eval_size=0))

    m = _write_jsonl(tmp_path / "msgs.jsonl", [{"messages": [{"role": "user"}]}] * 3)
    with pytest.raises(DataError, match=r"msgs.jsonl:\d: messages\[0\] is missing key 'content'"):
        load_sft_data(tokenizer, DataConfig(path=str(m), eval_size=0))


@pytest.mark.parametrize("answer", [[0], {"v": 1}, False])
def test_an_answer_that_is_not_text_or_a_number_is_no_answer_counted(tmp_path, tokenizer, answer, caplog):
    """`answer: [0]` became the truth "[0]" for the greedy held-out accuracy. The answer is optional
    here (only that accuracy reads it): such a record counts as having none, with a warning, and the
    data still trains (a StrategyQA-style `"answer": true`)."""
    f = _write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "p", "completion": "c", "answer": "1"},
                                               {"prompt": "p", "completion": "c", "answer": answer}])
    with caplog.at_level("WARNING", logger="colo_rl"):
        train = load_sft_data(tokenizer, DataConfig(path=str(f), eval_size=0, shuffle=False))[0]
    assert [ex.answer for ex in train] == ["1", None]
    assert "1 record(s) have an 'answer' that is not text or a number (first: " in caplog.text
    assert "sft.jsonl:2)" in caplog.text
    g = _write_jsonl(tmp_path / "dpo.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b", "answer": answer}])
    assert load_preference_data(tokenizer, DataConfig(path=str(g), eval_size=0))[0][0].answer is None
    n = _write_jsonl(tmp_path / "num.jsonl", [{"prompt": "p", "completion": "c", "answer": 7}])
    assert load_sft_data(tokenizer, DataConfig(path=str(n), eval_size=0))[0][0].answer == "7"


@pytest.mark.parametrize("chat", [False, True])
def test_a_number_prompt_or_response_is_named_with_its_type(tmp_path, tokenizer, chat):
    """Without a chat template a number `chosen` was refused as "message lists need a chat template"."""
    ok = {"prompt": "q", "chosen": "a", "rejected": "b"}
    g = _write_jsonl(tmp_path / "pairs.jsonl", [ok] * 5 + [{"prompt": "q", "chosen": 1, "rejected": 2}])
    cfg = dict(eval_size=0, use_chat_template=chat, shuffle=False)
    expected = (r"it must be a non-empty list of \{role, content\} messages or a string" if chat
                else r"it must be a string \(or, with data.use_chat_template=true")
    with pytest.raises(DataError, match=rf"pairs.jsonl:6: key 'chosen' is a int; {expected}"):
        load_preference_data(tokenizer, DataConfig(path=str(g), **cfg))
    for row, key in (({"prompt": 3, "completion": "c"}, "prompt"), ({"prompt": "p", "completion": 4.5}, "completion")):
        f = _write_jsonl(tmp_path / "sft.jsonl", [row])
        with pytest.raises(DataError, match=rf"sft.jsonl:1: key '{key}' is a (int|float); it must be"):
            load_sft_data(tokenizer, DataConfig(path=str(f), **cfg))
    if not chat:  # a real message list still says what to set
        m = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "q"}], "completion": "c"}])
        with pytest.raises(DataError, match=r"m.jsonl:1: key 'prompt' is a message list; message lists need a chat "
                                            r"template: set data.use_chat_template=true"):
            load_sft_data(tokenizer, DataConfig(path=str(m), **cfg))


def test_pairs_whose_chosen_is_the_rejected_are_counted_and_reported(tmp_path, tokenizer, caplog):
    """Such a pair adds a constant to the DPO loss and no gradient; it was accepted without a word."""
    same = [{"role": "assistant", "content": "a"}]
    g = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"},
                                                 {"prompt": "q", "chosen": "a", "rejected": "a"},
                                                 {"prompt": "r", "chosen": "b", "rejected": "c"},
                                                 {"prompt": "r", "chosen": "a", "rejected": same}])
    with caplog.at_level("WARNING", logger="colo_rl"):
        train, _, _ = load_preference_data(tokenizer, DataConfig(path=str(g), eval_size=0, shuffle=False))
    assert len(train) == 4  # kept, as TRL keeps them
    assert f"2 of 4 preference pairs have chosen identical to rejected once tokenised (first: {g}:2)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="colo_rl"):
        load_preference_data(tokenizer, DataConfig(path=str(g), eval_size=1))
    assert "2 of 4 preference pairs" in caplog.text  # held-out pairs count too


def test_blank_lines_are_counted_in_the_summary_the_recipes_log(tmp_path, tokenizer):
    f = tmp_path / "gaps.jsonl"
    f.write_text("\n" + json.dumps({"prompt": "p", "completion": "c"}) + "\n\n")
    _, _, stats = load_sft_data(tokenizer, DataConfig(path=str(f), eval_size=0))
    assert stats.summary() == "1 kept, 0 truncated, 0 dropped as over-length; 2 blank lines skipped in data.path"
    g = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}, ""])
    assert load_preference_data(tokenizer, DataConfig(path=str(g), eval_size=0))[2].summary().endswith(
        "; 1 blank line skipped in data.path")


def test_a_response_with_nothing_before_it_is_refused_by_record(tmp_path, tokenizer):
    """An empty prompt left a response's first token scored from padding, or (one row alone) from a
    position that already sees it; two such rows crashed."""
    opener = [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}]
    f = _write_jsonl(tmp_path / "greet.jsonl", [{"messages": opener}])
    with pytest.raises(DataError, match=r"greet.jsonl:1: the conversation opens with an assistant turn"):
        load_sft_data(tokenizer, DataConfig(path=str(f), eval_size=0))
    g = _write_jsonl(tmp_path / "empty.jsonl", [{"prompt": " ", "completion": "hi"}])
    with pytest.raises(DataError, match=r"empty.jsonl:1: the prompt is empty"):
        load_sft_data(tokenizer, DataConfig(path=str(g), eval_size=0, use_chat_template=False))
    from colo_rl.train.batch import build_batch
    with pytest.raises(ValueError, match="an empty prompt"):
        build_batch([[5, 6], []], [[7], [8]], pad_id=0)


def test_chat_messages_loss_only_on_assistant_turns(tmp_path, tokenizer):
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    f = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": conv}])
    train, held, _ = load_sft_data(tokenizer, DataConfig(path=str(f), eval_size=0))
    (ex,) = train
    full = tokenizer.decode(ex.prompt_ids + ex.completion_ids)
    assert full == tokenizer.apply_chat_template(conv, tokenize=False)
    trained = [t for t, m in zip(ex.completion_ids, ex.completion_mask) if m]
    assert tokenizer.decode(trained) == "Hello!<|im_end|>4<|im_end|>"
    assert tokenizer.decode(ex.prompt_ids).endswith("<|im_start|>assistant\n")
    assert "user\n2+2?" in tokenizer.decode([t for t, m in zip(ex.completion_ids, ex.completion_mask) if not m])


def test_prompt_completion_and_preference_formats(tmp_path, tokenizer):
    f = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Say hi", "completion": "hi"}])
    (ex,), _, _ = load_sft_data(tokenizer, DataConfig(path=str(f), eval_size=0))
    assert tokenizer.decode([t for t, m in zip(ex.completion_ids, ex.completion_mask) if m]) == "hi<|im_end|>"
    assert tokenizer.decode(ex.prompt_ids) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi"}], add_generation_prompt=True, tokenize=False)

    msgs = [{"role": "user", "content": "Pick"}]
    g = _write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "Pick", "chosen": "A", "rejected": "B"},
        {"prompt": msgs, "chosen": [{"role": "assistant", "content": "A"}],
         "rejected": [{"role": "assistant", "content": "B"}]}])
    pairs, _, _ = load_preference_data(tokenizer, DataConfig(path=str(g), eval_size=0))
    assert len(pairs) == 2
    assert pairs[0].prompt_ids == pairs[1].prompt_ids and pairs[0].chosen_ids == pairs[1].chosen_ids
    p = pairs[0]
    assert tokenizer.decode([t for t, m in zip(p.chosen_ids, p.chosen_mask) if m]) == "A<|im_end|>"
    assert tokenizer.decode([t for t, m in zip(p.rejected_ids, p.rejected_mask) if m]) == "B<|im_end|>"

    # without a chat template: the plain prompt GRPO and the evaluation write (PromptBuilder.text),
    # then completion + EOS
    plain = DataConfig(path=str(f), eval_size=0, use_chat_template=False, system_prompt="Be brief.")
    (ex,), _, _ = load_sft_data(tokenizer, plain)
    assert tokenizer.decode(ex.prompt_ids) == "Be brief.\nSay hi\n" and tokenizer.decode(ex.completion_ids) == "hi<|im_end|>"
    from colo_rl.data import PromptBuilder
    from colo_rl.data.prompts import Problem
    builder = PromptBuilder(tokenizer, DataConfig(use_chat_template=False, system_prompt="Be brief.", instruction=""))
    assert builder.text(Problem(id="0", question="Say hi", answer="")) == tokenizer.decode(ex.prompt_ids)


def test_data_train_size_caps_a_user_file_as_for_grpo(tmp_path, tokenizer):
    from colo_rl.data import load_problems

    rows = [{"prompt": f"What is {i} + 1?", "completion": f"{i + 1}", "answer": str(i + 1)} for i in range(50)]
    f = _write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=str(f), eval_size=5, train_size=10)
    train, held, _ = load_sft_data(tokenizer, cfg)
    assert len(train) == 10 and len(held) == 5
    grpo_train, _ = load_problems(cfg)  # the same ten records
    assert sorted(ex.answer for ex in train) == sorted(p.answer for p in grpo_train)


def test_parquet_and_datasets_directory(tmp_path, tokenizer):
    import datasets

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(5)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "ds"))
    a_train, a_held, _ = load_sft_data(tokenizer, DataConfig(path=str(tmp_path / "d.parquet"), eval_size=1))
    b_train, b_held, _ = load_sft_data(tokenizer, DataConfig(path=str(tmp_path / "ds"), eval_size=1))
    assert len(a_train) == 4 and len(a_held) == 1
    assert [e.completion_ids for e in a_train] == [e.completion_ids for e in b_train]
    pairs = datasets.Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant",
                                                                                     "content": "b"}]}] * 3)
    pairs.to_parquet(str(tmp_path / "p.parquet"))
    train, held, _ = load_preference_data(tokenizer, DataConfig(path=str(tmp_path / "p.parquet"), eval_size=1))
    assert len(train) == 2 and len(held) == 1


def test_overlong_policy_truncates_drops_or_fails_and_counts(tmp_path, tokenizer):
    rows = [{"prompt": "short", "completion": "ok"}, {"prompt": "short", "completion": "word " * 200}]
    f = _write_jsonl(tmp_path / "long.jsonl", rows)
    base = dict(path=str(f), eval_size=0, max_seq_len=64, shuffle=False)
    kept, _, stats = load_sft_data(tokenizer, DataConfig(**base, overlong_policy="drop"))
    assert len(kept) == 1 and (stats.kept, stats.dropped, stats.truncated) == (1, 1, 0)
    assert f"{f}:2" in stats.dropped_origins[0]
    cut, _, stats = load_sft_data(tokenizer, DataConfig(**base, overlong_policy="truncate"))
    assert len(cut) == 2 and stats.truncated == 1 and max(len(e) for e in cut) == 64
    with pytest.raises(DataError, match=rf"{f}:2: .*data.max_seq_len=64"):
        load_sft_data(tokenizer, DataConfig(**base, overlong_policy="error"))
    pairs = _write_jsonl(tmp_path / "lp.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b " * 100}])
    got, _, stats = load_preference_data(tokenizer, DataConfig(path=str(pairs), eval_size=0, max_seq_len=40,
                                                               overlong_policy="truncate"))
    assert stats.truncated == 1 and len(got[0]) == 40 and sum(got[0].chosen_mask) == 2


# ------------------------------------------------------------------ embedded data
def test_worked_answers():
    assert worked_steps("3 + 4 * 5") == (["3 + 20"], 23)
    assert worked_steps("10 - 3 - 2") == (["7 - 2"], 5)
    assert worked_answer("12 + 7") == "12 + 7 = 19. The answer is 19."
    assert worked_answer("6 * 3 + 17") == "6 * 3 + 17 = 18 + 17 = 35. The answer is 35."


def _composed_data(name: str):
    """The data config a recipe composes (conf/<name>.yaml), typed."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from colo_rl.config import register_configs

    register_configs()
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose(name)).data


def test_embedded_data_matches_grpo_eval_and_verifier(tokenizer):
    from colo_rl.data import PromptBuilder, load_problems
    from colo_rl.rewards import math_verify_reward

    grpo_cfg, sft_cfg, dpo_cfg = _composed_data("config"), _composed_data("sft"), _composed_data("dpo")
    sft_cfg.train_size, dpo_cfg.train_size = 40, 40
    train, held, stats = load_sft_data(tokenizer, sft_cfg)
    assert stats.dropped == 0 and len(held) == grpo_cfg.eval_size
    _, grpo_held = load_problems(grpo_cfg)  # GRPO's default held-out problems and prompts
    builder = PromptBuilder(tokenizer, grpo_cfg)
    assert [builder.encode(p) for p in grpo_held] == [e.prompt_ids for e in held]
    assert [p.answer for p in grpo_held] == [e.answer for e in held]
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert all(math_verify_reward(text(e.completion_ids), e.answer) == 1.0 for e in train + held)
    pairs, pheld, _ = load_preference_data(tokenizer, dpo_cfg)
    assert [p.prompt_ids for p in pheld] == [e.prompt_ids for e in held]  # the same held-out problems
    assert all(math_verify_reward(text(p.chosen_ids), p.answer) == 1.0 for p in pairs + pheld)
    assert all(math_verify_reward(text(p.rejected_ids), p.answer) == 0.0 for p in pairs + pheld)
