"""Tasks, files and prompts: seeded splits, clear errors on bad records, counted over-length."""

import json

import pytest

from colo_rl.config import DataConfig
from colo_rl.data import ArithmeticTask, DataError, PromptBuilder, load_problems, make_arithmetic_splits, read_records
from colo_rl.data.sampler import EpochSampler
from colo_rl.models import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def test_arithmetic_splits_are_seeded_disjoint_and_correct():
    task = ArithmeticTask(1, 30, 0.3)
    train, held = make_arithmetic_splits(task, 3000, 200, seed=7)
    train2, held2 = make_arithmetic_splits(task, 10, 200, seed=7)
    assert held == held2, "the held-out split must not depend on train_size"
    assert train[:10] == train2
    assert len({e for e, _ in held}) == 200
    assert not {e for e, _ in train} & {e for e, _ in held}
    for expr, value in train[:500] + held:
        assert eval(expr) == value and value >= 0
    assert any(expr.count(" ") == 4 for expr, _ in held), "three-operand problems are present"
    assert make_arithmetic_splits(task, 50, 20, seed=8)[1] != held[:20]


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "oops"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        read_records(p)


def test_a_json_file_holding_one_object_or_a_broken_array_says_what_a_json_file_is(tmp_path):
    """{"data": [...]} pretty-printed was "g_obj.json:1: invalid JSON ...; each line must be one JSON
    object"; a broken array had no column and no advice."""
    rows = [{"prompt": "What is 2+2?", "answer": "4"}] * 2
    p = tmp_path / "g_obj.json"
    p.write_text(json.dumps({"version": 1, "data": rows}, indent=2))
    with pytest.raises(DataError, match=r"g_obj\.json: holds one JSON object \(keys \['data', 'version'\]\), not "
                                        r"records; a \.json file is one array of records .* or JSON Lines .* Its key "
                                        r"'data' holds a list of 2: save that list as the file"):
        read_records(p)
    p.write_text(json.dumps({"train": rows, "test": rows}, indent=2))
    with pytest.raises(DataError, match=r"Its keys \['train', 'test'\] hold lists"):
        read_records(p)
    broken = tmp_path / "broken.json"
    broken.write_text("[\n" + json.dumps(rows[0]) + ",\n" + json.dumps(rows[0])[:-1] + ' "x" 1}\n]\n')
    with pytest.raises(DataError, match=r"broken\.json:3: invalid JSON \(Expecting ',' delimiter at column \d+\); a "
                                        r"\.json file is one array of records"):
        read_records(broken)
    one_line = tmp_path / "one.json"  # JSON Lines under .json, and one record on one line, still read
    one_line.write_text(json.dumps(rows[0]) + "\n")
    assert [r.data for r in read_records(one_line)] == rows[:1]
    lines = tmp_path / "lines.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_records(lines)) == 2


def test_duplicate_ids_are_counted_and_reported_not_refused(tmp_path, caplog):
    """recipes/eval.py's per_problem report names problems by id: repeats were accepted silently."""
    p = tmp_path / "ids.jsonl"
    ids = ["a", "b", "a", 7, "7", "c", "b"]
    p.write_text("".join(json.dumps({"id": i, "prompt": "q", "answer": "1"}) + "\n" for i in ids))
    with caplog.at_level("WARNING", logger="colo_rl"):
        problems, _ = load_problems(DataConfig(path=str(p), eval_size=0))
    assert len(problems) == 7  # kept
    warnings = [r.getMessage() for r in caplog.records if "repeat an earlier record's id" in r.getMessage()]
    assert len(warnings) == 1, "warned once"
    assert f"3 records repeat an earlier record's id (first: {p}:3, id 'a' as at {p}:1)" in warnings[0]
    caplog.clear()
    p.write_text("".join(json.dumps({"id": i, "prompt": "q", "answer": "1"}) + "\n" for i in "abc"))
    with caplog.at_level("WARNING", logger="colo_rl"):
        read_records(p)
    assert "repeat" not in caplog.text


def test_blank_lines_are_counted_and_reported_with_the_records_line(tmp_path, caplog):
    """They were skipped without a count."""
    from colo_rl.data import file_problems

    row = json.dumps({"prompt": "q", "answer": "1"})
    p = tmp_path / "gaps.jsonl"
    p.write_text(f"{row}\n\n{row}\n   \n{row}\n{row}\n")
    assert read_records(p).blank_lines == 2
    with caplog.at_level("INFO", logger="colo_rl"):
        load_problems(DataConfig(path=str(p), eval_size=1))
    assert f"data.path={p}: 4 records, 2 blank lines skipped: 1 held out" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="colo_rl"):
        load_problems(DataConfig(path=str(p), eval_path=str(p), eval_size=0))
    assert "4 records, 2 blank lines skipped, 4 trained on" in caplog.text
    assert "4 held out, 2 blank lines skipped" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="colo_rl"):
        assert len(file_problems(p)) == 4  # recipes/eval.py's data.path read whole
    assert f"data.path={p}: 4 records, 2 blank lines skipped" in caplog.text


def test_missing_field_names_file_line_and_key(tmp_path):
    p = tmp_path / "data.jsonl"
    rows = [{"prompt": "What is 2+2?", "answer": "4"}] * 3 + [{"prompt": "What is 3+3?"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError, match=r"data\.jsonl:4: needs one of the keys \['answer'"):
        load_problems(DataConfig(path=str(p), eval_size=1))


def test_openrlhf_and_slime_default_keys_are_read_as_they_are(tmp_path):
    """OpenRLHF's and slime's prompt files keep the prompt under `input` and the truth under `label`."""
    from colo_rl.data import file_problems

    p = tmp_path / "openrlhf.jsonl"
    rows = [{"input": f"What is {i}+1?", "label": str(i + 1)} for i in range(3)]
    rows.append({"input": [{"role": "user", "content": "What is 9+1?"}], "label": 10})
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    problems = file_problems(p)
    assert [(x.question, x.answer) for x in problems[:3]] == [(f"What is {i}+1?", str(i + 1)) for i in range(3)]
    assert problems[3].messages == [{"role": "user", "content": "What is 9+1?"}] and problems[3].answer == "10"
    alpaca = tmp_path / "alpaca.jsonl"  # `input` is only part of an Alpaca prompt: not taken alone
    alpaca.write_text(json.dumps({"instruction": "Add the numbers.", "input": "17, 25", "label": "42"}) + "\n")
    with pytest.raises(DataError, match=r"alpaca.jsonl:1: holds 'instruction' and 'input' .* data.prompt_key=instr"):
        file_problems(alpaca)


def test_gsm8k_format_is_parsed(tmp_path):
    p = tmp_path / "gsm.jsonl"
    rows = [{"question": f"Q{i}?", "answer": f"work\n#### {1000 + i:,}"} for i in range(5)]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    train, held = load_problems(DataConfig(path=str(p), eval_size=2, seed=1))
    assert len(train) == 3 and len(held) == 2
    answers = sorted(pr.answer for pr in train + held)
    assert answers == [str(1000 + i) for i in range(5)]


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    good = json.dumps({"prompt": "What is 2+2?", "answer": "4"}).encode()
    for name in ("bad.jsonl", "bad.json"):
        p = tmp_path / name
        p.write_bytes(good + b"\n" + good[:30] + b"\xff" + good[30:] + b"\n")
        with pytest.raises(DataError, match=rf"{name}:2: not UTF-8 \(byte 0xff at column 31\); re-save the file as UTF-8"):
            read_records(p)
    bom = tmp_path / "bom.jsonl"  # a byte-order mark (Windows editors) is not an error
    bom.write_bytes(b"\xef\xbb\xbf" + good + b"\n")
    assert read_records(bom)[0].data["answer"] == "4"


def test_a_gsm8k_solution_under_any_key_gives_its_last_final_number(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"problem": "Q?", "answer": "48/2 = 24\n#### 72"}, {"problem": "R?", "answer": "5\n#### 6\nno, #### 7"}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    train, _ = load_problems(DataConfig(path=str(p), eval_size=0, prompt_key="problem", shuffle=False))
    assert sorted(pr.answer for pr in train) == ["7", "72"]


@pytest.mark.parametrize("row,message", [
    ({"prompt": "What is 2+2?", "answer": "  "}, r"d\.jsonl:1: key 'answer' is empty"),
    ({"prompt": ["What is 2+2?"], "answer": "4"}, r"d\.jsonl:1: prompt\[0\] must be an object with 'role'"),
    ({"prompt": [{"role": "user"}], "answer": "4"}, r"d\.jsonl:1: prompt\[0\] is missing key 'content'"),
    ({"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                 {"role": "assistant", "content": "Seen."}, {"role": "user", "content": "Count?"}], "answer": "4"},
     r"prompt\[0\]\.content must be a string or a list of"),
    ({"prompt": {"text": "What is 2+2?"}, "answer": 4}, r"d\.jsonl:1: key 'prompt' is a dict; a prompt is a string"),
    # an answer that is not text or a number was checked against as its Python repr ("['2', '3']")
    ({"question": "What is 1+1?", "answer": ["2", "3"]},
     r"d\.jsonl:1: key 'answer' is a list; an answer is a string or a number"),
    ({"question": "What is 1+1?", "answer": {"value": 2}}, r"d\.jsonl:1: key 'answer' is a dict; an answer is a"),
    ({"question": "What is 1+1?", "answer": True}, r"d\.jsonl:1: key 'answer' is a bool; an answer is a"),
    ({"question": "What is 1+1?", "answer": []}, r"d\.jsonl:1: key 'answer' is a list; an answer is a"),
    ({"prompt": "What is 1+1?", "solution": [2]}, r"d\.jsonl:1: key 'solution' is a list; an answer is a"),
    # GSM8K's layout: the question was its repr, with no warning
    ({"question": ["a", "b"], "answer": "blah #### 2"}, r"d\.jsonl:1: key 'question' is a list; a prompt is a string"),
])
def test_a_record_the_verifier_or_the_template_cannot_use_is_refused_by_line(tmp_path, row, message):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        load_problems(DataConfig(path=str(p), eval_size=0))


@pytest.mark.parametrize("row,answer_key,message", [
    ({"prompt": "q", "answer": None, "solution": "7"}, None,
     r"n\.jsonl:2: key 'answer' is null; fill it in or remove the record, or set data\.answer_key=solution"),
    ({"prompt": "q", "answer": None}, None, r"n\.jsonl:2: key 'answer' is null; fill it in or remove the record$"),
    ({"prompt": "q", "target": {"value": None}, "answer": "7"}, "target.value",
     r"n\.jsonl:2: key 'target\.value' is null"),
    ({"prompt": None, "question": "q", "answer": "7"}, None,
     r"n\.jsonl:2: key 'prompt' is null; .* or set data\.prompt_key=question"),
    ({"question": None, "answer": "x #### 7"}, None, r"n\.jsonl:2: key 'question' is null; fix or remove"),
])
def test_a_null_key_is_an_error_not_a_fall_back_to_the_next(tmp_path, row, answer_key, message):
    """{"answer": null, "solution": "7"} took `solution` as the truth without a notice."""
    p = tmp_path / "n.jsonl"
    p.write_text(json.dumps({"prompt": "ok", "answer": "1", "target": {"value": "1"}}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        load_problems(DataConfig(path=str(p), eval_size=0, answer_key=answer_key))


def test_in_a_parquet_file_a_null_is_an_absent_column(tmp_path):
    """Parquet rows have every column, null where the record had no such key: records split between
    `answer` and `solution` read as they do from JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from colo_rl.data import file_problems

    rows = [{"prompt": "q0", "answer": "2"}, {"prompt": "q1", "solution": "4"}]
    table = pa.table({"prompt": ["q0", "q1"], "answer": ["2", None], "solution": [None, "4"]})  # as pandas writes it
    pq.write_table(table, tmp_path / "mixed.parquet")
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [x.answer for x in file_problems(tmp_path / "mixed.parquet")] == ["2", "4"]
    assert [x.answer for x in file_problems(tmp_path / "mixed.jsonl")] == ["2", "4"]


def test_a_number_answer_is_its_text(tmp_path):
    p = tmp_path / "n.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n" for i, a in enumerate([2, 0.5, -3])))
    train, _ = load_problems(DataConfig(path=str(p), eval_size=0, shuffle=False))
    assert sorted(pr.answer for pr in train) == ["-3", "0.5", "2"]


def test_openai_style_text_parts_are_joined_and_tool_calls_kept():
    from colo_rl.data.chat import check_messages

    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    assert check_messages(parts, "f:1", "messages") == [{"role": "user", "content": "What is 2+2?"}]
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    reply = {"role": "tool", "content": "4", "tool_call_id": "c1"}
    assert check_messages([parts[0], call, reply], "f:1", "prompt")[1:] == [call, reply]


def test_a_file_that_is_not_what_its_suffix_says_is_named(tmp_path):
    p = tmp_path / "train.parquet"
    p.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n")  # JSONL renamed
    with pytest.raises(DataError, match=r"train\.parquet: not a readable Parquet file .*\(\.jsonl\)"):
        read_records(p)


def test_empty_prompt_is_an_error(tmp_path, tokenizer):
    p = tmp_path / "e.jsonl"
    p.write_text(json.dumps({"prompt": "  ", "answer": "1"}) + "\n" + json.dumps({"prompt": "x", "answer": "1"}))
    with pytest.raises(DataError, match=r"e\.jsonl:1: empty prompt"):
        load_problems(DataConfig(path=str(p), eval_size=0))


def test_overlong_prompts_are_dropped_or_truncated_and_counted(tokenizer):
    train, _ = load_problems(DataConfig(train_size=20, eval_size=5))
    long = train[0].__class__(id="long", question="What is " + "1 + " * 200 + "1?", answer="201")
    for policy, kept in (("drop", 20), ("truncate", 21)):
        builder = PromptBuilder(tokenizer, DataConfig(max_prompt_tokens=64, overlong_policy=policy))
        out = [builder.encode(p) for p in train + [long]]
        assert sum(o is not None for o in out) == kept
        assert all(len(o) <= 64 for o in out if o is not None)
        assert (builder.stats.dropped, builder.stats.truncated) == ((1, 0) if policy == "drop" else (0, 1))
    with pytest.raises(DataError, match="data.max_prompt_tokens=64"):
        PromptBuilder(tokenizer, DataConfig(max_prompt_tokens=64, overlong_policy="error")).encode(long)


def test_encoding_in_chunks_keeps_what_one_at_a_time_keeps(tokenizer):
    train, _ = load_problems(DataConfig(train_size=20, eval_size=5))
    long = train[0].__class__(id="long", question="What is " + "1 + " * 200 + "1?", answer="201")
    problems = train[:7] + [long] + train[7:] + [long]
    for policy in ("drop", "truncate"):
        one, chunked = (PromptBuilder(tokenizer, DataConfig(max_prompt_tokens=64, overlong_policy=policy))
                        for _ in range(2))
        expected = [(p, ids) for p in problems if (ids := one.encode(p)) is not None]
        assert chunked.encode_all(problems, chunk=3) == expected  # chunk borders inside, long prompts at 7 and 21
        assert chunked.stats == one.stats and one.stats.kept == len(expected)


def test_chat_prompt_without_template_is_refused(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DataError, match="no chat template.*data.use_chat_template=false"):
        PromptBuilder(bare, DataConfig())
    problem = load_problems(DataConfig(train_size=1, eval_size=1))[0][0]
    text = tokenizer.decode(PromptBuilder(bare, DataConfig(use_chat_template=False)).encode(problem))
    assert problem.question in text and DataConfig().instruction in text  # the plain prompt: question + instruction
    assert "<|im_start|>" not in text  # and no chat markup


def test_a_template_that_refuses_a_record_names_it(tmp_path, tokenizer):
    # Llama / Mistral-style templates raise on a role order they do not allow: a GRPO prompt from a
    # file says which record, as SFT / DPO records do, instead of a bare jinja traceback
    import copy

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                            "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
                            "{% endif %}{{ m['content'] }}{% endfor %}")
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "answer": "1"}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                               "answer": "2"}) + "\n")
    problems, _ = load_problems(DataConfig(path=str(p), eval_size=0))
    builder = PromptBuilder(strict, DataConfig())
    assert strict.decode(builder.encode(problems[0])) == "Hi"
    with pytest.raises(DataError, match=r"p\.jsonl:2: the chat template cannot render this conversation "
                                        r"\(Conversation roles must alternate"):
        builder.encode(problems[1])


def test_sampler_is_seeded_and_resumable():
    a = EpochSampler(10, seed=3)
    first = [a.next_global(4) for _ in range(4)]  # crosses an epoch boundary
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))
    b = EpochSampler(10, seed=3)
    b.next_global(4)
    b.next_global(4)
    c = EpochSampler(10, seed=3)
    c.load_state_dict(b.state_dict())
    assert [c.next_global(4) for _ in range(2)] == first[2:]
    from colo_rl.errors import CheckpointError
    with pytest.raises(CheckpointError, match=r"\(10 records, seed 3\) is not this run's \(11 records.*Restore the data"):
        EpochSampler(11, seed=3).load_state_dict(b.state_dict())  # a split run's generators check it here


def test_an_epoch_of_sft_or_dpo_sees_each_example_once_its_last_batch_short():
    """Full batches ran on into the next epoch's shuffle: 33 examples in batches of 32 for one epoch
    drew 64, 31 of them twice."""
    from types import SimpleNamespace

    from colo_rl.train.offline import plan_steps

    cfg = SimpleNamespace(trainer=SimpleNamespace(batch_size=4, epochs=3, max_steps=0, micro_batch_size=2,
                                                  packing=False), model=SimpleNamespace(attn_implementation="sdpa"))
    plan = plan_steps(cfg, 10)
    assert (plan.total_steps, plan.steps_per_epoch) == (9, 3)
    s = EpochSampler(10, seed=3)
    batches = [s.next_global(4, short_last=True) for _ in range(plan.total_steps)]
    assert [len(b) for b in batches] == [4, 4, 2] * 3
    for e in range(3):
        assert sorted(i for b in batches[3 * e:3 * e + 3] for i in b) == list(range(10))
    assert s.epochs_done() == 3.0
    assert s.planned(4, 3, short_last=True) == list(range(10))  # the next epoch: each once


def test_harder_arithmetic_keeps_the_default_splits_and_adds_operations_and_factors():
    from colo_rl.envs import safe_arithmetic
    # the defaults draw exactly as before max_operations / max_factor existed (values from main)
    train, held = make_arithmetic_splits(ArithmeticTask(), 5, 3, 1234)
    assert train == [("15 + 1", 16), ("12 * 2 * 3", 72), ("12 + 1 + 26", 39), ("12 * 9 * 9", 972), ("6 * 3 + 17", 35)]
    assert held == [("18 - 17", 1), ("22 - 9 + 20", 33), ("6 + 12", 18)]
    hard = ArithmeticTask(1, 999, 1.0, 3, 99)
    train, _ = make_arithmetic_splits(hard, 300, 10, 1234)
    n_ops = {len(e.split()) // 2 for e, _ in train}
    assert n_ops == {2, 3} and all(safe_arithmetic(e) == v >= 0 for e, v in train)
    factors = [int(toks[j]) for toks in (e.split() for e, _ in train) for i, t in enumerate(toks) if t == "*"
               for j in (i - 1, i + 1)]
    assert max(factors) > 12 and all(2 <= f <= 99 for f in factors)


def test_a_user_file_is_used_whole_unless_data_train_size_caps_it(tmp_path, caplog):
    """It was cut at 20,000 records (data.train_size's default for the embedded task) without a word."""
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20_100)))
    with caplog.at_level("INFO", logger="colo_rl"):
        train, held = load_problems(DataConfig(path=str(path), eval_size=50))
    assert len(train) == 20_050 and len(held) == 50
    assert len({p.answer for p in train + held}) == 20_100  # every record, none twice
    assert "20100 records: 50 held out (data.eval_size), 20050 trained on (every other record)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="colo_rl"):
        capped, _ = load_problems(DataConfig(path=str(path), eval_size=50, train_size=100))
    assert len(capped) == 100 and "(data.train_size=100 of 20050)" in caplog.text
    # the embedded task keeps its size when none is set
    assert len(load_problems(DataConfig(eval_size=5))[0]) == 20_000


def test_the_sampler_names_the_indices_a_run_will_draw_without_moving():
    sampler = EpochSampler(20, seed=3)
    sampler.next_global(4)
    planned = sampler.planned(6, 2)
    drawn = sampler.next_global(6) + sampler.next_global(6)
    assert planned == sorted(set(drawn)) and len(planned) == 12
    assert EpochSampler(20, seed=3).planned(8, 10) == list(range(20))  # past an epoch: all of them


def test_a_capped_user_file_warns_how_many_records_it_trains_on(caplog):
    """The SFT / DPO data groups set data.train_size for their embedded task; with a user file that
    cap must not pass as an info line: a warning says it and how to lift it."""
    import logging

    from colo_rl.data.chat import split_records
    from colo_rl.data.files import Record

    records = [Record({"prompt": f"q{i}", "completion": "a"}, f"f.jsonl:{i + 1}") for i in range(50)]
    capped = DataConfig(path="f.jsonl", eval_size=10, train_size=20)
    with caplog.at_level(logging.INFO, logger="colo_rl"):
        train, held = split_records(records, capped)
    assert (len(train), len(held)) == (20, 10)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == [
        "data.path=f.jsonl: 20 of 40 records trained on (data.train_size=20; data.train_size=null trains on every record)"]
    caplog.clear()
    train, _ = split_records(records, DataConfig(path="f.jsonl", eval_size=10, train_size=None))
    assert len(train) == 40 and not [r for r in caplog.records if r.levelno == logging.WARNING]


def bos_adding(tokenizer):
    """The embedded tokenizer made to put BOS before a text on its own, as Llama's and Gemma's do."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A",
                                                       special_tokens=[(tok.bos_token, tok.bos_token_id)])
    return tok


def test_plain_prompts_start_with_the_bos_the_tokenizer_adds_and_truncation_keeps_it(tokenizer):
    """data.use_chat_template=false: a Llama-like tokenizer's prompt starts with its BOS, as the
    model was trained (a chat template writes its own), in GRPO's prompts and SFT/DPO's alike; a
    prompt cut to data.max_prompt_tokens keeps it before the end it keeps."""
    from colo_rl.data.chat import ChatEncoder, LengthStats, apply_length_policy, leading_specials

    tok = bos_adding(tokenizer)
    bos = tok.bos_token_id
    assert leading_specials(tokenizer) == [] and leading_specials(tok) == [bos]
    train, _ = load_problems(DataConfig(train_size=2, eval_size=1))
    long = train[0].__class__(id="long", question="What is " + "1 + " * 200 + "1?", answer="201")
    plain = DataConfig(use_chat_template=False, max_prompt_tokens=64, overlong_policy="truncate")
    text = PromptBuilder(tok, plain).text(train[0])
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert PromptBuilder(tok, plain).encode(train[0]) == [bos] + body
    assert PromptBuilder(tokenizer, plain).encode(train[0]) == body  # SmolLM2 adds none
    chat = DataConfig(max_prompt_tokens=64)
    assert PromptBuilder(tok, chat).encode(train[0]) == PromptBuilder(tokenizer, chat).encode(train[0])

    builder = PromptBuilder(tok, plain)
    cut = builder.encode(long)
    whole = tokenizer(builder.text(long), add_special_tokens=False)["input_ids"]
    assert len(cut) == 64 and cut == [bos] + whole[-63:] and builder.stats.truncated == 1
    assert PromptBuilder(tokenizer, plain).encode(long) == whole[-64:]

    enc = ChatEncoder(tok, plain).encode_pair(long.question, [("completion", "201")], "x.jsonl:1")
    sft_prompt = ChatEncoder(tokenizer, plain).encode_pair(long.question, [("completion", "201")], "x.jsonl:1").prompt_ids
    assert enc.prompt_ids == [bos] + sft_prompt and len(sft_prompt) > 64
    kept = apply_length_policy(enc, plain, LengthStats(), "x.jsonl:1", ChatEncoder(tok, plain).head)
    assert kept.prompt_ids == [bos] + sft_prompt[-63:]


def test_grpo_with_every_prompt_over_length_says_what_to_change(tmp_path):
    """All prompts dropped by data.max_prompt_tokens: a traceback from the sampler ("the training set
    is empty") before; now the error line names the limit and the policy to change."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import child_env

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {k} plus {k}? Think it through.", "answer": str(2 * k)})
                            + "\n" for k in range(12)))
    proc = subprocess.run([sys.executable, "recipes/grpo.py", "model=tiny", f"data.path={data}", "data.eval_size=4",
                           "data.max_prompt_tokens=5", f"run_dir={tmp_path}/run"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
                          env=child_env(OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "error: no training prompt is left: all 8 are longer than data.max_prompt_tokens=5" in out, out[-3000:]
    assert "data.overlong_policy=truncate" in out and "Traceback" not in out


def test_a_file_no_larger_than_the_held_out_split_is_refused_with_a_size_to_write(tmp_path):
    """The default data.eval_size=200 refused a 20-record file with only "lower data.eval_size"."""
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{i} + 1", "answer": str(i + 1)}) for i in range(20)))
    with pytest.raises(DataError, match=r"has 20 records, not more than data.eval_size=200; lower data.eval_size "
                                         r"\(e.g. data.eval_size=4, a fifth held out\), or data.eval_size=0"):
        load_problems(DataConfig(path=str(path), eval_size=200))
