"""Models a run can name in its configuration (``[model] factory = "toolkit.models:..."``).

Peers build the run's model from this package only, so a relay can never make a volunteer's
notebook import arbitrary code.
"""

from toolkit.models.byte_transformer import ByteTransformer, TransformerConfig
from toolkit.models.mlp import MLP
from toolkit.models.vector import Vector

__all__ = ["ByteTransformer", "MLP", "TransformerConfig", "Vector", "build_model"]

_FACTORIES = ("ByteTransformer", "MLP", "Vector")


def build_model(factory: str, kwargs: dict) -> "torch.nn.Module":  # noqa: F821
    """Instantiate ``factory`` ("toolkit.models:Name"); refuse anything outside this package."""
    from toolkit.errors import ModelMismatch

    module, _, name = factory.partition(":")
    if module != "toolkit.models" or name not in _FACTORIES:
        raise ModelMismatch("unknown_model", f"model factory {factory!r} is not part of toolkit.models",
                            f"Use one of {', '.join('toolkit.models:' + n for n in _FACTORIES)}, "
                            "or pass your own model to join().")
    return globals()[name](**kwargs)
