"""Greedy evaluation on the task's held-out problems, run by the learner on its own weights."""

from __future__ import annotations

import torch

from echo2.tasks import Task, prompt_token_ids


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task: Task, *, max_new_tokens: int, batch_size: int) -> dict:
    """Fraction of held-out problems whose greedy completion earns reward 1."""
    problems = task.eval_set()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    correct = 0
    samples = []
    for start in range(0, len(problems), batch_size):
        batch = problems[start : start + batch_size]
        prompts = [prompt_token_ids(tokenizer, p) for p in batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
        )
        for problem, seq in zip(batch, out[:, width:]):
            text = tokenizer.decode(seq, skip_special_tokens=True)
            reward, _ = task.reward(problem, text)
            correct += reward == 1.0
            if len(samples) < 3:
                samples.append({"problem": problem.id, "completion": text})
    model.train(was_training)
    return {"accuracy": correct / len(problems), "n": len(problems), "samples": samples}
