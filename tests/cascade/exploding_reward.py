"""A reward that must never be called (test_distill_stage.py imports it by dotted path)."""


def explode(response: str, sample: dict) -> float:
    raise RuntimeError("the distill stage called a reward")
