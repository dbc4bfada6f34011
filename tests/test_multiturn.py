"""Multi-turn episodes (colo_rl/rollout/multiturn.py): interleaved policy / observation spans, the
policy mask through the batch, packing, the loss and the log-prob check; engine log-probs equal
the trainer's over the policy tokens of real multi-turn episodes."""

import pytest
import torch

from colo_rl import algos
from colo_rl.colocate.handoff import LogprobAgreement
from colo_rl.config import AlgoConfig, EnvConfig, ModelConfig
from colo_rl.envs import ENVIRONMENTS, ConversationEnvironment, UserTurns
from colo_rl.models import load_model, load_tokenizer
from colo_rl.phase import Phase, PhaseGuard
from colo_rl.rollout.base import Capabilities, Completion, SamplingParams
from colo_rl.rollout.hf import HFEngine
from colo_rl.rollout.multiturn import Episode, MultiTurnRollout, episode_metrics, policy_texts
from colo_rl.train.batch import build_batch, response_logprobs
from colo_rl.train.packing import pack_groups

TINY = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")
ENV_CFG = EnvConfig(format="tags", tool_timeout_s=2.0, tool_memory_mb=256, max_output_chars=64)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded")


class ScriptedEngine:
    """Answers each generate call from a script: per call, per prompt, the text to 'sample' (log-prob
    -0.5 per token). Records the prompts it was given."""

    def __init__(self, tok, script: list[list[str]], honour_stop: bool = False):
        self.tok, self.script, self.calls, self.params = tok, script, [], []
        self.honour_stop = honour_stop  # as the HF engine: end after the token completing a stop string

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        self.params.append(params)
        texts = self.script[len(self.calls) - 1]
        expanded = [p for p in prompts for _ in range(params.n)]
        assert len(texts) == len(expanded)
        outs = []
        for p, text in zip(expanded, texts):
            ids = self.tok(text, add_special_tokens=False)["input_ids"][:params.max_new_tokens]
            finish = "stop" if ids and ids[-1] == self.tok.eos_token_id else "length"
            if self.honour_stop and params.stop:
                k = next((k for k in range(1, len(ids) + 1)
                          if any(s in self.tok.decode(ids[:k]) for s in params.stop)), None)
                if k is not None:
                    ids, finish = ids[:k], "stop_string"
            outs.append(Completion(list(p), ids, [-0.5] * len(ids), finish))
        return outs


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_scripted_episode_has_the_right_spans_masks_and_contexts(tok):
    env = ENVIRONMENTS.get("calculator")(ENV_CFG, tok)
    engine = ScriptedEngine(tok, [
        ["12*34 = <calculator>12*34</calculator> = 999 junk<|im_end|>",  # cut after the call
         "No tool needed. The answer is 7.<|im_end|>",                     # done after one turn
         "<calculator>12*</calculator>"],                                 # a bad call: an error observation
        [". The answer is 408.<|im_end|>", "<calculator>1+1</calculator>"],
        ["The answer is 2.<|im_end|>"]])
    prompt = encode(tok, "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")
    eps = MultiTurnRollout(env, tok, max_turns=4, max_total_tokens=200).generate(
        engine, [prompt], SamplingParams(max_new_tokens=40, n=3))
    turn1 = encode(tok, "12*34 = <calculator>12*34</calculator>")
    obs1 = encode(tok, "<result>408</result>")
    turn2 = encode(tok, ". The answer is 408.<|im_end|>")
    a, b, c = eps
    assert a.token_ids == turn1 + obs1 + turn2
    assert a.policy_mask == [1] * len(turn1) + [0] * len(obs1) + [1] * len(turn2)
    assert a.logprobs == [-0.5] * len(turn1) + [0.0] * len(obs1) + [-0.5] * len(turn2)
    assert (a.turns, a.tool_calls, a.tool_errors, a.hit_limit, a.finish_reason) == (2, 1, 0, "", "stop")
    assert a.policy_text == "12*34 = <calculator>12*34</calculator>\n. The answer is 408."
    assert (b.turns, b.tool_calls, b.policy_mask) == (1, 0, [1] * len(b.token_ids))
    assert (c.turns, c.tool_calls, c.tool_errors) == (3, 2, 1)
    err = encode(tok, "<result>error: not an arithmetic expression: '12*'</result>")
    assert c.token_ids[len(encode(tok, "<calculator>12*</calculator>")):][:len(err)] == err
    # the batch advances together: turn 2 is one call for the two live episodes, turn 3 for one
    assert [len(call) for call in engine.calls] == [1, 2, 1]
    assert engine.calls[1][0] == prompt + turn1 + obs1  # the engine continues from the exact token ids
    m = episode_metrics(eps)
    assert (m["env/turns"], m["env/tool_calls"], m["env/tool_errors"], m["env/used_tool"]) == (6.0, 3.0, 1.0, 2.0)
    assert policy_texts(tok, eps)[1] == "No tool needed. The answer is 7."


def test_an_engine_stopping_at_the_closing_tag_gives_the_same_episodes(tok):
    """The driver asks the engine to stop at the tools' closing tags; an engine that does (the HF
    engine) samples less, and the episodes are those of an engine that runs on to EOS and is cut."""
    env = ENVIRONMENTS.get("calculator")(ENV_CFG, tok)
    script = [["12*34 = <calculator>12*34</calculator> = 999 junk<|im_end|>", "<calculator>12*</calculator> x",
               "The answer is 7.<|im_end|>"],
              [". The answer is 408.<|im_end|>", "<calculator>1+1</calculator> = 2<|im_end|>"],
              ["The answer is 2.<|im_end|>"]]
    prompt = encode(tok, "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")
    runs = {}
    for honour in (False, True):
        engine = ScriptedEngine(tok, script, honour_stop=honour)
        runs[honour] = MultiTurnRollout(env, tok, max_turns=4, max_total_tokens=200).generate(
            engine, [prompt], SamplingParams(max_new_tokens=40, n=3))
        assert all(p.stop == ("</calculator>",) for p in engine.params)
    fields = ("token_ids", "logprobs", "policy_mask", "turns", "tool_calls", "tool_errors", "finish_reason",
              "hit_limit", "policy_texts")
    for cut, stopped in zip(runs[False], runs[True]):
        assert [getattr(stopped, f) for f in fields] == [getattr(cut, f) for f in fields]
    assert [e.tool_calls for e in runs[True]] == [1, 2, 0]
    # the engine's own stops are counted (env/engine_stops): every call here ends at its tag
    assert [e.engine_stops for e in runs[True]] == [1, 2, 0] and [e.engine_stops for e in runs[False]] == [0, 0, 0]
    assert episode_metrics(runs[True])["env/engine_stops"] == 3.0


def test_a_closing_tag_that_closes_no_call_does_not_end_the_turn(tok):
    """An engine stopped at `</calculator>` with no call open: the policy has not ended its turn
    (no EOS), so the next engine call goes on from its last token, and the episode is the one an
    engine running on to EOS gives: one turn, its text whole, a call later in it cut and run."""
    env = ENVIRONMENTS.get("calculator")(ENV_CFG, tok)
    prompt = encode(tok, "Q:")
    answer = "I'd close </calculator> first, so 7.<|im_end|>"
    calling = "Stray </calculator> then <calculator>2+2</calculator> junk<|im_end|>"
    cut_engine = ScriptedEngine(tok, [[answer, calling], [" It is 4.<|im_end|>"]])
    stopping = ScriptedEngine(tok, [[answer, calling],  # each stops at its stray tag
                                    [" first, so 7.<|im_end|>", " then <calculator>2+2</calculator> junk<|im_end|>"],
                                    [" It is 4.<|im_end|>"]], honour_stop=True)
    runs = [MultiTurnRollout(env, tok, max_turns=4, max_total_tokens=200).generate(
        engine, [prompt], SamplingParams(max_new_tokens=40, n=2)) for engine in (cut_engine, stopping)]
    fields = ("token_ids", "logprobs", "policy_mask", "turns", "tool_calls", "tool_errors", "finish_reason",
              "hit_limit", "policy_texts")
    for cut, stopped in zip(*runs):
        assert [getattr(stopped, f) for f in fields] == [getattr(cut, f) for f in fields]
    a, b = runs[1]
    assert (a.turns, a.tool_calls, a.finish_reason, a.engine_stops) == (1, 0, "stop", 1)
    assert a.policy_text == "I'd close </calculator> first, so 7."
    assert (b.turns, b.tool_calls, b.tool_errors, b.engine_stops) == (2, 1, 0, 2)
    assert b.policy_texts[0] == "Stray </calculator> then <calculator>2+2</calculator>"
    assert stopping.calls[1][0] == prompt + encode(tok, "I'd close </calculator>")  # on from the exact tokens
    assert [len(call) for call in stopping.calls] == [1, 2, 1]

    # no engine call left for the rest of the turn: cut by max_turns, not a finished answer
    (ep,) = MultiTurnRollout(env, tok, max_turns=1, max_total_tokens=200).generate(
        ScriptedEngine(tok, [[answer]], honour_stop=True), [prompt], SamplingParams(max_new_tokens=40))
    assert (ep.turns, ep.hit_limit, ep.finish_reason) == (1, "max_turns", "length")
    # nor room in the episode's tokens
    room = len(encode(tok, "I'd close </calculator>"))
    (ep,) = MultiTurnRollout(env, tok, max_turns=4, max_total_tokens=room).generate(
        ScriptedEngine(tok, [[answer]], honour_stop=True), [prompt], SamplingParams(max_new_tokens=40))
    assert (ep.turns, ep.hit_limit, ep.finish_reason) == (1, "max_total_tokens", "length")


def test_a_call_whose_last_token_runs_into_the_observation_reads_as_taught(tok):
    """SmolLM2 writes `</calculator><result>` with `><` as one token: the cut keeps that token, so the
    policy has already written the observation's `<`; the observation goes on after it."""
    env = ENVIRONMENTS.get("calculator")(ENV_CFG, tok)
    script = [["12*34 = <calculator>12*34</calculator><result>999</result><|im_end|>"], [" The answer is 408.<|im_end|>"]]
    turn1 = encode(tok, "12*34 = <calculator>12*34</calculator><")
    for honour in (False, True):  # an engine that stops at the tag ends on the same `><` token
        engine = ScriptedEngine(tok, script, honour_stop=honour)
        (ep,) = MultiTurnRollout(env, tok, max_turns=3, max_total_tokens=200).generate(
            engine, [encode(tok, "Q:")], SamplingParams(max_new_tokens=40))
        assert ep.token_ids[:len(turn1)] == turn1 and tok.decode(turn1[-1:]) == "><"
        assert tok.decode(ep.token_ids).startswith("12*34 = <calculator>12*34</calculator><result>408</result> The answer")
        observation = ep.token_ids[len(turn1):ep.policy_mask.index(1, len(turn1))]
        assert tok.decode(observation) == "result>408</result>"
        assert ep.engine_stops == int(honour)  # the engine's stop counts though the token ran past the tag


def test_a_llama_call_keeps_its_eos_and_the_result_comes_as_the_templates_tool_message(tok):
    """env.format=llama: the call is the whole turn, ended by EOS, so nothing is cut (the policy's
    EOS stays its own token and is trained); the tool's message follows as the template writes it
    (the embedded ChatML template: a `tool` turn), then the policy answers."""
    env = ENVIRONMENTS.get("calculator")(EnvConfig(format="llama", max_output_chars=64), tok)
    call = '{"name": "calculator", "parameters": {"expression": "12*34"}}<|im_end|>'
    engine = ScriptedEngine(tok, [[call, "The answer is 7.<|im_end|>"], ["The answer is 408.<|im_end|>"]])
    prompt = encode(tok, "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")
    a, b = MultiTurnRollout(env, tok, max_turns=3, max_total_tokens=200).generate(
        engine, [prompt], SamplingParams(max_new_tokens=40, n=2))
    assert all(p.stop == () for p in engine.params)  # no closing tag to stop at
    turn1, turn2 = encode(tok, call), encode(tok, "The answer is 408.<|im_end|>")
    obs = encode(tok, "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    assert a.token_ids == turn1 + obs + turn2
    assert a.policy_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert (a.turns, a.tool_calls, a.tool_errors, b.turns, b.tool_calls) == (2, 1, 0, 1, 0)


def test_a_llama_code_interpreter_turn_runs_the_python_tool(tok):
    """env.format=llama: <|python_tag|> + code, where <|python_tag|> is a special token (Llama 3.1+):
    the turn text the environment reads keeps that token (others, EOS included, are dropped), so the
    python tool runs the code and its output comes back."""
    import copy

    llama_tok = copy.deepcopy(tok)
    llama_tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    env = ENVIRONMENTS.get("python")(EnvConfig(format="llama", tool_timeout_s=5.0, tool_memory_mb=256,
                                               max_output_chars=64), llama_tok)
    code = "<|python_tag|>print(6 * 7)<|im_end|>"
    engine = ScriptedEngine(llama_tok, [[code], ["The answer is 42.<|im_end|>"]])
    prompt = encode(llama_tok, "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    rollout = MultiTurnRollout(env, llama_tok, max_turns=3, max_total_tokens=200)
    (ep,) = rollout.generate(engine, [prompt], SamplingParams(max_new_tokens=40))
    assert llama_tok.decode(encode(llama_tok, code), skip_special_tokens=True) == "print(6 * 7)"  # what was lost
    assert ep.policy_texts == ["<|python_tag|>print(6 * 7)", "The answer is 42."]
    assert (ep.turns, ep.tool_calls, ep.tool_errors) == (2, 1, 0)
    turn1 = encode(llama_tok, code)
    assert "42" in llama_tok.decode(ep.token_ids[len(turn1):ep.policy_mask.index(1, len(turn1))])


def test_limits_end_episodes(tok):
    env = ENVIRONMENTS.get("calculator")(ENV_CFG, tok)
    call = "<calculator>1+1</calculator>"
    engine = ScriptedEngine(tok, [[call, call], [call]])
    prompt = encode(tok, "Q:")
    short = MultiTurnRollout(env, tok, max_turns=2, max_total_tokens=len(encode(tok, call)) + 4)
    a, b = short.generate(engine, [prompt, prompt], SamplingParams(max_new_tokens=40))
    assert a.hit_limit == b.hit_limit == "max_total_tokens" and a.turns == 1  # no room for the observation
    engine = ScriptedEngine(tok, [[call], [call]])
    (c,) = MultiTurnRollout(env, tok, max_turns=2, max_total_tokens=200).generate(engine, [prompt], SamplingParams())
    assert (c.turns, c.hit_limit, c.finish_reason, c.tool_calls) == (2, "max_turns", "length", 2)
    assert sum(c.policy_mask) == 2 * len(encode(tok, call))  # the last call is not run: no observation after it


def test_retry_sessions_start_from_their_own_problem_and_answer_every_turn(tok):
    """env.name=retry: each episode's session holds its own problem's answer; a wrong stated answer
    gets a user message written by the chat template, a right one ends the episode."""
    from colo_rl.data.prompts import Problem

    env = ENVIRONMENTS.get("retry")(EnvConfig(max_output_chars=256), tok, True)
    assert env.answers_every_turn and env.stop_strings() == ()
    engine = ScriptedEngine(tok, [
        ["The answer is 5.<|im_end|>", "The answer is 7.<|im_end|>",    # problem 1 (7): wrong, right
         "The answer is 9.<|im_end|>", "I think it is 9<|im_end|>"],    # problem 2 (9): right, no answer stated
        ["The answer is 7.<|im_end|>", "The answer is 9.<|im_end|>"],
        ["The answer is 9.<|im_end|>"]][:3])
    prompts = [encode(tok, "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"), encode(tok, "Q2")]
    problems = [Problem(id="1", question="Q1", answer="7"), Problem(id="2", question="Q2", answer="9")]
    eps = MultiTurnRollout(env, tok, max_turns=3, max_total_tokens=200).generate(
        engine, prompts, SamplingParams(max_new_tokens=40, n=2), problems)
    assert [e.turns for e in eps] == [2, 1, 1, 2]
    assert [len(c) for c in engine.calls] == [2, 2]  # turn 2: the wrong and the unstated answer only
    wrong = encode(tok, "The answer is 5.<|im_end|>")
    message = encode(tok, "\n<|im_start|>user\n5 is not right. Check your work, then state the final answer "
                          "again.<|im_end|>\n<|im_start|>assistant\n")
    assert eps[0].token_ids[:len(wrong) + len(message)] == wrong + message
    assert eps[0].policy_mask[len(wrong):len(wrong) + len(message)] == [0] * len(message)
    assert engine.calls[1][0] == prompts[0] + wrong + message
    assert "You did not state a final answer" in tok.decode(engine.calls[1][1])
    assert [e.policy_texts[-1] for e in eps] == ["The answer is 7.", "The answer is 7.", "The answer is 9.",
                                                  "The answer is 9."]
    assert all(e.tool_errors == 0 and e.hit_limit == "" for e in eps)


class Counter:
    """Counts its episode's turns, never ends the episode; records its closing."""

    closed: list = []

    def __init__(self, problem):
        self.problem, self.count = problem, 0

    def step(self, turn):
        self.count += 1
        return f"turn {self.count} of {self.problem}"

    def reward(self):
        return 10.0 * self.count

    def close(self):
        Counter.closed.append((self.problem, self.count))


def test_each_episode_has_its_own_state_and_is_closed_once(tok):
    env = ConversationEnvironment(Counter, "Counter", UserTurns(tok, use_chat_template=False), 64, 5.0)
    engine = ScriptedEngine(tok, [["a", "b", "c", "d"], ["e", "f", "g", "h"]])
    Counter.closed.clear()
    eps = MultiTurnRollout(env, tok, max_turns=2, max_total_tokens=200).generate(
        engine, [encode(tok, "Q:"), encode(tok, "R:")], SamplingParams(max_new_tokens=10, n=2), ["p", "q"])
    # plain prompts (no chat template): the message on its own line; each episode counts its own turns
    assert tok.decode(engine.calls[1][0]) == "Q:a\nturn 1 of p\n"
    assert tok.decode(engine.calls[1][3]) == "R:d\nturn 1 of q\n"
    # the second turn is answered too, which env.max_turns=2 does not allow: the episode hits the limit
    assert all((e.turns, e.hit_limit, e.finish_reason) == (2, "max_turns", "length") for e in eps)
    assert sorted(Counter.closed) == [("p", 2), ("p", 2), ("q", 2), ("q", 2)]
    assert [e.env_reward for e in eps] == [20.0] * 4  # reward() after the last turn, before close()


def test_a_collective_engine_gets_every_turn_with_the_same_params(tok):
    """A tensor-parallel group's generate is a collective: a rank whose episodes all ended still
    calls it every turn (with nothing to generate), with the params the other ranks use."""
    env = ENVIRONMENTS.get("calculator")(ENV_CFG, tok)
    engine = ScriptedEngine(tok, [["The answer is 1.<|im_end|>"], [], []])
    engine.capabilities = Capabilities(lockstep_generate=True)
    (ep,) = MultiTurnRollout(env, tok, max_turns=3, max_total_tokens=100).generate(
        engine, [encode(tok, "Q:")], SamplingParams(max_new_tokens=40))
    assert ep.turns == 1 and [len(c) for c in engine.calls] == [1, 0, 0]
    assert [p.max_new_tokens for p in engine.params] == [40, 40, 40]


def test_the_policy_mask_flows_through_batch_packing_loss_and_logprob_check(tok):
    eps = [Episode([5, 6, 7], [1, 2, 3, 4, 5, 6], [-1.0, -1.0, 0.0, 0.0, -1.0, -1.0], "stop", [1, 1, 0, 0, 1, 1]),
           Episode([5, 6, 7], [8, 9, 10], [-2.0, 0.0, -2.0], "stop", [1, 0, 1])]
    batch = build_batch([e.prompt_ids for e in eps], [e.token_ids for e in eps], 0,
                        response_masks=[e.policy_mask for e in eps],
                        per_token={"rollout_logp": [e.logprobs for e in eps]})
    expected = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(batch.response_mask, expected)
    packed = pack_groups([(eps[0].prompt_ids, [e.token_ids for e in eps], batch.select([0, 1]))], torch.float32)
    assert torch.equal(packed.response_mask, expected)
    # observation tokens carry no gradient: the loss's gradient is 0 there, whatever their log-probs
    logp = torch.randn(2, 6, requires_grad=True)
    adv = algos.ADV_ESTIMATORS.get("grpo")(torch.tensor([1.0, 0.0]), 2, AlgoConfig(), batch.response_mask)
    loss, _ = algos.rl_loss(logp, logp.detach(), adv, batch.response_mask, AlgoConfig(),
                            num_tokens=float(batch.response_mask.sum()), num_seqs=2.0)
    loss.backward()
    assert torch.all(logp.grad[expected == 0] == 0) and torch.all(logp.grad[expected == 1] != 0)
    # the engine-vs-trainer check reads policy tokens only: observation log-probs are not the engine's
    trainer = batch.extras["rollout_logp"].clone()
    trainer[expected == 0] = -30.0
    check = LogprobAgreement()
    check.add(batch.extras["rollout_logp"], trainer, batch.response_mask)
    assert check.check(0.01) == {"handoff/logprob_diff_mean": 0.0, "handoff/logprob_diff_max": 0.0}


class KeepTalking:
    """An environment class (one object per episode) that answers every turn, so a random model's
    episodes have several turns (it would never call a real tool)."""

    def __init__(self, problem):
        pass

    def step(self, turn):
        return f"result {len(turn) % 7}"


def test_engine_logprobs_equal_trainer_logprobs_over_policy_tokens(tok):
    model = load_model(TINY, torch.float32, seed=3)
    guard = PhaseGuard()
    guard.phase = Phase.GENERATION
    engine = HFEngine(model, [tok.eos_token_id], tok.pad_token_id, guard=guard, max_batch=8, seed=11)
    prompts = [encode(tok, "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"),
               encode(tok, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")]
    env = ConversationEnvironment(KeepTalking, "KeepTalking", UserTurns(tok, True), 64, 5.0)
    eps = MultiTurnRollout(env, tok, max_turns=3, max_total_tokens=60).generate(
        engine, prompts, SamplingParams(max_new_tokens=8, temperature=0.8, n=2))
    assert all(e.turns == 3 for e in eps) and all(0 in e.policy_mask for e in eps)
    batch = build_batch([e.prompt_ids for e in eps], [e.token_ids for e in eps], tok.pad_token_id,
                        response_masks=[e.policy_mask for e in eps],
                        per_token={"rollout_logp": [e.logprobs for e in eps]})
    mask = batch.response_mask.bool()
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, temperature=0.8)
        rows = [[0, 1], [2, 3]]
        packed = [response_logprobs(model, pack_groups([(eps[g[0]].prompt_ids, [eps[i].token_ids for i in g],
                                                          batch.select(g))], torch.float32), 0.8)[0] for g in rows]
    engine_lp = batch.extras["rollout_logp"]
    assert (padded - engine_lp)[mask].abs().max() < 1e-4
    for g, lp in zip(rows, packed):
        sub = batch.select(g)
        assert (lp[:, :sub.response_len] - sub.extras["rollout_logp"])[sub.response_mask.bool()].abs().max() < 1e-4
    # and the check is not vacuous: observation tokens' trainer log-probs are far from the 0 stored for them
    assert padded[~mask & batch.attention_mask[:, -batch.response_len:].bool()].abs().min() > 0.1
