"""Run contrafl's algorithms on the Flower runtime (ServerApp/ClientApp).

Importing this package does not import ``flwr``; its modules need the ``flower`` extra
(``pip install "contrafl[flower]"``) and say so with a clear ImportError
(:func:`require_flwr`).
"""


def require_flwr() -> None:
    """Import ``flwr``, or raise an ImportError that says how to install it."""
    try:
        import flwr  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            'contrafl.flower needs Flower (flwr), which is not installed: pip install "contrafl[flower]"'
        ) from exc
