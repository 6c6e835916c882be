"""A reward that must never be called (test_distill_stage.py imports it by dotted path)."""


def explode(response: str, sample: dict) -> float:
    raise RuntimeError("the distill stage called a reward")


def needs_a_service(response: str, sample: dict) -> float:
    return 1.0


def _refuse(**kwargs) -> None:
    raise RuntimeError(f"preflight refused with {kwargs}")


needs_a_service.preflight = _refuse  # type: ignore[attr-defined]
