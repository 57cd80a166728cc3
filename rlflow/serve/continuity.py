"""Token continuity across a conversation's turns: a later turn's prompt is the last assistant
turn's prompt + generated ids, then the ids the chat template gives the messages after it.

A multi-turn RL episode trains on one token sequence, so each turn's prompt must extend the
previous turn's prompt and generation exactly. Rendering the whole conversation again each turn
does not: the earlier turns' sampled ids, decoded to text and tokenized again, are often other
ids (and a template may render an earlier turn differently once more messages follow).

A client that sends the last assistant turn's `prompt_token_ids` and `generation_token_ids`
back on its message (NeMo Gym's `vllm_model` does, with `return_token_id_information`) gets a
prompt built from them, as NeMo RL's vLLM server does (`_replace_prefix_tokens`):

    prompt = prompt_token_ids + generation_token_ids (its end-of-turn token dropped)
             + the template's ids from the end-of-turn token that closes that assistant turn

The template renders the whole conversation (with the generation prompt) and, once more, the
conversation up to and including that assistant turn (without it). The turn's end in the whole
rendering is its N-th end-of-turn token (the tokenizer's eos), N the count in the shorter
rendering; from there on the template's ids are the environment's (tool results, the next user
message, the next assistant header). Nothing before it is taken from the template, so a template
that renders earlier turns differently (Qwen3's drops old `<think>` blocks) cannot break
continuity. A request where the splice cannot be made exactly is refused with a 400 naming the
message and the first differing position (code `discontinuous_tokens`).
"""

from __future__ import annotations

from rlflow.serve.chat import ApiError, Continuation

CODE = "discontinuous_tokens"


def continue_ids(
    continuation: Continuation,
    whole_ids: list[int],
    upto_ids: list[int],
    eos: int,
    media_ids: tuple[int, ...] = (),
) -> list[int]:
    """The new prompt's ids.

    whole_ids: the template's ids of the whole conversation (with the generation prompt, images
    expanded as the processor does); upto_ids: its ids of the messages up to and including the
    continued assistant turn (no generation prompt; images need not be expanded). media_ids:
    the image/video pad tokens, which must come in the same number before the cut (the pixels
    are the whole conversation's)."""
    where = f"messages[{continuation.message}]"
    ends = [i for i, t in enumerate(upto_ids) if t == eos]
    if not ends:
        raise ApiError(
            400, f"{where} carries token ids, but the chat template does not close an assistant "
            f"turn with the end-of-turn token (id {eos}): its ids cannot be continued",
            where, CODE,
        )  # fmt: skip
    closed = continuation.prompt_ids.count(eos) + 1
    if closed != len(ends):
        raise ApiError(
            400, f"{where}.prompt_token_ids close {closed - 1} turns, but the messages before "
            f"{where} close {len(ends) - 1} in the chat template: the ids belong to another "
            "conversation or another turn", f"{where}.prompt_token_ids", CODE,
        )  # fmt: skip
    whole_ends = [i for i, t in enumerate(whole_ids) if t == eos]
    tail = upto_ids[ends[-1] :]  # the end-of-turn token and what closes the turn (Qwen: "\n")
    cut = whole_ends[len(ends) - 1] if len(whole_ends) >= len(ends) else len(whole_ids)
    after = whole_ids[cut : cut + len(tail)]
    if after != tail:
        at = next((j for j, (a, b) in enumerate(zip(after, tail)) if a != b), len(after))
        raise ApiError(
            400, f"the chat template closes the assistant turn {where} differently once later "
            f"messages follow: token {at} of its end ({tail}) is "
            f"{after[at] if at < len(after) else 'missing'} in the whole conversation (at "
            f"position {cut + at} of the template's ids); its ids cannot be continued exactly",
            where, CODE,
        )  # fmt: skip
    model = list(continuation.prompt_ids) + list(continuation.generated_ids)
    if continuation.generated_ids and model[-1] == eos:
        model.pop()  # the template's own end-of-turn token follows (and closes a cut-off turn)
    for pad in media_ids:
        sent, rendered = model.count(pad), whole_ids[:cut].count(pad)
        if sent != rendered:
            raise ApiError(
                400, f"{where}'s token ids hold {sent} image/video pad tokens (id {pad}), the "
                f"conversation up to it {rendered}: its images are not the ones its ids were "
                "made from", where, CODE,
            )  # fmt: skip
    return model + whole_ids[cut:]
