"""A reward function for ``task: {name: reward_fn, reward: echo2_example_plugin.rewards:contains_answer}``."""


def contains_answer(prompt: str, completion: str, answer) -> float:
    """1 when the reply contains the reference answer, else 0: the same on every machine, as the learner needs."""
    return 1.0 if str(answer).strip().lower() in completion.lower() else 0.0
