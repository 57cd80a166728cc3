"""A debug dump of one training row: RUN_DIR/rollouts/step_N.txt (`logging.rollout_dump_period`).

The step's first row, as the trainer's forward consumes it (the same tokens, packed or padded),
one line per token: position, id, role (prompt; 1 trained: the policy's; 0 context: a
multi-turn trajectory's environment tokens), the generator's logprob of the token, and its
text. It shows what the loss sees: a tool result's tokens are in the row with loss mask 0.
"""

from __future__ import annotations

from pathlib import Path

HEADER = "# pos  id  mask  gen_logprob  token   (mask: P prompt, 1 trained, 0 context)\n"


def row_lines(batch, row: int, token_text) -> list[str]:
    """One line per real token of `batch` row `row`; token_text(id) is its text."""
    ids = batch.input_ids[row]
    length = int(batch.attention_mask[row].sum())
    lines = []
    for pos in range(length):
        if batch.prompt_mask[row, pos]:
            mask, logprob = "P", ""
        else:  # token pos is target pos - 1
            mask = "1" if batch.target_mask[row, pos - 1] else "0"
            logprob = f"{float(batch.gen_logprobs[row, pos - 1]):.4f}" if mask == "1" else ""
        lines.append(
            f"{pos:5d} {int(ids[pos]):6d}  {mask}  {logprob:>10}  {token_text(ids[pos])!r}"
        )
    return lines


def dump_row(run_dir: Path, step: int, batch, tokenizer) -> Path:
    """Writes the step's first row to RUN_DIR/rollouts/step_N.txt; returns the path."""
    out = run_dir / "rollouts" / f"step_{step:06d}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    trained = int(batch.target_mask[0].sum())
    context = int(batch.attention_mask[0].sum()) - int(batch.prompt_mask[0].sum()) - trained
    lines = row_lines(batch, 0, lambda i: tokenizer.decode([int(i)], skip_special_tokens=False))
    head = f"# step {step}, row 0: {trained} trained tokens, {context} context tokens\n"
    out.write_text(head + HEADER + "\n".join(lines) + "\n")
    return out


def due(period: int, step: int) -> bool:
    return bool(period) and step % period == 0
