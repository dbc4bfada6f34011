"""Generation requests and answers: colo_rl's SamplingParams as SGLang's dict, its outputs as
Completions (pure: CPU-tested with fake outputs)."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

from colo_rl.errors import SGLangEngineError
from colo_rl.rollout.base import Completion, SamplingParams


# ===================================================================== generation (pure)
def sglang_sampling_params(params: SamplingParams, eos_token_ids: list[int], stop_strings: bool = False) -> dict:
    """Our SamplingParams as SGLang's dict. `n` is always 1: we expand the prompts ourselves so the
    order of the outputs is ours to define (a GRPO group is contiguous). `params.stop` is passed on
    only to an engine started with its tokenizer (`stop_strings`); otherwise the caller cuts."""
    if params.greedy:
        temperature, top_p, top_k = 0.0, 1.0, 1
    else:
        if not params.temperature > 0:
            raise ValueError(f"sampling temperature must be > 0 (got {params.temperature}); use greedy=True")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {params.top_p})")
        temperature, top_p, top_k = float(params.temperature), float(params.top_p), -1
    out = {
        "max_new_tokens": int(params.max_new_tokens),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "n": 1,
        "stop_token_ids": list(eos_token_ids),
        # Keep the EOS token (and a stop string's tokens) in the output: the trainer must see (and
        # learn) the stop.
        "no_stop_trim": True,
    }
    if stop_strings and params.stop:
        out["stop"] = list(params.stop)
    return out


def expand_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt n times in a row: completions j*n .. j*n+n-1 belong to prompt j."""
    if n < 1:
        raise ValueError(f"completions per prompt must be >= 1 (got {n})")
    return [list(p) for p in prompts for _ in range(n)]


def abort_error(message) -> SGLangEngineError:
    """A request SGLang aborted: returned as finish_reason {"type": "abort"}, or raised by generate
    itself (status 400: ValueError; 500 / 503: fastapi's HTTPException)."""
    return SGLangEngineError(f"SGLang aborted a request: {message}. Common causes: a prompt longer than the "
                             "engine's context length, or a KV cache too small for one sequence "
                             "(raise colocate.mem_fraction_static or lower colocate.memory_margin_gib)")


def raised_abort(error: Exception) -> Optional[SGLangEngineError]:
    """generate's own exception as abort_error when it is one of SGLang's aborts (else None)."""
    if isinstance(error, ValueError):  # a request SGLang's checks refuse (length, sampling values, LoRA)
        return abort_error(error) if "context length" in str(error) else SGLangEngineError(
            f"SGLang refused a request: {error}")
    if isinstance(getattr(error, "status_code", None), int):  # fastapi.HTTPException(status_code, detail)
        return abort_error(getattr(error, "detail", None) or error)
    return None


def finish_reason(meta: Mapping) -> str:
    """SGLang's finish reason as "stop" (EOS) / "stop_string" / "length"; an aborted request raises.
    A stop string comes back as {"type": "stop", "matched": "<the string>"} (an EOS token: its id)."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind == "stop" and isinstance(reason, Mapping) and isinstance(reason.get("matched"), str):
        return "stop_string"
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        raise abort_error(reason.get("message") if isinstance(reason, Mapping) else "")
    raise SGLangEngineError(f"SGLang returned an unfinished request (finish_reason={reason!r}); "
                            "colo_rl never streams, so this is an SGLang API change")


def parse_completion(prompt_ids: list[int], out: Mapping, eos_token_ids: Iterable[int] = ()) -> Completion:
    """One SGLang output dict (from generate with return_logprob=True) as a Completion.

    `eos_token_ids`: a response ending in one finished by EOS ("stop"), whatever SGLang's label.

    Token ids and sampling log-probs both come from meta_info["output_token_logprobs"] (entries
    (logprob, token_id, text)), so they are aligned by construction; the plain output ids must
    agree with them (trimmed by one stop token at most)."""
    meta = out.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SGLangEngineError("SGLang returned no meta_info['output_token_logprobs']: the request must be "
                                "sent with return_logprob=True")
    token_ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    reason = finish_reason(meta)
    if reason == "length" and token_ids and token_ids[-1] in set(eos_token_ids):
        reason = "stop"  # an EOS as the last allowed token: SGLang 0.5.17 checks the length cap first
    output_ids = out.get("output_ids", out.get("token_ids"))
    if output_ids is not None:
        output_ids = [int(t) for t in output_ids]
        if output_ids != token_ids and not (reason == "stop" and output_ids == token_ids[:-1]):
            raise SGLangEngineError(f"SGLang's output ids ({len(output_ids)}) disagree with the token ids of its "
                                    f"log-probs ({len(token_ids)}): cannot tell which tokens were sampled")
    return Completion(prompt_ids=list(prompt_ids), token_ids=token_ids, logprobs=logprobs, finish_reason=reason)


def parse_outputs(expanded_prompts: list[list[int]], outputs, eos_token_ids: Iterable[int] = ()) -> list[Completion]:
    if isinstance(outputs, Mapping):  # a batch of one can come back unwrapped
        outputs = [outputs]
    if len(outputs) != len(expanded_prompts):
        raise SGLangEngineError(f"SGLang returned {len(outputs)} outputs for {len(expanded_prompts)} requests")
    return [parse_completion(p, o, eos_token_ids) for p, o in zip(expanded_prompts, outputs)]
