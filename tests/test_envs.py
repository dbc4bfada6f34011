"""Tools, tool-call formats and environments (colo_rl/envs): the calculator never evals, the python
tool's limits hold, malformed calls and faulty tools become observations; per-episode state (a
notebook-like python tool, environment classes from a file, `retry`) and its failure modes."""

import time
from types import SimpleNamespace

import pytest

from colo_rl.config import ConfigError, EnvConfig
from colo_rl.envs import (ENVIRONMENTS, TOOLS, ConversationEnvironment, Retry, ToolEnvironment, ToolError, UserTurns,
                          choose_format, run_python, safe_arithmetic)
from colo_rl.envs.calls import template_declares_tools
from colo_rl.envs.tools import Tool

CFG = EnvConfig(name="calculator", format="auto", tool_timeout_s=2.0, tool_memory_mb=256, max_output_chars=64)
QWEN_LIKE = "{% if tools %}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}..."


def tools(*names):
    return {n: TOOLS.get(n)(CFG) for n in names}


# ------------------------------------------------------------------ calculator
@pytest.mark.parametrize("expr, value", [("12 * 34", 408), ("(3 + 4) * 5 - 6", 29), ("2 ** 10", 1024),
                                         ("7 / 2", 3.5), ("-3 + 1", -2), ("17 // 5 + 17 % 5", 5), ("6×7", 42)])
def test_calculator_evaluates_arithmetic(expr, value):
    assert safe_arithmetic(expr) == value


@pytest.mark.parametrize("expr, why", [("__import__('os').system('true')", "Call"), ("x + 1", "Name"),
                                       ("(1).__class__", "Attribute"), ("9 ** 9 ** 9", "exponent"),
                                       ("1 / 0", "division by zero"), ("1 +", "not an arithmetic"),
                                       ("'a' * 3", "Constant"), ("", "empty")])
def test_calculator_refuses_everything_else(expr, why):
    with pytest.raises(ToolError, match=why):
        safe_arithmetic(expr)


# ------------------------------------------------------------------ python tool
def test_python_tool_runs_code_and_cuts_its_output():
    assert run_python("print(123 * 456)", 5.0, 256, 100) == "56088"
    out = run_python("print('x' * 10000)", 5.0, 256, 100)
    assert out.startswith("x" * 100) and out.endswith("[truncated 9900 chars]") and len(out) < 130


def test_python_tool_time_limit_holds():
    t0 = time.perf_counter()
    with pytest.raises(ToolError, match="timed out after 1 s"):
        run_python("while True: pass", 1.0, 256, 100)
    assert time.perf_counter() - t0 < 4.0


def test_python_tool_memory_limit_holds():
    with pytest.raises(ToolError, match="MemoryError|signal"):
        run_python("x = bytearray(600 << 20); print(len(x))", 5.0, 256, 100)


def test_python_tool_gets_an_empty_environment_and_a_scratch_directory(tmp_path):
    out = run_python("import os; print(sorted(os.environ), os.getcwd())", 5.0, 256, 300)
    assert "colo_rl_py_" in out and "PYTHONPATH" not in out


def test_python_tool_reports_the_exception_line():
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        run_python("print(1 / 0)", 5.0, 256, 200)


# ------------------------------------------------------------------ formats
def test_format_follows_the_chat_template():
    assert choose_format("auto", QWEN_LIKE, tools("calculator")).name == "json"
    from colo_rl.models import load_tokenizer
    smol = load_tokenizer("embedded").chat_template  # SmolLM2's template declares no tools
    assert not template_declares_tools(smol)
    assert choose_format("auto", smol, tools("calculator")).name == "tags"


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}', "unterminated"),
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', "JSON object"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
    ('<tool_call>{"name": "calculator", "arguments": 5}</tool_call>', "must be a JSON object"),
])
def test_json_format_names_what_is_wrong_with_a_malformed_call(text, error):
    parsed = choose_format("json", None, tools("calculator")).parse("Let me compute. " + text)
    assert parsed.call is None and error in parsed.error


def test_json_format_parses_a_call_and_where_it_ends():
    text = 'ok <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call> junk'
    parsed = choose_format("json", None, tools("calculator")).parse(text)
    assert parsed.call.name == "calculator" and parsed.call.arguments == {"expression": "2*3"}
    assert text[:parsed.end].endswith("</tool_call>")
    assert choose_format("json", None, tools("calculator")).stop_strings() == ("</tool_call>",)
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    assert choose_format("json", None, tools("calculator")).parse(as_string).call.arguments == {"expression": "1"}


@pytest.mark.parametrize("text, error", [("<calculator>1+2", "unterminated <calculator>"),
                                         ("<search>cats</search>", "unknown tool <search>")])
def test_tag_format_malformed_calls(text, error):
    parsed = choose_format("tags", None, tools("calculator")).parse(text)
    assert parsed.call is None and error in parsed.error


def test_tag_format_parses_inline_calls_and_answers_inline():
    fmt = choose_format("tags", None, tools("calculator", "python"))
    parsed = fmt.parse("So <result>3</result> then 12*34 = <calculator>12*34</calculator> and more")
    assert parsed.call.name == "calculator" and parsed.call.arguments == {"expression": "12*34"}
    assert fmt.observation("408", turn_closed=False) == "<result>408</result>"
    assert fmt.observation("408", turn_closed=True).startswith("\n<|im_start|>user\n<result>408</result>")
    assert fmt.parse("no call here, <b>bold</b>?").error == "unknown tool <b>; available: ['calculator', 'python']"
    assert not fmt.parse("plain text 1 < 2 > 0").wants_tool
    assert fmt.stop_strings() == ("</calculator>", "</python>")  # where a call ends: the engine may stop there


# ------------------------------------------------------------------ environment: faults are observations
def test_environment_answers_calls_and_turns_faults_into_observations():
    env = ENVIRONMENTS.get("calculator")(CFG, None).start(None)
    ok = env.step("12*34 = <calculator>12*34</calculator>", turn_closed=False)
    assert ok.observation == "<result>408</result>" and ok.tool == "calculator" and ok.error is None
    bad = env.step("<calculator>12*</calculator>", turn_closed=False)
    assert bad.observation.startswith("<result>error: not an arithmetic expression") and bad.error
    malformed = env.step("<calculator>12*", turn_closed=True)
    assert "error: unterminated <calculator>" in malformed.observation and malformed.tool is None
    assert env.step("The answer is 408.", turn_closed=True).done


def test_a_tool_that_raises_or_hangs_becomes_an_observation():
    def boom(args):
        raise RuntimeError("disk on fire")

    def hang(args):
        time.sleep(30)

    env = ToolEnvironment([Tool("boom", "raises", {"properties": {"x": {"description": "e.g. 1"}}}, "x", boom),
                           Tool("hang", "hangs", {"properties": {"x": {"description": "e.g. 1"}}}, "x", hang)],
                          "tags", None, 64, timeout_s=0.5).start(None)
    step = env.step("<boom>1</boom>", turn_closed=False)
    assert step.observation == "<result>error: the tool failed (RuntimeError: disk on fire)</result>"
    t0 = time.perf_counter()
    step = env.step("<hang>1</hang>", turn_closed=False)
    assert "timed out" in step.observation and step.error and time.perf_counter() - t0 < 3


def test_environment_adds_the_tool_instructions_to_the_prompt():
    env = ENVIRONMENTS.get("calculator")(CFG, None)
    msgs = env.first_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "What is 2+2?"}])
    # tags: a worked exchange first (a small model copies it), then the problem with the instructions
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == "<calculator>12 * 34</calculator><result>408</result> The answer is 408."
    assert msgs[1]["content"].startswith("What is 12 * 34?\nTo use a tool")
    assert msgs[3]["content"] == ("What is 2+2?\nTo use a tool, write <calculator>EXPRESSION</calculator>; its result "
                                  "follows in <result></result>. Example: <calculator>12 * 34</calculator>"
                                  "<result>408</result>")
    json_env = ToolEnvironment([TOOLS.get("calculator")(CFG)], "auto", QWEN_LIKE, 64)  # the template renders tools
    assert json_env.first_messages([{"role": "user", "content": "q"}]) == [{"role": "user", "content": "q"}]
    assert json_env.chat_template_kwargs()["tools"][0]["function"]["name"] == "calculator"


def test_python_tool_has_no_network_where_user_namespaces_allow():
    from colo_rl.envs.tools import network_isolated
    if not network_isolated():
        pytest.skip("no unprivileged `unshare -rn` here: the python tool cannot cut the network (README limitation)")
    code = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2); print('connected')\n" \
           "except OSError as e:\n    print('blocked', e.errno)"
    assert run_python(code, 5.0, 256, 100).startswith("blocked")


# ------------------------------------------------------------------ config
def test_env_options_are_checked_at_start_up():
    from colo_rl.config import ConfigError, EnvConfig, RunConfig, validate

    validate(RunConfig(env=EnvConfig(name="calculator")))
    with pytest.raises(ConfigError, match=r"env.name='search' is not one of \['none', 'calculator', 'python', "
                                          r"'calculator_python', 'retry'\] or a file's class as path/to/file.py:Name"):
        validate(RunConfig(env=EnvConfig(name="search")))
    with pytest.raises(ConfigError, match="env.max_turns=0 must be a positive integer"):
        validate(RunConfig(env=EnvConfig(max_turns=0)))
    with pytest.raises(ConfigError, match=r"env.name is not read by recipes/sft.py \(multi-turn rollouts are GRPO"):
        validate(RunConfig(recipe="sft", algo=RunConfig().algo.__class__(name="sft")), overrides=["env.name=python"])


# ------------------------------------------------------------------ per-episode state
def test_python_keep_state_reruns_the_episodes_earlier_successful_calls():
    tool = TOOLS.get("python")(EnvConfig(python_keep_state=True, tool_timeout_s=5.0, tool_memory_mb=256))
    first, second = tool.start_episode(), tool.start_episode()
    assert first({"code": "x = 6\nprint('set')"}) == "set"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        first({"code": "y = 1 / 0"})  # a failing call is not kept: it would fail every later one
    assert first({"code": "def f(k):\n    return k * x"}) == ""
    assert first({"code": "print(f(7))"}) == "42"  # earlier calls' output is not repeated
    with pytest.raises(ToolError, match="NameError: name 'x' is not defined"):
        second({"code": "print(x)"})  # another episode starts empty
    stateless = TOOLS.get("python")(EnvConfig(tool_timeout_s=5.0, tool_memory_mb=256)).start_episode()
    stateless({"code": "x = 6"})
    with pytest.raises(ToolError, match="NameError"):
        stateless({"code": "print(x)"})


LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
               "<|end_header_id|>\n\n{% endif %}")


def test_user_messages_are_written_by_the_models_chat_template():
    from colo_rl.models import load_tokenizer

    tok = load_tokenizer("embedded")  # ChatML
    turns = UserTurns(tok, use_chat_template=True)
    assert turns.message("Try again.", turn_closed=True) == \
        "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
    assert turns.message("Try again.", turn_closed=False).startswith("<|im_end|>\n<|im_start|>user\n")
    llama = SimpleNamespace(chat_template=LLAMA3_LIKE, eos_token="<|eot_id|>",
                            apply_chat_template=lambda msgs, **kw: _render(LLAMA3_LIKE, msgs, **kw))
    assert UserTurns(llama, True).message("No.", turn_closed=True) == \
        "<|start_header_id|>user<|end_header_id|>\n\nNo.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    # a tool's result is a user turn the same way (json format), or opens one after an EOS (tags)
    json_fmt = choose_format("json", None, tools("calculator"), UserTurns(llama, True))
    assert json_fmt.observation("408", turn_closed=False) == (
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n<tool_response>\n408\n</tool_response><|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    chatml_tags = choose_format("tags", None, tools("calculator"), UserTurns(tok, True))
    assert chatml_tags.observation("408", turn_closed=True) == \
        "\n<|im_start|>user\n<result>408</result><|im_end|>\n<|im_start|>assistant\n"
    assert chatml_tags.observation("408", turn_closed=False) == "<result>408</result>"  # inline
    assert UserTurns(tok, use_chat_template=False).message("No.", turn_closed=True) == "\nNo.\n"
    drops = SimpleNamespace(chat_template="x", eos_token="", apply_chat_template=lambda msgs, **kw: "only the last")
    with pytest.raises(ConfigError, match="set data.use_chat_template=false"):
        UserTurns(drops, True)


def _render(template, messages, add_generation_prompt=False, tokenize=False):
    import jinja2

    return jinja2.Template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token="<|begin_of_text|>")


def test_retry_tells_a_wrong_or_missing_answer_and_ends_at_the_right_one():
    from colo_rl.data.prompts import Problem

    episode = Retry(Problem(id="1", question="q", answer="1000"))
    assert episode.step("The answer is 999.") == "999 is not right. Check your work, then state the final answer again."
    assert "did not state a final answer" in episode.step("It is about a thousand.")
    assert episode.step("The answer is 1,000.") is None


class Faulty:
    def __init__(self, problem):
        if problem == "bad problem":
            raise KeyError("answer")
        self.problem = problem

    def step(self, turn):
        return {"boom": lambda: 1 / 0, "int": lambda: 7, "hang": lambda: time.sleep(30)}[turn]()


def test_a_faulty_environment_ends_its_episode_counted_and_logged_once(caplog):
    env = ConversationEnvironment(Faulty, "Faulty", UserTurns(None, False), 64, timeout_s=0.5)
    with caplog.at_level("WARNING", logger="colo_rl"):
        boom = env.start("p").step("boom", True)
        wrong_type = env.start("p").step("int", True)
        t0 = time.perf_counter()
        hung = env.start("p").step("hang", True)
        waited = time.perf_counter() - t0
        no_episode = env.start("bad problem").step("boom", True)
    assert boom.done and boom.error == "Faulty.step failed (ZeroDivisionError: division by zero)"
    assert wrong_type.done and "Faulty.step returned int; return the next user message (a str) or None" in \
        wrong_type.error
    assert hung.done and hung.error == "timed out after 0.5 s" and waited < 3
    assert no_episode.done and no_episode.error == "Faulty failed (KeyError: 'answer')"
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "env.name=Faulty: Faulty.step failed (ZeroDivisionError" in logged[0]


def test_an_environment_file_is_checked_at_start_up(tmp_path):
    from colo_rl.config import RunConfig, validate

    (tmp_path / "envs.py").write_text("class Good:\n    def __init__(self, problem): pass\n"
                                      "    def step(self, turn): return None\n\n"
                                      "class NoStep:\n    def __init__(self, problem): pass\n")
    validate(RunConfig(env=EnvConfig(name=f"{tmp_path}/envs.py:Good")))
    with pytest.raises(ConfigError, match=r"class NoStep in .*envs.py has no step\(self, turn\) method"):
        validate(RunConfig(env=EnvConfig(name=f"{tmp_path}/envs.py:NoStep")))
    with pytest.raises(ConfigError, match=r"env.name: .*'Missing' is not defined in .*envs.py \(it defines: "
                                          r"\['Good', 'NoStep'\]\)"):
        validate(RunConfig(env=EnvConfig(name=f"{tmp_path}/envs.py:Missing")))
    with pytest.raises(ConfigError, match=r"env.name: 'nowhere/envs.py:Good': no file"):
        validate(RunConfig(env=EnvConfig(name="nowhere/envs.py:Good")))
    with pytest.raises(ConfigError, match=r"env.python_keep_state is not read by recipes/sft.py"):
        validate(RunConfig(recipe="sft", algo=RunConfig().algo.__class__(name="sft")),
                 overrides=["env.python_keep_state=true"])
