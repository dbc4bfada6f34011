"""Multi-turn rollouts on any engine: generate a turn, let the environment answer, append its
observation's tokens, generate the next turn, from token ids throughout.

Every turn of the whole batch is one `engine.generate` call (the first one shares each prompt
across its group, as single-turn rollouts do), so the engine stays batched; episodes that are done
drop out of the next call (an engine whose generate is a collective, `lockstep_generate`, as a
tensor-parallel group's is, gets every turn on every rank with the same parameters, empty or not).
Each episode has its own environment session (`env.start(problem)`), closed when the batch's
episodes are done. An episode's response is its policy turns and the observations between
them, in order; `policy_mask` is 1 on the policy's tokens (trained, log-prob checked) and 0 on the
observations' (no loss, no log-prob: their `logprobs` are 0). The policy's token ids are never
re-tokenised: the trainer scores exactly what the engine sampled.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from colo_rl.envs import Environment, Step
from colo_rl.errors import EnvError
from colo_rl.rollout.base import Completion, SamplingParams, capabilities_of


@dataclass
class Episode(Completion):
    policy_mask: list[int] = field(default_factory=list)  # per response token: 1 policy, 0 observation
    turns: int = 0  # policy turns
    tool_calls: int = 0  # turns that asked for a tool (well-formed or not)
    tool_errors: int = 0  # calls answered with an error (malformed, unknown tool, raised, timed out)
    hit_limit: str = ""  # "" | "max_turns" | "max_total_tokens"
    engine_stops: int = 0  # turns the engine itself ended at a tool's closing tag (SamplingParams.stop)
    policy_texts: list[str] = field(default_factory=list)  # each policy turn's text (the verifier reads these)
    env_reward: Optional[float] = None  # the environment's own score of the episode (a user class's reward())

    @property
    def policy_text(self) -> str:
        return "\n".join(self.policy_texts)


def generate_completions(engine, prompts: list[list[int]], params: SamplingParams, multiturn=None,
                         problems: Optional[Sequence[Any]] = None) -> list[Completion]:
    """Completions of `prompts`: the engine's own (single-turn), or episodes of `multiturn`'s
    environment, each session started from its prompt's problem."""
    if multiturn is None:
        return engine.generate(prompts, params)
    return multiturn.generate(engine, prompts, params, problems)


def policy_texts(tokenizer, completions: list[Completion]) -> list[str]:
    """What the verifier reads: the policy's own text (an episode's turns; a completion's tokens)."""
    if completions and isinstance(completions[0], Episode):
        return [c.policy_text for c in completions]
    return tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)


def cut_at(tokenizer, token_ids: list[int], chars: int) -> int:
    """The fewest leading tokens whose text reaches `chars` characters."""
    for k in range(1, len(token_ids) + 1):
        if len(tokenizer.decode(token_ids[:k])) >= chars:
            return k
    return len(token_ids)


class MultiTurnRollout:
    """Episodes of `env` on an engine: at most `max_turns` policy turns and `max_total_tokens`
    response tokens (policy + observations) each."""

    def __init__(self, env: Environment, tokenizer, max_turns: int, max_total_tokens: int, tool_workers: int = 4):
        self.env, self.tokenizer = env, tokenizer
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.tool_workers = tool_workers
        stop_strings = getattr(env, "stop_strings", None)
        self.stop = tuple(stop_strings()) if stop_strings is not None else ()
        read = getattr(env, "special_tokens_read", None)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in (read() if read is not None else ())]
        self.kept_special = {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}

    def generate(self, engine, prompts: list[list[int]], params: SamplingParams,
                 problems: Optional[Sequence[Any]] = None) -> list[Episode]:
        """`problems`: one per prompt (what each episode's session starts from); None where unknown."""
        n = params.n
        episodes = [Episode(list(p), [], [], "stop") for p in prompts for _ in range(n)]
        contexts = [list(p) for p in prompts for _ in range(n)]
        starts = [problems[k // n] if problems is not None else None for k in range(len(episodes))]
        active = list(range(len(episodes)))
        cut_turns: set[int] = set()  # episodes whose turn the engine stopped at a closing tag that closed no call
        lockstep = capabilities_of(engine).lockstep_generate
        every_turn = getattr(self.env, "answers_every_turn", False)
        sessions = []
        try:
            with ThreadPoolExecutor(self.tool_workers, thread_name_prefix="colo_rl-tool") as pool:
                sessions = list(pool.map(self.env.start, starts))  # side by side: a constructor may be slow
                for turn in range(self.max_turns):
                    if not active and not lockstep:
                        break
                    # the longest turn any live episode has room for (lockstep: the same on every rank)
                    room = self.max_total_tokens if lockstep or not active else max(
                        self.max_total_tokens - len(episodes[i].token_ids) for i in active)
                    turn_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room),
                                                      n=n if turn == 0 else 1, stop=self.stop)
                    outs = engine.generate(prompts if turn == 0 else [contexts[i] for i in active], turn_params)
                    last = turn + 1 == self.max_turns
                    steps, unfinished = {}, set()
                    for i, out in zip(active, outs):
                        if i in cut_turns:  # this call went on with a turn cut at a stray closing tag
                            out = self._reopen_turn(episodes[i], out)
                        turn_ended, wants_tool, end_token = self._take_turn(episodes[i], out)
                        if not turn_ended and not last:
                            unfinished.add(i)
                            contexts[i] = episodes[i].prompt_ids + episodes[i].token_ids
                        elif not turn_ended or (wants_tool and last):  # a call in the last turn is not run
                            episodes[i].hit_limit = "max_turns"
                            episodes[i].finish_reason = "length"
                        elif wants_tool or (every_turn and not episodes[i].hit_limit):
                            steps[i] = pool.submit(sessions[i].step, episodes[i].policy_texts[-1], end_token)
                    next_active = []
                    for i in active:
                        if i in unfinished or (i in steps and self._observe(episodes[i], contexts[i],
                                                                            steps[i].result(), last)):
                            next_active.append(i)
                    active, cut_turns = next_active, unfinished
                for ep, session in zip(episodes, sessions):  # once the episode is over, before it is closed
                    ep.env_reward, error = session.reward()
                    ep.tool_errors += error is not None
        finally:
            for session in sessions:
                session.close()
        if every_turn and len(episodes) > 1 and all(e.tool_errors for e in episodes):
            # An environment that answers every turn fails only through a bug of its own: not a run to go on with.
            raise EnvError(f"the environment failed on all {len(episodes)} episodes of this batch; the latest "
                           f"failure: {getattr(self.env, 'last_error', None)}. Fix it (docs/tools.md, 'Your own "
                           f"environment': Name(problem), step(self, turn) -> str | None)")
        return episodes

    def _take_turn(self, ep: Episode, out: Completion) -> tuple[bool, bool, Optional[str]]:
        """Append the policy's turn, cut past its first tool call. Returns (the turn is over, it asks
        for a tool, the text of the EOS token it ended with or None). A turn the engine stopped at a
        closing tag that closes no call (`</calculator>` with no `<calculator>` before it) is not
        over: the policy did not end it, and the next engine call goes on from its last token."""
        room = self.max_total_tokens - len(ep.token_ids)
        tokens, logps, finish = out.token_ids[:room], out.logprobs[:room], out.finish_reason
        if finish == "stop_string":  # the engine stopped at a closing tag: the turn has no EOS. Counted
            ep.engine_stops += 1     # here, before the cut: a stop token that runs past the tag (SmolLM2's
            finish = "tool"          # `><`) still leaves text after the call
        if len(tokens) < len(out.token_ids):
            finish = "length"
        text = self.tokenizer.decode(tokens)
        parsed = self.env.parse(text)
        stray_tag = finish == "tool" and not parsed.wants_tool
        if parsed.end is not None and parsed.end < len(text):  # what was sampled after the call is dropped
            k = cut_at(self.tokenizer, tokens, parsed.end)
            tokens, logps, finish = tokens[:k], logps[:k], "tool"
            text = self.tokenizer.decode(tokens)
        ep.token_ids += tokens
        ep.logprobs += logps
        ep.policy_mask += [1] * len(tokens)
        ep.turns += 1
        ep.policy_texts.append(self.policy_text(tokens))
        ep.finish_reason = "length" if finish == "length" else "stop"
        if parsed.wants_tool:
            ep.tool_calls += 1
        elif finish == "length" and len(ep.token_ids) >= self.max_total_tokens:
            ep.hit_limit = "max_total_tokens"
        if stray_tag and len(ep.token_ids) >= self.max_total_tokens:  # no room to go on: cut by the limit
            ep.hit_limit, ep.finish_reason = "max_total_tokens", "length"
            return True, False, None
        end_token = self.tokenizer.decode(tokens[-1:]) if finish == "stop" and tokens else None
        return not stray_tag, parsed.wants_tool, end_token

    @staticmethod
    def _reopen_turn(ep: Episode, out: Completion) -> Completion:
        """Take the episode's last turn back out of it, joined with `out`, its continuation: the whole
        turn is taken again (parsed, cut at a call) as if the engine had not stopped in it."""
        k = len(ep.token_ids) - ep.policy_mask[::-1].index(0) if 0 in ep.policy_mask else 0
        head, head_logps = ep.token_ids[k:], ep.logprobs[k:]
        del ep.token_ids[k:], ep.logprobs[k:], ep.policy_mask[k:]
        ep.turns -= 1
        ep.policy_texts.pop()
        return Completion(out.prompt_ids, head + out.token_ids, head_logps + out.logprobs, out.finish_reason)

    def policy_text(self, tokens: list[int]) -> str:
        """A turn's text as the environment reads it: no special tokens (EOS, headers), except those
        its call format is told by (Llama's <|python_tag|> before code)."""
        if not self.kept_special.intersection(tokens):
            return self.tokenizer.decode(tokens, skip_special_tokens=True)
        parts, start = [], 0
        for k, t in enumerate(tokens):
            if t in self.kept_special:
                parts += [self.tokenizer.decode(tokens[start:k], skip_special_tokens=True), self.tokenizer.decode([t])]
                start = k + 1
        return "".join(parts + [self.tokenizer.decode(tokens[start:], skip_special_tokens=True)])

    def _observe(self, ep: Episode, context: list[int], step: Step, last_turn: bool = False) -> bool:
        """Append the environment's observation; False when the episode ends here."""
        if step.error is not None:
            ep.tool_errors += 1
        if step.done:
            return False
        if last_turn:  # an environment that answers every turn wanted another one
            ep.hit_limit, ep.finish_reason = "max_turns", "length"
            return False
        observation = step.observation
        overflow = ep.policy_texts[-1][step.cut:] if step.cut is not None else ""
        if overflow and observation.startswith(overflow):
            # The call's last token ran past its end into what the observation begins with (SmolLM2:
            # `</calculator><` is one token too many, `><`): the policy wrote those characters, so the
            # observation starts after them and the text reads `</calculator><result>...` as taught.
            observation = observation[len(overflow):]
        obs = self.tokenizer(observation, add_special_tokens=False)["input_ids"]
        if len(ep.token_ids) + len(obs) >= self.max_total_tokens:  # no room for the observation and a reply
            ep.hit_limit, ep.finish_reason = "max_total_tokens", "length"
            return False
        context[:] = ep.prompt_ids + ep.token_ids + obs
        ep.token_ids += obs
        ep.logprobs += [0.0] * len(obs)
        ep.policy_mask += [0] * len(obs)
        return True


def episode_metrics(completions: list[Completion]) -> dict[str, float]:
    """Per-rank sums (the caller reduces over ranks and divides by the episode count)."""
    eps = [c for c in completions if isinstance(c, Episode)]
    return {"env/turns": float(sum(e.turns for e in eps)), "env/tool_calls": float(sum(e.tool_calls for e in eps)),
            "env/tool_errors": float(sum(e.tool_errors for e in eps)),
            "env/used_tool": float(sum(e.tool_calls > 0 for e in eps)),
            "env/hit_max_turns": float(sum(e.hit_limit == "max_turns" for e in eps)),
            "env/hit_max_total_tokens": float(sum(e.hit_limit == "max_total_tokens" for e in eps)),
            "env/policy_tokens": float(sum(sum(e.policy_mask) for e in eps)),
            "env/engine_stops": float(sum(e.engine_stops for e in eps))}
