"""Offline beam search with vLLM's algorithm and output types (`LLM.beam_search`).

Every step asks the engine for one token of each live beam with the top 2 * beam_width
logprobs, extends each beam by each of those tokens, moves beams that end in EOS to the
finished set, and keeps the beam_width best by `get_beam_search_score`; at the end the best
beam_width of the finished and live beams are returned."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .outputs import Logprob
from .sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's tokens, then the beam's
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: the cumulative logprob over the sequence length (prompt included, a final EOS not)
    to the power length_penalty."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


def beam_search(prompt_ids: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                generate: Callable[[list[dict], SamplingParams], list], decode: Callable[[list[int]], str] | None
                ) -> list[BeamSearchOutput]:
    """`generate(prompts, sampling_params)` runs one engine pass (LLM.generate without a progress bar)."""
    width = params.beam_width

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)

    step_params = SamplingParams(n=1, logprobs=2 * width, max_tokens=1, temperature=params.temperature,
                                 detokenize=False, ignore_eos=True)
    live = [[BeamSearchSequence(tokens=list(ids))] for ids in prompt_ids]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        results = generate([{"prompt_token_ids": beam.tokens} for _, beam in flat], step_params)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
        for (i, beam), result in zip(flat, results):
            entry = result.outputs[0].logprobs[0]
            for token_id, lp in entry.items():
                new = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [entry],
                                         cum_logprob=beam.cum_logprob + lp.logprob)
                if token_id == eos_token_id and not params.ignore_eos:
                    new.finish_reason = "stop"
                    new.stop_reason = None
                    done[i].append(new)
                else:
                    candidates[i].append(new)
        live = [sorted(c, key=score, reverse=True)[:width] for c in candidates]
    outputs = []
    for i, ids in enumerate(prompt_ids):
        best = sorted(done[i] + live[i], key=score, reverse=True)[:width]
        for beam in best:
            if beam.finish_reason is None:
                beam.finish_reason = "length"
            if decode is not None:
                beam.text = decode(beam.tokens)
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs
